"""A lean, graph-ready incremental forward for generation, on the GPTModel's own modules and weights.

Why: a decode step of megatron-core's ``GPTModel`` with its ``StaticInferenceContext`` does work
that a one-token step does not need. Its KV cache stores keys *before* RoPE, so every step
re-applies RoPE to every cached key of every layer (O(sequence) per step, growing with the
response); the cache is sequence-first, so each step's attention reads strided K/V; every layer
goes through the inference context's bookkeeping, the bias-dropout-add closures and the
[s, b] <-> [b, s] layout copies of the output layer; and its MoE layers move the expert token
counts to the host (``tokens_per_expert.cpu()``, ``.tolist()``, ``masked_select``) in every layer of
every step, which on a GPU makes each step wait for the previous one.

``LeanDecoder`` runs the same computation with the same parameters: the embedding, each layer's
own norm modules (``input_layernorm``, ``q_layernorm``/``k_layernorm``, ``pre_mlp_layernorm``,
``final_layernorm``), its router module (megatron's routing, forward hooks included in eager
steps), with the attention projections, RoPE, a KV cache of *roped* keys ([b, groups, slots, head
dim], batch-first) and the experts (``DeviceMoE``: the one-rank dispatch with the expert counts kept
on the device, megatron's grouped-GEMM expert module) done here; only the last position's logits are
computed. Logits equal the megatron path's to float rounding (tests/test_decode.py).

Graph-ready decode step
    A decode step reads everything from buffers that live as long as the decoder: the fed tokens
    (``tok_in``), each row's left padding (``left_pad``), the slot being written (``cur``, a device
    scalar), the KV caches; positions, the attention mask and the KV write slot are computed from
    them on the device. Weights are read in place (never copied), so a captured step stays valid
    across optimizer steps, which update parameters in place. With ``static=True`` every step
    attends over all KV slots (later slots masked) so its shapes depend on the batch size only;
    with ``graphs=True`` (CUDA) the step of each batch-size bucket (1, 2, 4, ..., the batch) is
    captured once with ``torch.cuda.CUDAGraph`` and replayed, rows past the live ones being fillers
    whose outputs are ignored. Eager (the default, and the only mode the CPU tests can run) passes
    the exact batch size and attends over the written slots only, the same code otherwise. A step
    makes no host synchronisation (no ``.item()``, ``.cpu()`` or data-dependent shape) with
    ``DeviceMoE`` in every layer (tests/test_host_syncs.py).

One decoder per job
    generation.Generator keeps a decoder across generations; ``begin`` readies it for one (its KV
    cache, the left padding, the weights as they are now) and ``end`` closes it. With graphs the KV
    caches and the captured steps are kept (captured once per job; grown, and captured again, only
    when a generation needs more rows or slots, or when a weight moved in memory); without, the KV
    caches live for one generation, or, for a multi-turn row's turns, from one to the next (``begin``'s
    ``keep`` and ``carry``; ``extend`` prefills a turn's new tokens onto them; ``release`` frees them).

Shared-prefix decode attention (``share_prefix``; generation.shared_prefix_attention)
    The G rows of a prompt hold the same prompt block. With the prompts prefilled into the prompt store
    (``prefill_to_store``), ``share_prefix`` makes the decode steps read each prompt's keys and values once
    (shared_prefix.shared_prefix_attention: each cache row names its store row, ``prefix_row``, and its cell
    among that row's queries, ``prefix_cell``; compaction and ``admit`` move them with the rows) and each row's
    own slots from the prompt block's end on, merging the two softmaxes exactly. A resumed generation
    (``carry`` + ``extend``) shares its rows' first-turn prompts too (``share_kept_prefix``: the store taken from
    one kept cache row per prompt, right-aligned to a split slot; each row's prompt tail past it masked in its own
    keys, ``prompt_end``). Eager and static steps; a captured one never shares (its shapes cannot follow a call's
    prompt count).

Routes (R3 and the routing metrics): with ``record_routes`` each forward also writes every layer's
top-k expert ids ([b, s, k], the router's own routing map) into a buffer, so a replayed graph
records them too; ``last_routes()`` hands them to generation's ``on_forward`` callback.

Both specs, one computation
    The local spec (megatron's DotProductAttention or our SDPAttention, our RMSNorm modules,
    BatchedSequentialMLP experts) and the Transformer Engine spec (the NGC container's: the input
    norm fused into ``linear_qkv`` as ``linear_qkv.layer_norm_weight``, TE's RMSNorm modules for the
    q/k, pre-MLP and final norms, ``TEGroupedMLP`` experts with ``linear_fc1.weight0..N``, TE's
    attention) are read as they are: the weights in place, never converted. The step runs its own
    torch ops on them and never a TE kernel: TE norms are computed here with TE's formula (fp32,
    ``zero_centered_gamma`` honoured), TE's grouped experts go through the same device-side dispatch
    and ``torch._grouped_mm`` (or, where there is none, a loop of GEMMs over host-side counts: eager
    only), and for the duration of a generation every router's gating GEMM is torch's
    (``torch_router_gating``: megatron's router calls TE's ``general_gemm`` whenever TE imports).
    So the fast path, and its CUDA graphs, are the default in the container too. Its numerics are
    the decoder's own (summation orders differ from TE's kernels by rounding): in bf16 the old
    log-probs are recomputed by a training forward anyway (config.old_logprob_source), and FP8 is
    not decoded here (it keeps megatron's path, where TE runs the FP8 GEMMs the policy trains with).

Sharded weights: TP, EP, expert-TP
    Under tensor parallelism each rank holds its attention heads' QKV and output-projection shards
    (KV cache: its query groups only), a vocabulary shard of the embedding and of the output layer;
    the step runs megatron's collectives of a row-parallel layer without sequence parallelism (the
    attention output's all-reduce over the TP group, then the bias), the vocab-parallel embedding's
    all-reduce, and all-gathers the last position's vocab-parallel logits so that every TP rank
    samples from the full distribution (generation.generator broadcasts the draw). The MoE layers
    dispatch over megatron's expert-TP x EP group with its all-gather dispatcher (``DeviceMoE``:
    the group's tokens and routes all-gathered, each rank's experts and expert-TP shards on their
    pairs in a capacity-padded buffer that never drops a token, a reduce-scatter back). Every
    collective goes through runtime/comm.py, on fixed shapes, with no host synchronisation, so the
    step stays graph-capturable; every rank of the lockstep group (generation.groups) runs it with
    the same batch size. Sequence parallelism is simply not used: a decode step has one token.

It covers the layouts generation uses on one pipeline stage: PP = CP = 1, any TP / EP / expert-TP,
RoPE, no MLA / gated attention, RMSNorm.
Anything else is refused by ``lean_decode_unsupported`` with the reason, and ``generate`` keeps
megatron's path (``generation.decode_impl=auto``) or raises (``decode_impl=lean``).
"""

from __future__ import annotations

import contextlib
import logging
from typing import Callable, Iterator, Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_gspo.config.rules import LEAN_MOE_GATHER_TOKENS, lean_decode_limit
from megatron_gspo.generation.groups import DecodeGroups
from megatron_gspo.generation.shared_prefix import prefix_cells, shared_prefix_attention
from megatron_gspo.runtime import comm

log = logging.getLogger("megatron_gspo")

__all__ = ["DeviceMoE", "LeanDecoder", "device_moe_unsupported", "lean_decode_unsupported", "rms_norm",
           "torch_router_gating"]


def _is_te(module) -> bool:
    """A Transformer Engine module (or megatron's wrapper of one): its forward would run TE kernels."""
    return any(c.__module__.startswith(("transformer_engine", "megatron.core.extensions.transformer_engine"))
               for c in type(module).__mro__)


def _te_norm_unsupported(norm) -> Optional[str]:
    """Why a TE norm module (or TE's norm fused into linear_qkv) cannot be computed here, else None."""
    kind = getattr(norm, "normalization", None) or type(norm).__name__
    if kind != "RMSNorm":
        return f"Transformer Engine {kind} (the lean decoder computes RMSNorm only)"
    return None


def lean_decode_unsupported(m) -> Optional[str]:
    """Why the lean path cannot run this (unwrapped) GPTModel, or None when it can: the limits its
    TransformerConfig shows (config.rules.LEAN_DECODE_LIMITS, the table a job's config is checked against
    too), then what only the built modules show."""
    why = lean_decode_limit(m.config)
    if why is not None:
        return why
    if getattr(m, "position_embedding_type", None) != "rope":
        return "position embedding is not RoPE"
    rope = m.rotary_pos_emb
    if getattr(rope, "seq_len_interpolation_factor", None) is not None or type(rope).__name__ != "RotaryEmbedding":
        return "RoPE scaling"
    for layer in m.decoder.layers:
        att = layer.self_attention
        if type(att).__name__ != "SelfAttention":
            return f"attention module {type(att).__name__}"
        core = att.core_attention
        # the step computes attention itself: megatron's (or our SDPA) core attention, or TE's with the
        # plain causal mask (its kernels are never called; sliding windows / softmax offsets are refused
        # above from the config)
        if not (isinstance(core, DotProductAttention) or type(core).__name__ == "TEDotProductAttention"):
            return f"core attention {type(core).__name__}"
        mask = getattr(core, "attn_mask_type", None)
        mask = getattr(mask, "name", mask)  # megatron's AttnMaskType, or TE's string
        if mask is not None and mask != "causal":
            return f"attention mask {mask}"
        if hasattr(layer, "cross_attention") and type(layer.cross_attention).__name__ != "IdentityOp":
            return "cross attention"
        fused = hasattr(att.linear_qkv, "layer_norm_weight")  # TE's LayerNormLinear: the input norm inside
        if fused and type(layer.input_layernorm).__name__ != "IdentityOp":
            return "an input norm both fused into linear_qkv and separate"
        if fused and getattr(att.linear_qkv, "layer_norm_bias", None) is not None:
            return "a norm bias in linear_qkv"
        norms = [att.linear_qkv if fused else layer.input_layernorm, att.q_layernorm, att.k_layernorm,
                 layer.pre_mlp_layernorm]
        for norm in norms:
            if norm is not None and (fused and norm is att.linear_qkv or _is_te(norm)):
                why = _te_norm_unsupported(norm)
                if why:
                    return why
        if _is_te(layer.mlp) or any(_is_te(mod) for mod in layer.mlp.modules()):
            why = device_moe_unsupported(layer.mlp)
            if why is not None:  # megatron's layer would run TE's kernels: nothing to fall back on
                return f"MLP: {why}"
    final = getattr(m.decoder, "final_layernorm", None)
    if final is not None and _is_te(final) and _te_norm_unsupported(final):
        return _te_norm_unsupported(final)
    return None


# ----------------------------------------------------------------------------------------------
# Transformer Engine's modules computed with torch ops on their own weights
# ----------------------------------------------------------------------------------------------


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, zero_centered_gamma: bool = False) -> torch.Tensor:
    """Transformer Engine's RMSNorm (TE's rmsnorm_fwd; its reference: ops/basic/rmsnorm.py): in fp32,
    x / rms(x) times the weight (plus 1 with zero-centered gamma), cast back to x's dtype."""
    xf = x.float()
    w = weight.float() + 1 if zero_centered_gamma else weight.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * w).to(x.dtype)


def norm_op(module, weight_name: str = "weight") -> Optional[Callable[[torch.Tensor], torch.Tensor]]:
    """The norm ``module`` as a function: TE's (a norm module, or the norm fused into a LayerNormLinear,
    ``weight_name="layer_norm_weight"``) computed by ``rms_norm`` on its own weight; anything else is
    called (the local spec's modules: their own numerics, bitwise megatron's forward)."""
    if module is None or type(module).__name__ == "IdentityOp":
        return None
    if not _is_te(module):
        return module
    eps, zc = module.eps, bool(getattr(module, "zero_centered_gamma", False))
    return lambda x: rms_norm(x, getattr(module, weight_name), eps, zc)


def _bias(linear) -> Optional[torch.Tensor]:
    """A linear layer's bias, or None (TE keeps an empty tensor when there is none)."""
    b = getattr(linear, "bias", None)
    return None if b is None or b.numel() == 0 else b


def _torch_gating(router):
    """megatron's router gating (moe_utils.RouterGatingLinearFunction's torch branch: the input and
    weight in the router dtype, one GEMM), which megatron runs with TE's general_gemm when TE imports."""
    dtype = {"fp32": torch.float32, "fp64": torch.float64}.get(router.config.moe_router_dtype)

    def gating(inp: torch.Tensor) -> torch.Tensor:
        dt = dtype or inp.dtype
        x = inp.reshape(-1, inp.shape[-1]).to(dt)
        w = router.weight.to(dt).t()
        out = torch.mm(x, w) if router.bias is None else torch.addmm(router.bias.to(dt), x, w)
        return out.view(*inp.shape[:-1], -1)

    return gating


@contextlib.contextmanager
def torch_router_gating(m) -> Iterator[None]:
    """For the duration of the block, every MoE router of ``m`` computes its gating GEMM with torch (an
    instance attribute shadows ``TopKRouter.gating``; routing, hooks and the routing map are megatron's)."""
    from megatron.core.transformer.moe.router import TopKRouter

    routers = [mod for mod in m.modules() if isinstance(mod, TopKRouter)]
    for r in routers:
        r.gating = _torch_gating(r)
    try:
        yield
    finally:
        for r in routers:
            r.__dict__.pop("gating", None)


# ----------------------------------------------------------------------------------------------
# MoE layer on one rank, expert counts on the device
# ----------------------------------------------------------------------------------------------


def _expert_weights(ex) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Each local expert's fc1 [2F, H] and fc2 [H, F] weight, as the module stores them: SequentialMLP's
    ``local_experts.N.linear_fc{1,2}.weight`` or TE's grouped linears' ``linear_fc{1,2}.weightN``."""
    if type(ex).__name__ == "TEGroupedMLP":
        n = ex.num_local_experts
        return ([getattr(ex.linear_fc1, f"weight{i}") for i in range(n)],
                [getattr(ex.linear_fc2, f"weight{i}") for i in range(n)])
    return [e.linear_fc1.weight for e in ex.local_experts], [e.linear_fc2.weight for e in ex.local_experts]


def _te_experts_unsupported(ex) -> Optional[str]:
    c = ex.config
    if getattr(c, "use_te_activation_func", False):
        return "TEGroupedMLP with Transformer Engine's activation function"
    if getattr(ex.linear_fc1, "use_bias", False) or getattr(ex.linear_fc2, "use_bias", False):
        return "TEGroupedMLP with biases"
    if getattr(ex.linear_fc1, "single_grouped_weight", False) or not hasattr(ex.linear_fc1, "weight0"):
        return "TEGroupedMLP weights in one grouped tensor"
    if c.fp8 or getattr(c, "fp4", None):
        return "FP8 / FP4 experts"
    if not c.gated_linear_unit and getattr(c, "use_fused_weighted_squared_relu", False):
        return "TEGroupedMLP's fused squared ReLU"
    return None


def device_moe_unsupported(mlp) -> Optional[str]:
    """Why ``DeviceMoE`` cannot stand in for this MLP module (megatron's MoE layer then runs)."""
    from megatron.core.transformer.moe.moe_layer import MoELayer
    from megatron.core.transformer.moe.token_dispatcher import (
        MoEAllGatherTokenDispatcher,
        MoEAlltoAllTokenDispatcher,
    )

    from megatron_gspo.model.experts import BatchedSequentialMLP, _aligned_for_grouped_mm, grouped_mm_available

    if not isinstance(mlp, MoELayer):
        return f"{type(mlp).__name__} is not an MoE layer"
    c = mlp.config
    if not isinstance(mlp.token_dispatcher, (MoEAllGatherTokenDispatcher, MoEAlltoAllTokenDispatcher)):
        return f"token dispatcher {type(mlp.token_dispatcher).__name__}"
    if mlp.use_shared_expert or getattr(c, "moe_latent_size", None):
        return "shared experts / latent MoE"
    if c.moe_expert_capacity_factor is not None:
        return "expert capacity (token dropping)"
    ex = mlp.experts
    if type(ex).__name__ == "TEGroupedMLP":
        # TE's grouped experts: no megatron layer to fall back on without TE's kernels, so a missing
        # grouped_mm means the loop of GEMMs over host-side counts (DeviceMoE.sync_free False)
        return _te_experts_unsupported(ex)
    if type(ex) is not BatchedSequentialMLP or not ex._batchable():
        return f"expert module {type(ex).__name__} (not the batched grouped-GEMM path)"
    if ex.gemm_impl not in ("auto", "grouped_mm"):
        return f"BatchedSequentialMLP.gemm_impl={ex.gemm_impl!r}"
    w1, w2 = _expert_weights(ex)
    if not grouped_mm_available(w1[0].device, w1[0].dtype):
        return f"no torch._grouped_mm for {w1[0].device.type} {w1[0].dtype}"
    probe = torch.empty(0, w1[0].shape[1], dtype=w1[0].dtype, device=w1[0].device)
    if not _aligned_for_grouped_mm(probe, w1, w2):
        return "expert shapes not 16-byte aligned for grouped_mm"
    return None


def _expert_stack(params: list[torch.Tensor]) -> tuple[Optional[torch.Tensor], bool]:
    """The experts' weights as one [E, out, in] tensor *without a copy*, and whether it holds them in
    reverse expert order; (None, False) when there is no such view.

    Views exist when the parameters are consecutive equal slices of one storage: BatchedSequentialMLP
    packs its experts so at construction, and megatron's DDP buffer (distributed optimizer) lays
    parameters out in reverse module order, experts N-1 .. 0. Parameters that each own their storage
    (TE's weight0..N as built) are packed into one buffer first (experts._pack: the same Parameter
    objects, their ``.data`` views of it), which nothing else can observe."""
    from megatron_gspo.model.experts import _pack, _packed_view

    for rev in (False, True):
        view = _packed_view(params[::-1] if rev else params)
        if view is not None:
            return view, rev
    if all(p.storage_offset() == 0 and p.untyped_storage().nbytes() == p.numel() * p.element_size() for p in params):
        _pack(params)
        return _packed_view(params), False
    return None, False


def _grouped_mm_ok(w1: list[torch.Tensor], w2: list[torch.Tensor]) -> bool:
    from megatron_gspo.model.experts import _aligned_for_grouped_mm, grouped_mm_available

    probe = torch.empty(0, w1[0].shape[1], dtype=w1[0].dtype, device=w1[0].device)
    return grouped_mm_available(w1[0].device, w1[0].dtype) and _aligned_for_grouped_mm(probe, w1, w2)


class DeviceMoE:
    """megatron's MoE layer forward without host synchronisation, on one rank or over the expert group.

    megatron's dispatchers find each expert's tokens with ``masked_select`` and move the per-expert
    token counts to the host (the grouped GEMM's splits). Here the same permutation (expert-major,
    tokens in order: a stable sort of the routing map) and the grouped GEMM's offsets are computed on
    the device, with static shapes (every token has exactly top-k experts: no token dropping). The
    router, the experts' weights and their activation are the layer's own modules and functions
    (megatron's expert activation: experts.expert_activation), and the un-permutation is megatron's
    scatter-add: outputs equal the megatron layer's (bitwise on the CPU, tests/test_decode.py).

    Over an expert group (``group``: megatron's expert-TP x EP group, ``pg.tp_ep``; its ranks hold
    different rows under EP / expert-TP) the dispatch is megatron's all-gather dispatcher, which its
    inference engine uses for CUDA-graphed decode too: every rank all-gathers the group's tokens with
    their top-k expert ids and probabilities (one [t, H] and one [t, 2k] all-gather, every rank
    contributing the same t tokens: the generation's lockstep), runs its local experts (its
    expert-TP shard of each) on the (token, expert) pairs that are theirs, and a reduce-scatter sums
    the partial outputs (other experts, other expert-TP shards) back to the rank that owns each token,
    in the routing probabilities' dtype as megatron's dispatcher does. Routing runs on the rank that
    holds the token, with the router's full (replicated) weight: the routing map is the single-rank
    one, global expert ids.

    Capacity. The number of pairs a rank gets differs from step to step, so a graph-ready step pads
    its pair buffer to a capacity that can never overflow: ``T x min(k, E_local)`` rows for the T
    gathered tokens (a token picks k distinct experts, at most ``E_local`` of them on this rank; the
    capacity megatron's inference uses for CUDA graphs, ``num_experts / topk`` as capacity factor,
    is the per-expert form of the same rule: every token could go to one expert). No token is ever
    dropped, so results are the single-rank decoder's; the padding rows (past the grouped GEMM's last
    offset, never computed there) are added into a discarded row. ``static=False`` (the prefill,
    never captured: its T is rows x prompt block, where the capacity would be k x the work) sizes the
    buffer to the exact count instead, read on the host: one sync per MoE layer of the prefill.
    One dispatch gathers at most ``config.rules.LEAN_MOE_GATHER_TOKENS`` tokens: a longer input (a
    prefill of rows x prompt tokens) goes through in chunks, the same on every rank of the group,
    which bounds the gathered activations, the pairs and the fp32 partial outputs of a dispatch.

    The experts are the local spec's BatchedSequentialMLP or Transformer Engine's TEGroupedMLP (its
    ``weight0..N`` read in place; its TE kernels never run). Where ``torch._grouped_mm`` cannot take
    the weights (CUDA fp32, older torch), TE's experts run as a loop of GEMMs over counts read on the
    host: ``sync_free`` is then False (eager steps only; no CUDA graph)."""

    def __init__(self, mlp, group=None) -> None:
        reason = device_moe_unsupported(mlp)
        if reason is not None:
            raise ValueError(f"DeviceMoE: {reason}")
        self.mlp = mlp
        self.topk = mlp.config.moe_router_topk
        self.num_experts = mlp.config.num_moe_experts
        self.group = group if group is not None and comm.world_size(group) > 1 else None
        self.num_local = getattr(mlp, "num_local_experts", self.num_experts)
        self.first_local = mlp.local_expert_indices[0] if self.group is not None else 0
        self.bind()

    def bind(self) -> None:
        """Take the experts' weights as they are now: the parameters themselves (in-place updates are
        seen) and ``[E, out, in]`` views of their storage for grouped_mm (no per-step copy; where there is
        none, the weights are stacked at every forward: one copy of the experts per layer and step).
        A view is of the storage the parameters had when it was taken: a decoder kept across
        generations calls this at the start of each one (LeanDecoder.begin), so a parameter rebound
        since (``p.data = ...``: a checkpoint load, a wrapper's buffer) is read where it now lives."""
        self.w1, self.w2 = _expert_weights(self.mlp.experts)
        self.sync_free = _grouped_mm_ok(self.w1, self.w2)
        self.reversed, self.stacks = False, None
        if self.sync_free and len(self.w1) > 1:
            (s1, r1), (s2, r2) = _expert_stack(self.w1), _expert_stack(self.w2)
            if s1 is not None and s2 is not None and r1 == r2:
                self.stacks, self.reversed = (s1, s2), r1

    def __call__(self, h: torch.Tensor, hooks: bool = True, static: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
        """h [s, b, H] -> (output [s, b, H], routing map [s*b, E] bool of this rank's tokens). ``hooks=False``
        calls the router's forward directly (forward hooks are Python: they cannot run in a replayed
        graph); ``static``: the capacity-padded pair buffer over an expert group (class doc)."""
        mlp = self.mlp
        probs, routing_map = mlp.router(h) if hooks else mlp.router.forward(h)
        if self.group is not None:
            # the dispatch in chunks of LEAN_MOE_GATHER_TOKENS gathered tokens (the prefill's rows x prompt
            # tokens; a decode step is one chunk): the same chunks on every rank, whose t is the group's
            x = h.reshape(-1, h.shape[-1])
            step = max(1, LEAN_MOE_GATHER_TOKENS // comm.world_size(self.group))
            outs = [self._over_group(x[i:i + step], probs[i:i + step], routing_map[i:i + step], static)
                    for i in range(0, x.shape[0], step)]
            return (outs[0] if len(outs) == 1 else torch.cat(outs)).view(h.shape), routing_map
        # experts in the order of their weights in memory (reversed: DDP's buffer order)
        rmap, probs = (routing_map.flip(1), probs.flip(1)) if self.reversed else (routing_map, probs)
        x = h.reshape(-1, h.shape[-1])  # [t, H], the dispatcher's token order (sequence-major)
        t, E = rmap.shape
        # megatron's permute: for each expert in order, its tokens in order (masked_select of the
        # transposed map); a stable sort puts the selected entries first, in that order
        flat = rmap.t().reshape(-1)
        sel = torch.argsort(flat.logical_not().to(torch.uint8), stable=True)[: t * self.topk]
        tok = sel % t
        permuted_probs = probs.t().reshape(-1).index_select(0, sel)
        counts = rmap.sum(dim=0)
        y = self._experts(x.index_select(0, tok), permuted_probs, counts)
        # megatron's unpermute (no probs: they were applied in the experts)
        out = torch.zeros((t, y.shape[-1]), dtype=y.dtype, device=y.device)
        _scatter_rows(out, tok, y)
        return out.to(y.dtype).view(h.shape), routing_map

    def _experts(self, xp: torch.Tensor, permuted_probs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """The local experts on their permuted tokens xp [N, H] (expert-major; ``counts`` [E_local] per
        expert, rows past their sum are padding) -> [N, H]."""
        from megatron_gspo.model.experts import expert_activation, grouped_linear

        config = self.mlp.experts.config
        if config.moe_apply_probs_on_input:
            xp = (permuted_probs.unsqueeze(-1) * xp).to(xp.dtype)
            permuted_probs = torch.ones_like(permuted_probs)
        if self.sync_free:
            offs = counts.cumsum(0).to(torch.int32)  # grouped GEMM offsets, on the device
            w1, w2 = ([s] for s in self.stacks) if self.stacks is not None else (self.w1, self.w2)
            y = _grouped(xp, w1, offs)
            y = expert_activation(config, y, permuted_probs)
            return _grouped(y, w2, offs)
        n = counts.tolist()  # the one host sync of this path
        y = grouped_linear(xp, self.w1, n, "loop")
        y = expert_activation(config, y, permuted_probs)
        return grouped_linear(y, self.w2, n, "loop")

    def _over_group(self, x: torch.Tensor, probs: torch.Tensor, routing_map: torch.Tensor,
                    static: bool) -> torch.Tensor:
        """The all-gather dispatch over the expert group (class doc): this rank's tokens x [t, H] (probs,
        routing map [t, E]) -> their outputs [t, H], summed over every expert of the group."""
        from megatron_gspo.routing.metrics import routing_map_to_indices

        k, n_local = self.topk, self.num_local
        ids = routing_map_to_indices(routing_map, k)  # [t, k] global expert ids (no token dropping: all >= 0)
        wide = torch.promote_types(probs.dtype, torch.float32)  # holds the ids exactly and the probs losslessly
        routes = torch.cat([ids.to(wide), probs.gather(1, ids).to(wide)], dim=1)
        xg = comm.all_gather_into(x, self.group, what="lean decode: the expert group's tokens")  # [T, H]
        routes = comm.all_gather_into(routes, self.group, what="lean decode: the expert group's routes")
        T = xg.shape[0]
        local = routes[:, :k].long() - self.first_local  # [T, k]
        mine = (local >= 0) & (local < n_local)
        if self.reversed:  # the weights in DDP's buffer order: expert n_local - 1 first
            local = n_local - 1 - local
        key = torch.where(mine, local, n_local).reshape(-1)  # [T*k], n_local: another rank's expert
        counts = torch.zeros(n_local + 1, dtype=torch.long, device=x.device)
        counts = counts.scatter_add_(0, key, torch.ones_like(key))[:n_local]
        # megatron's permute order (expert-major, tokens in order): a stable sort of the token-major pairs
        order = torch.argsort(key, stable=True)
        if static and self.sync_free:
            sel = order[: T * min(k, n_local)]  # the capacity: every gathered token could be this rank's
        else:
            sel = order[: int(counts.sum())]  # exact: one host sync (the prefill, or the loop of GEMMs)
        src = sel // k  # the gathered token of each pair
        permuted_probs = routes[:, k:].to(probs.dtype).reshape(-1).index_select(0, sel)
        y = self._experts(xg.index_select(0, src), permuted_probs, counts)
        out = torch.zeros((T + 1, y.shape[-1]), dtype=y.dtype, device=y.device)
        _scatter_rows(out, torch.where(key.index_select(0, sel) < n_local, src, T), y)  # padding -> row T
        # megatron's combine: a reduce-scatter in the probabilities' dtype, back to the activations'
        out = comm.reduce_scatter(out[:T].to(probs.dtype), self.group, what="lean decode: expert outputs")
        return out.to(y.dtype)


def _scatter_rows(out: torch.Tensor, rows: torch.Tensor, y: torch.Tensor) -> None:
    """out[rows[i]] += y[i] (megatron's unpermute: index_add_ under deterministic algorithms, whose
    scatter_add_ is not deterministic on CUDA)."""
    if torch.are_deterministic_algorithms_enabled():
        out.index_add_(0, rows, y)
    else:
        out.scatter_add_(0, rows.unsqueeze(1).expand(-1, y.shape[-1]), y)


def _grouped(x: torch.Tensor, weights: list[torch.Tensor], offs: torch.Tensor) -> torch.Tensor:
    """x [N, in] grouped by expert (int32 cumulative ``offs``) times each expert's weight: ``weights`` is
    the [E, out, in] stack alone, or one [out, in] tensor per expert (stacked here: a copy)."""
    from megatron_gspo.model.experts import grouped_linear

    if len(weights) == 1 and weights[0].dim() == 3:
        return torch._grouped_mm(x, weights[0].transpose(1, 2), offs=offs)
    return grouped_linear(x, weights, (), "grouped_mm", offs)


# ----------------------------------------------------------------------------------------------
# The decoder
# ----------------------------------------------------------------------------------------------


def bucket_sizes(batch: int) -> list[int]:
    """Batch sizes whose decode step is captured: powers of two below ``batch``, and ``batch``."""
    out, n = [], 1
    while n < batch:
        out.append(n)
        n *= 2
    return out + [batch]


class LeanDecoder:
    """Prefill and decode steps over a GPTModel with a KV cache of roped keys (see the module doc).

    Args:
        m: the unwrapped GPTModel (eval mode, no grad: the caller's context).
        batch: rows of the cache; max_slots: KV slots per row (prompt block + new tokens - 1).
        max_position: the largest position id any row will use (sizes the RoPE table).
        static: every decode step attends over all ``max_slots`` slots (shapes depend on the batch
            size only: what a captured graph needs); False attends over the written slots.
        graphs: capture each batch-size bucket's decode step with ``torch.cuda.CUDAGraph`` and replay
            it (CUDA only; implies ``static``; needs ``DeviceMoE`` in every layer).
        record_routes: write every forward's top-k expert ids (``last_routes``).
        graph_factory: the capture mechanism (default ``torch.cuda.CUDAGraph``; tests pass a CPU
            stand-in with the same capture / replay contract).
        groups: the process groups of a model sharded over TP / EP / expert-TP (``DecodeGroups.of(state)``;
            None: one rank). Every rank of ``groups.lockstep`` must run the same steps with the same
            batch size (generation's lockstep).
    """

    def __init__(self, m, batch: int, max_slots: int, max_position: int, *, static: bool = False,
                 graphs: bool = False, record_routes: bool = False,
                 graph_factory: Optional[Callable[[], object]] = None,
                 groups: Optional[DecodeGroups] = None) -> None:
        reason = lean_decode_unsupported(m)
        if reason is not None:
            raise ValueError(f"generation.decode_impl=lean does not support {reason}")
        self.m, self.cfg = m, m.config
        self.groups = groups or DecodeGroups()
        self.groups.check(self.cfg)
        self.tp_group = self.groups.tp
        self.layers = list(m.decoder.layers)
        att = self.layers[0].self_attention
        self.hn = att.hidden_size_per_attention_head
        self.np = att.num_attention_heads_per_partition
        self.ng = att.num_query_groups_per_partition
        self.scale = getattr(att.core_attention, "softmax_scale", None) or self.hn ** -0.5
        p = next(m.parameters())
        self.dtype, self.device = p.dtype, p.device
        dev = p.device
        self.shared = m.share_embeddings_and_output_weights
        self.cos = self.sin = None
        self.batch = self.max_slots = 0
        self._allocate(batch, max_slots, max_position)
        self.moe = [DeviceMoE(layer.mlp, self.groups.expert) if device_moe_unsupported(layer.mlp) is None else None
                    for layer in self.layers]
        # each layer's norms as functions (local modules called; TE's computed here, see norm_op)
        self.norms = []
        for layer in self.layers:
            att = layer.self_attention
            fused = hasattr(att.linear_qkv, "layer_norm_weight")
            self.norms.append((norm_op(att.linear_qkv, "layer_norm_weight") if fused else norm_op(layer.input_layernorm),
                               norm_op(att.q_layernorm), norm_op(att.k_layernorm), norm_op(layer.pre_mlp_layernorm)))
        self.final_norm = norm_op(getattr(m.decoder, "final_layernorm", None))
        self.graphs = graphs
        self.static = static or graphs
        if graphs:
            missing = [i for i, d in enumerate(self.moe) if d is None or not d.sync_free]
            if missing:
                why = device_moe_unsupported(self.layers[missing[0]].mlp) or "no torch._grouped_mm for its weights"
                raise ValueError(f"generation.cuda_graphs=true: layer {missing[0]}'s MLP cannot run without host "
                                 f"synchronisation ({why})")
            if graph_factory is None and dev.type != "cuda":
                raise ValueError(f"generation.cuda_graphs=true needs a CUDA device, the model is on {dev}")
        self._graph_factory = graph_factory
        # captured decode steps by (batch-size bucket, routes recorded): they read the buffers above
        self._graphs: dict[tuple[int, bool], tuple[object, torch.Tensor]] = {}
        self._capturing = False
        # a refilled batch's decode steps (decode_at) run no router hook: its rows are at different steps, so
        # their routes are filed by generation from last_routes, as a replayed graph's are
        self._hooks = True
        self.routes: Optional[torch.Tensor] = None
        self._prefill_routes: list[torch.Tensor] = []
        # the prompt store (prefill_to_store); shared-prefix decode attention off (share_prefix: its cells, its bias)
        self.store_k = self.store_v = self.prefix_bias = None
        self.prefix_cells = 0
        self._set_record_routes(record_routes)
        self._weights = self._weight_addresses()
        self.keep = False  # this generation's KV caches outlive it (begin's ``keep``)

    def _allocate(self, batch: int, max_slots: int, max_position: int = 0) -> None:
        """The buffers of ``batch`` cache rows x ``max_slots`` KV slots: the KV caches ([b, groups, slots,
        hn], zeros) and the decode step's inputs (fed tokens, left padding per cache row); the RoPE table
        grows to cover the slots (its rows do not depend on its length)."""
        dev, dt = self.device, self.dtype
        positions = max(max_position, max_slots) + 1
        if self.cos is None or self.cos.shape[0] < positions:
            # the RoPE table of megatron's own RotaryEmbedding (same frequencies, same cos/sin values)
            freqs = self.m.rotary_pos_emb.get_freqs_non_repeated(positions)  # [positions, rot/2]
            emb = torch.cat([freqs, freqs], dim=-1)  # non-interleaved layout, as megatron's get_emb
            self.cos = torch.cos(emb).to(device=dev, dtype=dt)  # [positions, rot]
            self.sin = torch.sin(emb).to(device=dev, dtype=dt)
        self.k = [torch.zeros(batch, self.ng, max_slots, self.hn, dtype=dt, device=dev) for _ in self.layers]
        self.v = [torch.zeros_like(k) for k in self.k]
        if batch != self.batch:
            self.tok_in = torch.zeros(batch, dtype=torch.long, device=dev)
            self.left_pad = torch.zeros(batch, dtype=torch.long, device=dev)
            # with shared-prefix attention, the slot from which a cache row's own keys are read (share_kept_prefix)
            self.prompt_end = torch.zeros(batch, dtype=torch.long, device=dev)
            # the slot each cache row's decode step writes (one slot for all rows, except where finished
            # rows were refilled: generation.max_batch_rows)
            self.cur = torch.zeros(batch, dtype=torch.long, device=dev)
            self.row_ids = torch.arange(batch, device=dev)
        if max_slots != self.max_slots:
            self.slot_ids = torch.arange(max_slots, device=dev)
        self.batch, self.max_slots = batch, max_slots

    def _set_record_routes(self, on: bool) -> None:
        self.record_routes = on
        if on and (self.routes is None or self.routes.shape[1] != self.batch):
            from megatron_gspo.routing.common import index_dtype

            self._idx_dtype = index_dtype(self.cfg.num_moe_experts)
            self.routes = torch.zeros(len(self.layers), self.batch, self.cfg.moe_router_topk,
                                      dtype=self._idx_dtype, device=self.device)  # decode steps

    def _weight_addresses(self) -> tuple:
        """Where every weight the step reads lives (a captured graph reads these addresses; the experts'
        stacked views are of the parameters' own storage, so the parameters' addresses decide theirs)."""
        return tuple(p.data_ptr() for p in self.m.parameters())

    # -- one generation after another ------------------------------------------------------------
    def begin(self, batch: int, slots: int, left_pad: torch.Tensor, record_routes: bool = False,
              carry: Optional[tuple[torch.Tensor, torch.Tensor]] = None, keep: bool = False) -> None:
        """Ready the decoder for a generation of ``batch`` rows and ``slots`` KV slots (a decoder is kept
        for a job: generation.Generator).

        With ``graphs`` the KV caches and the captured steps live as long as the decoder (a graph reads
        the buffers it was captured on): they are reallocated, and the steps captured again, only when a
        bound grows (logged). Without, the KV caches live for one generation (``end``), sized to it:
        memory that training reuses in between. The weights are taken as they are now (``DeviceMoE.bind``):
        an optimizer step updates them in place, which every step (a replayed one included) reads;
        should a parameter have moved in memory since the last generation, the captured steps, which read
        the old addresses, are dropped and captured again.

        Multi-turn rows (generation.generator, "KV kept across turns"): ``keep`` keeps this generation's KV
        caches past ``end`` and makes compaction move whole rows (a finished row's KV is the next turn's
        history); ``carry`` = (src [batch], delta [batch]): cache row r of this generation starts as the last
        generation's row src[r], its slots shifted right by delta[r] (the row's new left padding minus its old)."""
        old = (self.k, self.v) if carry is not None else None
        if self.graphs:
            if batch > self.batch or slots > self.max_slots:
                log.info("generation: the lean decoder's KV cache grows from %d rows x %d slots to %d x %d; "
                         "its CUDA graphs are captured again", self.batch, self.max_slots,
                         max(batch, self.batch), max(slots, self.max_slots))
                self._allocate(max(batch, self.batch), max(slots, self.max_slots))
                self._drop_graphs()
        elif self.k is None or (batch, slots) != (self.batch, self.max_slots):
            self._allocate(batch, slots)
        for d in self.moe:
            if d is not None:
                d.bind()
        weights = self._weight_addresses()
        moved = weights != self._weights
        if self.graphs and self.groups.lockstep is not None:
            # the lockstep group captures again on every rank or on none: a capture runs the step's
            # collectives (warm-up, then the replay), which the group's other ranks must match
            moved = comm.any_rank(moved, self.device, self.groups.lockstep,
                                  what="lean decode: capture the decode step again")
        if moved:
            if self._graphs:
                log.info("generation: the model's weights moved in memory since the lean decoder's CUDA graphs "
                         "were captured; capturing them again")
                self._drop_graphs()
            self._weights = weights
        self._set_record_routes(record_routes)
        self.set_left_pad(left_pad)
        self.keep = keep
        if carry is not None:
            self._carry(old, *carry)

    def end(self, keep: bool = False) -> None:
        """After a generation: without graphs the KV caches are freed (``begin`` allocates them again), unless
        ``keep``: the next generation carries them over (``begin``'s ``carry``), or ``release`` frees them. The
        prompt store (``prefill_to_store``) is always freed."""
        self.store_k = self.store_v = None
        self.prefix_cells, self.prefix_bias = 0, None
        if not self.graphs and not keep:
            self.k = self.v = None

    def release(self) -> None:
        """Free KV caches kept past a generation (``end(keep=True)``), without graphs."""
        self.end()

    def _carry(self, old, src: torch.Tensor, delta: torch.Tensor) -> None:
        """Cache row r takes the kept cache's row src[r], slot s from its slot s - delta[r] (a row's tokens keep
        their roped keys: a key's position is its own, whatever slot holds it; slots read from outside the kept
        range hold anything, they are masked or written before they are read). ``old``: the kept (k, v) lists."""
        old_k, old_v = old
        if old_k is None:
            raise ValueError("lean decode: a generation continues KV caches that were not kept (end(keep=True))")
        b, slots, old_slots = src.numel(), self.max_slots, old_k[0].shape[2]
        idx = (torch.arange(slots, device=self.device)[None, :] - delta[:, None]).clamp(0, old_slots - 1)
        idx = idx[:, None, :, None].expand(b, self.ng, slots, self.hn)
        for new, kept in ((self.k, old_k), (self.v, old_v)):
            for cache, prev in zip(new, kept):
                # gathered first, then written: safe where ``cache`` is ``prev`` (graphs keep their buffers)
                cache[:b].copy_(torch.gather(prev[src], 2, idx))

    def _drop_graphs(self) -> None:
        self._graphs.clear()
        self._pool = None

    # -- pieces ------------------------------------------------------------------------------------
    def _rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """t [b, heads, s, hn], cos/sin [b, 1, s, rot] -> t with RoPE on the first rot dims."""
        rot = cos.shape[-1]
        x, rest = t[..., :rot], t[..., rot:]
        x1, x2 = x.chunk(2, dim=-1)
        out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
        return out if rest.numel() == 0 else torch.cat((out, rest), dim=-1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """q [b, np, s, hn], k/v [b, ng, L, hn], bias [b, 1, s, L] additive -> [b, np, s, hn].

        A decode step (s = 1) is two batched GEMMs per group: the query heads of a group become the
        rows of one [np/ng, hn] x [hn, L] product against the group's keys, so GQA needs no K/V copy.
        CPU flash attention pays its tiling set-up per (row, head) for a single query (measured 4x
        slower here); prefill (s > 1) keeps SDPA's fused kernel."""
        if q.shape[2] > 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale,
                                                  enable_gqa=self.np != self.ng)
        b, hn, ng = q.shape[0], self.hn, self.ng
        qg = q.reshape(b, ng, self.np // ng, hn)  # heads are group-major (megatron's QKV layout)
        scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(self.scale).add_(bias)  # [b, ng, np/ng, L]
        return torch.matmul(scores.softmax(dim=-1), v).reshape(b, self.np, 1, hn)

    def _attend_shared(self, i: int, q: torch.Tensor, kv_len: int, bias: torch.Tensor) -> torch.Tensor:
        """A decode step's attention of layer i with the prompt block read once per prompt: q [n, np, 1, hn],
        bias [n, 1, 1, kv_len] (the rows' masks) -> [n, np, 1, hn]. The prompt's KV is the store's
        (``prefill_to_store``), each row's generated suffix its cache row's slots P .. kv_len-1."""
        n, P = q.shape[0], self.store_k[i].shape[2]
        ctx = shared_prefix_attention(
            q[:, :, 0], self.store_k[i], self.store_v[i], self.k[i][:n, :, P:kv_len], self.v[i][:n, :, P:kv_len],
            self.prefix_row[:n], self.prefix_cell[:n], self.prefix_cells, scale=self.scale,
            prefix_bias=self.prefix_bias, suffix_bias=bias[:, 0, 0, P:])
        return ctx[:, :, None]

    def _mlp(self, i: int, layer, x: torch.Tensor, routes_out: Optional[torch.Tensor], prefill: bool) -> torch.Tensor:
        """The layer's MLP on x [s, b, h]; its top-k expert ids [b, s, k] go to ``routes_out`` (a
        buffer view, decode) or the prefill list (``routes_out`` None) when routes are recorded."""
        pre_mlp = self.norms[i][3]
        h = x if pre_mlp is None else pre_mlp(x)
        moe = self.moe[i]
        if moe is not None:
            out, rmap = moe(h, hooks=self._hooks and not self._capturing, static=not prefill)
            bias = None
        else:
            out, bias = layer.mlp(h)
            rmap = None
        if self.record_routes:
            if rmap is None:
                raise ValueError(f"route recording in the lean decoder needs DeviceMoE in layer {i} "
                                 f"({device_moe_unsupported(layer.mlp)})")
            from megatron_gspo.routing.metrics import routing_map_to_indices

            idx = routing_map_to_indices(rmap, self.cfg.moe_router_topk).to(self._idx_dtype)
            idx = idx.view(x.shape[0], x.shape[1], -1).transpose(0, 1)  # [b, s, k]
            if routes_out is None:
                self._prefill_routes.append(idx)
            else:
                routes_out.copy_(idx[:, 0])
        return x + out if bias is None else x + out + bias

    def _layers(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, bias: torch.Tensor,
                write: Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None], kv_len: int,
                routes: Optional[torch.Tensor], prefill: bool = False) -> torch.Tensor:
        """The decoder layers on x [s, b, h]; ``write(cache, i, t)`` stores this forward's keys/values.
        Under TP the attention heads are this rank's and its output projection's partial sums are
        all-reduced (megatron's row-parallel linear without sequence parallelism), the bias after."""
        s, b = x.shape[0], x.shape[1]
        hn, np_, ng = self.hn, self.np, self.ng
        for i, layer in enumerate(self.layers):
            att = layer.self_attention
            in_norm, q_norm, k_norm, _ = self.norms[i]
            h = x if in_norm is None else in_norm(x)
            qkv = F.linear(h, att.linear_qkv.weight, _bias(att.linear_qkv))  # [s, b, ng*(np/ng+2)*hn]
            qkv = qkv.view(s, b, ng, -1)
            q, k, v = torch.split(qkv, [np_ // ng * hn, hn, hn], dim=3)
            q = q.reshape(s, b, np_, hn)
            if q_norm is not None:
                q = q_norm(q)
            if k_norm is not None:
                k = k_norm(k)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, hn]
            write(self.k[i], self._rope(k, cos, sin))
            write(self.v[i], v)
            q = self._rope(q, cos, sin)
            if self.prefix_cells and not prefill:  # a decode step over the shared prompt store (shared_prefix.py)
                ctx = self._attend_shared(i, q, kv_len, bias)
            else:
                ctx = self._attend(q, self.k[i][:b, :, :kv_len], self.v[i][:b, :, :kv_len], bias)
            ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)
            out = F.linear(ctx, att.linear_proj.weight)
            if self.tp_group is not None:
                out = comm.all_reduce(out, "sum", self.tp_group, what="lean decode: attention output projection")
            if _bias(att.linear_proj) is not None:
                out = out + _bias(att.linear_proj)
            x = self._mlp(i, layer, x + out, None if routes is None else routes[i], prefill)
        return x

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        m = self.m
        last = x[-1]  # [b, h]: only the last position's logits are used
        if self.final_norm is not None:
            last = self.final_norm(last)
        weight = m.shared_embedding_or_output_weight() if self.shared else m.output_layer.weight
        logits = F.linear(last, weight)  # [b, V / TP]: this rank's vocabulary shard
        if self.tp_group is None:
            return logits
        # megatron's inference gathers the vocab-parallel logits of the last position: every TP rank
        # samples from the full distribution (generation.sampling: the same draw on every rank)
        parts = comm.all_gather_into(logits, self.tp_group, what="lean decode: vocab-parallel logits")
        b, v = logits.shape
        return parts.view(-1, b, v).permute(1, 0, 2).reshape(b, -1)

    def _embed(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """tokens, positions [b, s] -> [s, b, h]: the model's embedding module on one rank; under TP its
        vocab-parallel lookup here (megatron's VocabParallelEmbedding: this rank's vocabulary rows,
        zeros elsewhere, all-reduced; no sequence-parallel scatter: decoding does not split the sequence)."""
        if self.tp_group is None:
            return self.m.embedding(input_ids=tokens, position_ids=positions)
        emb = self.m.embedding.word_embeddings
        outside = (tokens < emb.vocab_start_index) | (tokens >= emb.vocab_end_index)
        x = F.embedding((tokens - emb.vocab_start_index).masked_fill(outside, 0), emb.weight)
        x = comm.all_reduce(x.masked_fill_(outside[..., None], 0), "sum", self.tp_group,
                            what="lean decode: vocab-parallel embedding")
        return x.transpose(0, 1).contiguous()

    def _bias(self, masked: torch.Tensor, dtype) -> torch.Tensor:
        bias = torch.zeros(masked.shape, dtype=dtype, device=masked.device)
        return bias.masked_fill_(masked, torch.finfo(dtype).min / 2)  # finite: see attention.py's module doc

    # -- public steps ----------------------------------------------------------------------------
    def set_left_pad(self, left_pad: torch.Tensor) -> None:
        """Each cache row's left padding [batch] (slots < it are never attended; positions = slot - it)."""
        self.left_pad[: left_pad.shape[0]].copy_(left_pad)

    def prefill(self, tokens: torch.Tensor, positions: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """Slots 0 .. s-1 of every row: tokens, positions [b, s]; masked [b, 1, s, s] (True = not
        attended). Returns [b, V] logits (padded vocabulary) of the last position."""
        b, s = tokens.shape[0], tokens.shape[1]
        # [s, b, h]: megatron's layout, so the MoE layers see tokens in the order the megatron path
        # gives them (routing statistics and any recorder agree)
        x = self._embed(tokens, positions)
        cos = self.cos[positions][:, None]  # [b, 1, s, rot]
        sin = self.sin[positions][:, None]
        self._prefill_routes = []

        def write(cache, t):
            cache[:b, :, :s] = t

        x = self._layers(x, cos, sin, self._bias(masked, x.dtype), write, s, None, prefill=True)
        return self._logits(x)

    def extend(self, tokens: torch.Tensor, positions: torch.Tensor, start: int, new: torch.Tensor,
               masked: torch.Tensor) -> torch.Tensor:
        """A prefill of slots start .. start+s-1 onto KV caches that hold the slots before (a multi-turn row's
        next turn: its new tokens only): tokens, positions, new [b, s]; only the slots ``new`` marks are written
        (the others hold a row's history, or padding); masked [b, 1, s, start + s] (True = not attended).
        Returns [b, V] logits (padded vocabulary) of the last position; routes as a prefill's."""
        b, s = tokens.shape[0], tokens.shape[1]
        x = self._embed(tokens, positions)
        cos = self.cos[positions][:, None]  # [b, 1, s, rot]
        sin = self.sin[positions][:, None]
        self._prefill_routes = []
        fresh = new[:, None, :, None]

        def write(cache, t):
            cache[:b, :, start:start + s] = torch.where(fresh, t, cache[:b, :, start:start + s])

        x = self._layers(x, cos, sin, self._bias(masked, x.dtype), write, start + s, None, prefill=True)
        return self._logits(x)

    def _decode_step(self, n: int, kv_len: int) -> torch.Tensor:
        """One token for cache rows 0 .. n-1, read from the decoder's buffers (tok_in, left_pad, cur):
        the graph-ready step. Returns [n, V] logits."""
        tok, lp, cur = self.tok_in[:n], self.left_pad[:n], self.cur[:n]
        pos = (cur - lp).clamp(min=0)  # [n] true position of the slot written
        x = self._embed(tok[:, None], pos[:, None])  # [1, n, h]
        cos = self.cos[pos][:, None, None]  # [n, 1, 1, rot]
        sin = self.sin[pos][:, None, None]
        slots = self.slot_ids[:kv_len]
        if self.prefix_cells:  # the rows' own keys start past their prompt (the store holds it: share_kept_prefix)
            lp = torch.maximum(lp, self.prompt_end[:n])
        masked = (slots[None, :] < lp[:, None]) | (slots[None, :] > cur[:, None])  # [n, kv_len]: padding, unwritten
        bias = self._bias(masked[:, None, None, :], x.dtype)

        rows = self.row_ids[:n]

        def write(cache, t):  # [n, heads, 1, hn], row r at its slot cur[r]
            cache[rows, :, cur] = t[:, :, 0]

        routes = self.routes[:, :n] if self.record_routes else None
        x = self._layers(x, cos, sin, bias, write, kv_len, routes)
        return self._logits(x)

    def decode(self, tokens: torch.Tensor, slot: int) -> torch.Tensor:
        """Feed tokens [b] (cache rows 0 .. b-1, in the cache's row order) at KV slot ``slot``.
        Returns [b, V] logits (padded vocabulary)."""
        b = tokens.shape[0]
        self.tok_in[:b].copy_(tokens)
        self.cur.fill_(slot)
        if not self.graphs:
            return self._decode_step(b, self.max_slots if self.static else slot + 1)
        return self._replay_rows(b)

    def decode_at(self, tokens: torch.Tensor, slots: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Feed tokens [b] (cache rows 0 .. b-1) each at its own KV slot ``slots`` [b] (refilled rows:
        generation.max_batch_rows); ``kv_len`` > every slot (eager: the slots attended). Returns [b, V]."""
        b = tokens.shape[0]
        self.tok_in[:b].copy_(tokens)
        self.cur[:b].copy_(slots)
        self._hooks = False
        try:
            return self._replay_rows(b) if self.graphs else self._decode_step(b, self.max_slots if self.static else kv_len)
        finally:
            self._hooks = True

    def _replay_rows(self, b: int) -> torch.Tensor:
        n = next(s for s in bucket_sizes(self.batch) if s >= b)  # rows b .. n-1: fillers
        return self._replay(n)[:b]

    def _replay(self, n: int) -> torch.Tensor:
        key = (n, self.record_routes)
        if key not in self._graphs:
            self._graphs[key] = self._capture(n)
        graph, out = self._graphs[key]
        graph.replay()
        return out

    def _capture(self, n: int):
        """Capture bucket n's decode step (warm-up on a side stream first, as torch.cuda.graphs asks).
        The captured step reads the current buffers; replaying it at any later step is that step."""
        factory = self._graph_factory or torch.cuda.CUDAGraph
        self._capturing = True
        try:
            if factory is torch.cuda.CUDAGraph:
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    self._decode_step(n, self.max_slots)  # lazy initialisations; rewrites the same slot
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                # thread_local: a CUDA call another thread makes meanwhile (the async ranks' heartbeat,
                # NCCL's watchdog, a tensorboard writer) does not invalidate this capture
                with torch.cuda.graph(graph, pool=getattr(self, "_pool", None), capture_error_mode="thread_local"):
                    out = self._decode_step(n, self.max_slots)
                self._pool = graph.pool()
                return graph, out
            graph = factory()
            out = graph.capture(lambda: self._decode_step(n, self.max_slots))
            return graph, out
        finally:
            self._capturing = False

    def torch_routers(self) -> contextlib.AbstractContextManager:
        """The context of this decoder's forwards: the routers' gating GEMM in torch, not TE's
        (torch_router_gating; generate() enters it through decoder.LeanBackend.context)."""
        return torch_router_gating(self.m)

    def last_routes(self, b: int, prefill: bool = False) -> torch.Tensor:
        """Top-k expert ids of the last forward: [L, b, s, k] (a copy; needs ``record_routes``)."""
        if prefill:
            return torch.stack(self._prefill_routes)[:, :b]
        return self.routes[:, :b, None, :].clone()

    def share(self, src: torch.Tensor, length: int) -> None:
        """After a prefill of the distinct prompts (cache rows 0 .. Bp-1): cache row r takes prefill row
        ``src[r]``'s keys and values of slots 0 .. length-1 (the prompt block), for the src.numel() rows.
        With shared-prefix attention (``share_prefix``) the rows read the prompt store instead: row r's
        prefix row is src[r], and its KV is copied only where the caches outlive the call (``keep``: the next
        turn's history)."""
        n = src.numel()
        if self.prefix_cells:
            self.prefix_row[:n] = src
            self.prefix_cell[:n] = prefix_cells(src)
            if self.keep:
                self._copy_prompts(self.row_ids[:n], src)
            return
        for k, v in zip(self.k, self.v):
            k[:n, :, :length] = k[src, :, :length]
            v[:n, :, :length] = v[src, :, :length]

    def prefill_to_store(self, tokens: torch.Tensor, positions: torch.Tensor, masked: torch.Tensor) -> torch.Tensor:
        """``prefill`` into a prompt store of its own ([b, groups, s, hn] per layer, kept until ``end``) rather
        than the cache's rows: the refilled decode batch (generation.max_batch_rows) has fewer cache rows than
        the call has prompts, and its rows take their prompt's KV from the store as they join (``admit``)."""
        b, s = tokens.shape[0], tokens.shape[1]
        self.store_k = [torch.empty(b, self.ng, s, self.hn, dtype=self.dtype, device=self.device) for _ in self.layers]
        self.store_v = [torch.empty_like(k) for k in self.store_k]
        cache = self.k, self.v
        self.k, self.v = self.store_k, self.store_v  # the same computation, written into the store
        try:
            return self.prefill(tokens, positions, masked)
        finally:
            self.k, self.v = cache

    def admit(self, rows: torch.Tensor, src: torch.Tensor, left_pad: torch.Tensor) -> None:
        """Cache rows ``rows`` [n] take prompt-store rows ``src`` [n] (slots 0 .. s-1: the prompt block) and
        the left padding [n] of the rows that join the decode batch there. With shared-prefix attention the
        rows read the store's row instead (their prefix row, and a cell among the batch's rows of it)."""
        self.left_pad[rows] = left_pad
        if self.prefix_cells:
            self.prefix_row[rows] = src
            # every cache row renumbered: the batch's rows come first, so their cells are ranks among themselves
            # (< cells), whatever rows a compaction left behind them
            self.prefix_cell.copy_(prefix_cells(self.prefix_row))
        else:
            self._copy_prompts(rows, src)

    def _copy_prompts(self, rows: torch.Tensor, src: torch.Tensor) -> None:
        """Cache rows ``rows`` [n] take prompt-store rows ``src``'s KV (slots 0 .. s-1)."""
        s = self.store_k[0].shape[2]
        for k, v, sk, sv in zip(self.k, self.v, self.store_k, self.store_v):
            k[rows, :, :s] = sk[src]
            v[rows, :, :s] = sv[src]

    def share_prefix(self, cells: int, store_left_pad: torch.Tensor) -> None:
        """Decode this generation with shared-prefix attention (shared_prefix.py): after ``prefill_to_store``, the
        rows read their prompt's KV from the store (``share`` / ``admit`` name each row's store row) and their
        own cache slots from the prompt block's end on. cells: the most cache rows of one prompt at once;
        store_left_pad [Bp]: each store row's left padding (its slots below it are never attended)."""
        if self.graphs:
            raise ValueError("generation.shared_prefix_attention: a captured decode step cannot follow a call's "
                             "prompt count; use shared_prefix_attention=off or auto with cuda_graphs=true")
        if self.store_k is None:
            raise ValueError("lean decode: share_prefix needs the prompts prefilled into the store (prefill_to_store)")
        P = self.store_k[0].shape[2]
        self.prefix_cells = cells
        self.prefix_row = torch.zeros(self.batch, dtype=torch.long, device=self.device)
        self.prefix_cell = torch.zeros_like(self.prefix_row)
        self.prompt_end.zero_()  # a row's own keys: its slots from the store's width P on
        masked = self.slot_ids[None, :P] < store_left_pad[:, None]
        self.prefix_bias = self._bias(masked, self.dtype)  # [Bp, P]

    def share_kept_prefix(self, cells: int, split: int, rep: torch.Tensor, store_left_pad: torch.Tensor,
                          group: torch.Tensor, prompt_end: torch.Tensor) -> None:
        """Decode a resumed generation (``begin``'s ``carry``, then ``extend``) with shared-prefix attention: the n
        cache rows of a group hold the same KV of their first turn's prompt (row r: slots left_pad[r] ..
        prompt_end[r] - 1), which a prompt store of ``split`` slots takes from one cache row per group, right-aligned
        (store row g: cache row rep[g]'s prompt at slots store_left_pad[g] .. split - 1). Every row's prompt ends at
        or past the split (``split`` = min over rows of prompt_end), so its own keys are its slots from the split
        on, less its prompt's tail there (masked in the decode step: ``prompt_end``). cells: the most rows of one
        group; rep / store_left_pad [Bg]; group [n] (each row's store row) and prompt_end [n] long."""
        Bg = rep.numel()
        # store slot s of group g holds its cache row's slot s - store_left_pad[g] + left_pad[rep[g]] (a key's RoPE
        # is its position's, whatever slot holds it; store slots left of the prompt are masked)
        idx = self.slot_ids[None, :split] - store_left_pad[:, None] + self.left_pad[rep][:, None]
        idx = idx.clamp(0, self.max_slots - 1)
        idx = idx[:, None, :, None].expand(Bg, self.ng, split, self.hn)
        self.store_k = [torch.gather(k[rep], 2, idx) for k in self.k]
        self.store_v = [torch.gather(v[rep], 2, idx) for v in self.v]
        self.share_prefix(cells, store_left_pad)
        n = group.numel()
        self.prefix_row[:n] = group
        self.prefix_cell[:n] = prefix_cells(group)
        self.prompt_end[:n] = prompt_end

    def compact(self, order: torch.Tensor, keep: int) -> None:
        """Move cache rows ``order[:keep]`` to the front (generation's finished-row compaction). A generation
        that keeps its caches (``begin``'s ``keep``) permutes rows 0 .. order.numel()-1 by ``order`` instead
        (moving the rows it moves): the finished rows move behind, their KV intact."""
        if self.keep:  # only the rows that change places move
            at = (order != torch.arange(order.numel(), device=order.device)).nonzero()[:, 0]
            for k, v in zip(self.k, self.v):
                k[at] = k[order[at]]
                v[at] = v[order[at]]
            self.left_pad[at] = self.left_pad[order[at]]
            if self.prefix_cells:
                for t in (self.prefix_row, self.prefix_cell, self.prompt_end):
                    t[at] = t[order[at]]
            return
        idx = order[:keep]
        for k, v in zip(self.k, self.v):
            k[:keep] = k[idx]
            v[:keep] = v[idx]
        self.left_pad[:keep] = self.left_pad[idx]
        if self.prefix_cells:  # distinct rows keep distinct cells of their prefix row
            for t in (self.prefix_row, self.prefix_cell, self.prompt_end):
                t[:keep] = t[idx]
