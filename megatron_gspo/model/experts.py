"""Batched routed experts for megatron-core's local (non-Transformer-Engine) spec.

megatron's ``SequentialMLP`` runs one ``MLP`` module per local expert in a Python loop: per expert
and per pass a split, two linear autograd functions, the SwiGLU, the probability scale, and a final
``torch.cat``. ``BatchedSequentialMLP`` keeps SequentialMLP's modules, parameters and
``sharded_state_dict`` untouched (it *is* a SequentialMLP: ``local_experts.N.linear_fc1.weight``
[2F/etp, H] with the [gate; up] layout, ``local_experts.N.linear_fc2.weight`` [H, F/etp], same
checkpoint keys, same DDP/optimizer attributes) and only replaces ``forward``: all local experts
in two grouped GEMMs (fc1, fc2) and one activation over the whole permuted token block.

Weights without copies
    At construction the local experts' fc1 (and fc2) weights are moved into one contiguous
    [E, out, in] buffer and each expert's Parameter becomes a view of its slice (same Parameter
    objects, shapes and attributes; ``load_state_dict`` and optimizers update them in place). The
    forward then sees all experts as one [E, out, in] tensor for free, and the backward hands each
    Parameter its slice of the [E, out, in] gradient. When something rebinds a Parameter's storage
    (``module.to(dtype)``, megatron's distributed optimizer buffers), the layout check fails and the
    weights are stacked with ``torch.stack`` instead: one copy per forward, same results.

Grouped GEMM
    ``torch._grouped_mm`` (torch >= 2.9: CPU any float dtype; CUDA bf16 on SM80+) computes every
    expert's [n_e, in] x [in, out] product in one call, empty experts cost nothing. Where it is not
    available (older torch, CUDA fp32) a loop of ``torch.mm`` over the non-empty experts is used
    (still no module / autograd-function overhead per expert, and no ``torch.cat``). The choice can
    be forced with ``BatchedSequentialMLP.gemm_impl`` ("auto" | "grouped_mm" | "loop" | "bmm";
    "bmm" pads every expert to the largest token count and runs one ``torch.bmm``).

Numerics (what SequentialMLP / megatron's MLP do in 0.16, reproduced exactly)
    * ``moe_apply_probs_on_input`` (top-1 only): probs scale the input, then are reset to 1;
    * fc1 -> SwiGLU ``act(gate) * (up + glu_linear_offset)`` (with ``activation_func_clamp_value``)
      -> ``* probs`` (in the probs' dtype, fp32 with the fp32 router) -> cast back to the
      activation dtype -> fc2. With ``bias_activation_fusion`` (GPU) megatron's fused
      ``weighted_bias_swiglu_impl`` is called, as MLP does;
    * returns ``(output, None)``: the expert-tensor-parallel partial sums are reduced (and the
      expert-parallel tokens returned) by the token dispatcher, as for SequentialMLP.
    Anything this path does not cover (FP8/FP4 padding, biases, TE activation functions, latent
    MoE) falls back to ``SequentialMLP.forward``.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn.functional as F
from megatron.core.transformer.moe.experts import SequentialMLP

__all__ = ["BatchedSequentialMLP", "expert_activation", "grouped_linear", "grouped_mm_available"]

_GROUPED_MM_OK: dict[tuple[str, torch.dtype], bool] = {}


def grouped_mm_available(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether ``torch._grouped_mm`` runs (forward and backward) for this device type and dtype.

    Probed once per (device type, dtype) on a tiny problem, since support differs by torch version
    (CPU kernel since 2.9), device capability (CUDA: SM80+) and dtype (CUDA: bf16 only)."""
    key = (device.type, dtype)
    if key not in _GROUPED_MM_OK:
        ok = hasattr(torch, "_grouped_mm")
        if ok and device.type == "cuda":
            ok = dtype == torch.bfloat16 and torch.cuda.get_device_capability(device) >= (8, 0)
        if ok:
            try:
                with torch.enable_grad():
                    x = torch.randn(24, 16, device=device, dtype=dtype, requires_grad=True)
                    w = torch.randn(3, 16, 16, device=device, dtype=dtype, requires_grad=True)
                    offs = torch.tensor([8, 8, 24], device=device, dtype=torch.int32)
                    y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
                    y.backward(torch.ones_like(y))
                ref = x.detach()[8:] @ w.detach()[2].t()
                ok = bool(torch.allclose(y.detach()[8:].float(), ref.float(), rtol=2e-2, atol=2e-2))
            except Exception:  # no kernel for this device/dtype in this torch build
                ok = False
        _GROUPED_MM_OK[key] = ok
    return _GROUPED_MM_OK[key]


def grouped_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], counts: Sequence[int], impl: str = "auto",
                   offs: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Rows of ``x`` [N, in], grouped by expert (``counts[e]`` consecutive rows for expert e), times
    their expert's ``weights[e].T`` (each [out, in], megatron's linear layout) -> [N, out].

    impl: "grouped_mm" (one ``torch._grouped_mm`` over the [E, out, in] stack of the weights),
    "bmm" (experts padded to the largest count, one ``torch.bmm``), "loop" (one ``torch.mm`` per
    non-empty expert), "auto" (grouped_mm where available, else loop). ``offs``: optional int32
    cumulative counts on x's device (grouped_mm), computed when not given."""
    if impl == "auto":
        impl = "grouped_mm" if grouped_mm_available(x.device, x.dtype) else "loop"
    if impl == "loop":
        return _loop_linear(x, weights, counts)
    w = stacked_weights(weights)  # [E, out, in]
    if impl == "grouped_mm":
        if offs is None:
            offs = torch.tensor(list(counts), dtype=torch.int32).cumsum(0, dtype=torch.int32).to(x.device)
        y = torch._grouped_mm(x, w.transpose(1, 2), offs=offs)
        if y.requires_grad:
            # grouped_mm's backward refuses gradients with zero strides (e.g. from a sum)
            y.register_hook(_contiguous)
        return y
    if impl == "bmm":
        E, n_max = w.shape[0], max(counts)
        counts_t = torch.as_tensor(list(counts), device=x.device)
        starts = torch.cumsum(counts_t, 0) - counts_t
        # destination slot of each row in the padded [E * n_max] block
        expert_of_row = torch.repeat_interleave(torch.arange(E, device=x.device), counts_t)
        slot = expert_of_row * n_max + (torch.arange(x.shape[0], device=x.device) - starts[expert_of_row])
        xp = x.new_zeros(E * n_max, x.shape[1]).index_copy(0, slot, x)
        y = torch.bmm(xp.view(E, n_max, -1), w.transpose(1, 2))
        return y.reshape(E * n_max, -1).index_select(0, slot)
    raise ValueError(f"grouped_linear: unknown impl {impl!r} (auto | grouped_mm | loop | bmm)")


def _aligned_for_grouped_mm(x: torch.Tensor, *weight_lists: Sequence[torch.Tensor]) -> bool:
    """grouped_mm kernels need 16-byte aligned row strides (e.g. bf16 dims multiple of 8)."""
    dims = [x.shape[1]] + [d for ws in weight_lists for d in ws[0].shape]
    return all(d * x.element_size() % 16 == 0 for d in dims)


def _contiguous(g: torch.Tensor) -> torch.Tensor:
    return g.contiguous()


def _loop_linear(x: torch.Tensor, weights: Sequence[torch.Tensor], counts: Sequence[int]) -> torch.Tensor:
    out_features = weights[0].shape[0]
    if not (torch.is_grad_enabled() and (x.requires_grad or any(w.requires_grad for w in weights))):
        out = x.new_empty(x.shape[0], out_features)  # no autograd: write each expert's rows in place
        start = 0
        for w, n in zip(weights, counts):
            if n:
                torch.mm(x[start:start + n], w.t(), out=out[start:start + n])
            start += n
        return out
    # with autograd: every expert takes part (empty ones too, as in SequentialMLP), so each weight
    # gets a gradient (zeros for an expert without tokens) like with the stacked variants
    outs, start = [], 0
    for w, n in zip(weights, counts):
        outs.append(x[start:start + n] @ w.t())
        start += n
    return torch.cat(outs, dim=0)


# ----------------------------------------------------------------------------------------------
# Expert weights as one [E, out, in] tensor
# ----------------------------------------------------------------------------------------------


def _pack(params: list[torch.nn.Parameter]) -> None:
    """Move same-shaped parameters into one contiguous [E, ...] buffer; each Parameter becomes a
    view of its slice (values, objects and attributes unchanged)."""
    if len(params) < 2:
        return
    p0 = params[0]
    if any(p.shape != p0.shape or p.dtype != p0.dtype or p.device != p0.device for p in params):
        return
    with torch.no_grad():
        buf = torch.empty((len(params), *p0.shape), dtype=p0.dtype, device=p0.device)
        for i, p in enumerate(params):
            buf[i].copy_(p)
        for i, p in enumerate(params):
            p.data = buf[i]


def _packed_view(params: Sequence[torch.Tensor]) -> Optional[torch.Tensor]:
    """[E, *shape] view over the parameters' storage if they are consecutive slices of one
    contiguous buffer (what ``_pack`` made and nothing has rebound since); else None."""
    p0 = params[0]
    if not p0.is_contiguous():
        return None
    n = p0.numel()
    storage = p0.untyped_storage().data_ptr()
    off = p0.storage_offset()
    for i, p in enumerate(params):
        if (p.untyped_storage().data_ptr() != storage or p.storage_offset() != off + i * n
                or not p.is_contiguous() or p.shape != p0.shape or p.dtype != p0.dtype):
            return None
    return torch.as_strided(p0.detach(), (len(params), *p0.shape), (n, *p0.stride()), off)


class _StackedParams(torch.autograd.Function):
    """Forward: the zero-copy [E, ...] view of the packed parameters. Backward: each parameter's
    gradient is its slice of the [E, ...] gradient (views, no copy)."""

    @staticmethod
    def forward(ctx, packed: torch.Tensor, *params: torch.Tensor) -> torch.Tensor:
        return packed.view_as(packed)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return (None, *grad.unbind(0))


def stacked_weights(params: Sequence[torch.Tensor]) -> torch.Tensor:
    """The parameters as one differentiable [E, ...] tensor (zero-copy when packed)."""
    packed = _packed_view(params)
    if packed is None:
        return torch.stack(list(params), dim=0)
    if torch.is_grad_enabled() and any(p.requires_grad for p in params):
        return _StackedParams.apply(packed, *params)
    return packed


def expert_activation(c, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
    """The experts' activation + per-token scale of megatron 0.16 (MLP.forward's non-TE branches, which
    TEGroupedMLP.forward repeats: the fused weighted SwiGLU / quick-GeGLU with bias_activation_fusion,
    else the gated unit in the activation dtype times the probs) on h [n, 2F or F], probs [n]; c is
    the TransformerConfig."""
    if c.bias_activation_fusion:
        from megatron.core.transformer import mlp as mlp_mod

        if c.activation_func == F.silu and c.gated_linear_unit:
            return mlp_mod.weighted_bias_swiglu_impl(h, None, probs.unsqueeze(-1),
                                                     c.activation_func_fp8_input_store)
        if c.activation_func == mlp_mod.quick_gelu and c.gated_linear_unit:
            return mlp_mod.weighted_bias_quick_geglu_impl(
                h, None, probs.unsqueeze(-1), c.activation_func_fp8_input_store,
                c.glu_linear_offset, c.activation_func_clamp_value)
        raise ValueError("Only support fusion of swiglu and quick_gelu with per_token_scale in MLP.")
    if c.gated_linear_unit:
        x_glu, x_linear = torch.chunk(h, 2, dim=-1)
        if (val := c.activation_func_clamp_value) is not None:
            x_glu = x_glu.clamp(min=None, max=val)
            x_linear = x_linear.clamp(min=-val, max=val)
        h = c.activation_func(x_glu) * (x_linear + c.glu_linear_offset)
    else:
        h = c.activation_func(h)
    dtype = h.dtype
    return (h * probs.unsqueeze(-1)).to(dtype)


# ----------------------------------------------------------------------------------------------
# The module
# ----------------------------------------------------------------------------------------------


class BatchedSequentialMLP(SequentialMLP):
    """SequentialMLP (same parameters and checkpoint layout) whose forward runs all local experts
    in a few batched kernels. See the module docstring."""

    # "auto" | "grouped_mm" | "loop" | "bmm"  (a class attribute: benchmarks and tests may set it)
    gemm_impl: str = "auto"

    def __init__(self, num_local_experts, config, submodules, pg_collection=None, **kwargs):
        # kwargs: what newer megatron-cores pass besides (0.19: the module's ``name``)
        super().__init__(num_local_experts, config, submodules, pg_collection=pg_collection, **kwargs)
        if self._batchable():
            _pack([e.linear_fc1.weight for e in self.local_experts])
            _pack([e.linear_fc2.weight for e in self.local_experts])

    def _batchable(self) -> bool:
        c = self.config
        if c.fp8 or getattr(c, "fp4", None) or c.add_bias_linear or getattr(c, "use_te_activation_func", False):
            return False
        if getattr(c, "moe_latent_size", None) is not None:
            return False
        mlp = self.local_experts[0]
        return all(hasattr(mlp, n) and hasattr(getattr(mlp, n), "weight") for n in ("linear_fc1", "linear_fc2"))

    def _activation(self, h: torch.Tensor, probs: torch.Tensor) -> torch.Tensor:
        return expert_activation(self.config, h, probs)

    def forward(self, permuted_local_hidden_states: torch.Tensor, tokens_per_expert: torch.Tensor,
                permuted_probs: torch.Tensor):
        if not self._batchable():
            return super().forward(permuted_local_hidden_states, tokens_per_expert, permuted_probs)
        c = self.config
        x, probs = permuted_local_hidden_states, permuted_probs
        if c.moe_apply_probs_on_input:
            assert c.moe_router_topk == 1, "`moe_apply_probs_on_input` only works with `moe_router_topk`=1."
            dtype = x.dtype
            x = (probs.unsqueeze(-1) * x).to(dtype)
            probs = torch.ones_like(probs)

        counts = [int(n) for n in tokens_per_expert.tolist()]
        if len(counts) != self.num_local_experts:
            raise ValueError(f"tokens_per_expert has {len(counts)} entries for {self.num_local_experts} local experts")
        w1 = [e.linear_fc1.weight for e in self.local_experts]  # each [2F/etp, H]
        w2 = [e.linear_fc2.weight for e in self.local_experts]  # each [H, F/etp]
        impl = self.gemm_impl
        if impl == "auto":
            impl = "grouped_mm" if grouped_mm_available(x.device, x.dtype) else "loop"
        if impl == "bmm" and max(counts) == 0:
            impl = "loop"
        if impl == "grouped_mm" and not _aligned_for_grouped_mm(x, w1, w2):
            impl = "loop"
        offs = None
        if impl == "grouped_mm":  # one host->device copy shared by both GEMMs
            offs = torch.tensor(counts, dtype=torch.int32).cumsum(0, dtype=torch.int32).to(x.device, non_blocking=True)
        h = grouped_linear(x, w1, counts, impl, offs)
        h = self._activation(h, probs)
        out = grouped_linear(h, w2, counts, impl, offs)
        return out, None
