"""Build a megatron-core ``GPTModel`` with MoE layers (Qwen3-MoE family) from a ``ModelConfig``.

Two implementations share one TransformerConfig:
- Transformer Engine spec (TE linear/attention, fused norms, grouped-GEMM experts, FP8-capable)
  when TE and CUDA are both present;
- megatron-core's local pure-PyTorch spec otherwise, with a sequence-parallel-capable RMSNorm
  (megatron's WrappedTorchNorm refuses sequence parallel).
"""

from __future__ import annotations

import contextlib
import gc
from typing import Optional

import torch
import torch.nn.functional as F

from megatron_gspo.runtime import compat
from megatron_gspo.runtime.compat import te_status
from megatron_gspo.config import ConfigError, ModelConfig, ParallelConfig, resolve_precision
from megatron_gspo.runtime.parallel import ParallelState

# Every choice below that depends on the machine takes the job's device (ParallelState.device, decided
# once by parallel.resolve_device), never torch.cuda.is_available(): a CPU job on a GPU machine must
# build the CPU model.


def _is_cuda(device) -> bool:
    return torch.device(device).type == "cuda"


def resolve_impl(cfg: ModelConfig, device: torch.device, construct_only: bool = False) -> str:
    """"local" or "transformer_engine" for a job on ``device``; an explicit TE request that cannot run
    here fails with the reason (TE not importable: compat.te_status; or no CUDA device).

    ``construct_only`` (tests: build_model's construct-only path) is the Transformer Engine spec with
    its parameters on the CPU and no forward: it needs ``transformer_impl='transformer_engine'``, TE
    importable and a CPU device, and is never what a job gets (jobs pass no such flag; a job config
    with transformer_impl='transformer_engine' and parallel.device=cpu is refused up front)."""
    te_importable, te_why = te_status()
    if construct_only:
        if cfg.transformer_impl != "transformer_engine":
            raise ConfigError("construct_only builds the Transformer Engine spec on the CPU: it needs "
                              f"model.transformer_impl='transformer_engine', got {cfg.transformer_impl!r}")
        if _is_cuda(device):
            raise ConfigError(f"construct_only builds the Transformer Engine spec with its parameters on the CPU, "
                              f"but this job's device is {device}, where the TE spec builds and runs for real: "
                              "build it without construct_only")
        if not te_importable:
            raise ConfigError(f"construct_only needs Transformer Engine: {te_why}")
        return "transformer_engine"
    te_ok = te_importable and _is_cuda(device)
    if cfg.transformer_impl == "auto":
        return "transformer_engine" if te_ok else "local"
    if cfg.transformer_impl == "transformer_engine" and not te_ok:
        why = te_why if not te_importable else (
            f"the job runs on {device} and Transformer Engine's kernels need a CUDA device (TE-spec models "
            "can be built on the CPU only construct-only, for tests: model.build_model(construct_only=True), "
            "which runs no forward)")
        raise ConfigError(f"model.transformer_impl='transformer_engine' cannot run here: {why}; use 'local' or 'auto'")
    return cfg.transformer_impl


def impl_reason(cfg: ModelConfig, device: torch.device) -> str:
    """Why ``resolve_impl`` picks the spec it picks for a job on ``device``, in words (the job's first log
    lines, the preflight's env.auto_impl)."""
    impl = resolve_impl(cfg, device)
    if cfg.transformer_impl != "auto":
        return f"model.transformer_impl={cfg.transformer_impl}"
    if impl == "transformer_engine":
        return f"auto: {te_status()[1]}, on {device}"
    if not _is_cuda(device):
        return f"auto: the job runs on {device} (Transformer Engine's kernels need CUDA)"
    return f"auto: {te_status()[1]}"


def bf16_supported(device: torch.device) -> bool:
    """Whether the job's device runs bf16 matmuls (every CPU torch does, slowly; a GPU from Ampere on)."""
    return not _is_cuda(device) or torch.cuda.is_bf16_supported()


def job_precision(cfg: ModelConfig, device: torch.device) -> tuple[str, str]:
    """(``cfg.precision`` resolved for a job on ``device``: "fp32" | "bf16", why): config.resolve_precision
    with this device's bf16 support."""
    return resolve_precision(cfg.precision, torch.device(device).type, bf16_supported(device))


def resolve_expert_impl(cfg: ModelConfig, impl: str) -> str:
    # "batched" (megatron_gspo.model.experts.BatchedSequentialMLP): SequentialMLP's parameters and
    # checkpoint layout, all local experts in grouped GEMMs; equal to "sequential" and faster.
    if cfg.moe_expert_impl == "auto":
        return "te_grouped" if impl == "transformer_engine" else "batched"
    if cfg.moe_expert_impl == "te_grouped" and impl != "transformer_engine":
        raise ConfigError("model.moe_expert_impl='te_grouped' needs model.transformer_impl='transformer_engine'")
    if cfg.moe_expert_impl == "batched" and impl == "transformer_engine":
        raise ConfigError("model.moe_expert_impl='batched' is the local spec's expert path; with "
                          "model.transformer_impl='transformer_engine' use 'te_grouped' or 'sequential'")
    return cfg.moe_expert_impl


def resolve_attention_impl(cfg: ModelConfig, impl: str) -> str:
    """"te" (TE's fused attention, the TE spec), "sdpa" or "unfused" (local spec)."""
    if impl == "transformer_engine":
        if cfg.attention_impl != "auto":
            raise ConfigError(f"model.attention_impl={cfg.attention_impl!r} is a local-spec choice; with "
                              "model.transformer_impl='transformer_engine' attention is TE's fused kernel (use 'auto')")
        return "te"
    return "sdpa" if cfg.attention_impl == "auto" else cfg.attention_impl


def resolve_dispatcher(cfg: ModelConfig, device: torch.device) -> str:
    if cfg.moe_token_dispatcher_type == "auto":
        # alltoall creates CUDA streams (compat.py); on GPU it is the fast path.
        return "alltoall" if _is_cuda(device) else "allgather"
    if cfg.moe_token_dispatcher_type != "allgather" and not _is_cuda(device):
        raise ConfigError(f"model.moe_token_dispatcher_type={cfg.moe_token_dispatcher_type!r} needs a CUDA device "
                          f"(this job runs on {device}); use 'allgather' on the CPU")
    return cfg.moe_token_dispatcher_type


class RMSNorm(torch.nn.Module):
    """RMSNorm usable under sequence parallel (local spec).

    Its weight is replicated across TP ranks while each rank sees only its sequence shard, so
    the weight's gradient is a partial sum per rank: marking it ``sequence_parallel`` makes
    megatron's finalize_model_grads all-reduce it across TP.
    """

    def __init__(self, config, hidden_size: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = torch.nn.Parameter(torch.ones(hidden_size, dtype=config.params_dtype))
        setattr(self.weight, "sequence_parallel", bool(config.sequence_parallel))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Compute in fp32 like HF Qwen3RMSNorm so bf16 runs match the reference.
        dtype = x.dtype
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(dtype)


class QKRMSNorm(RMSNorm):
    """q/k norm over head_dim: applied to per-head tensors that are never sequence-split
    differently from the hidden states, but megatron asserts on WrappedTorchNorm all the same."""


def build_transformer_config(cfg: ModelConfig, par: ParallelConfig, device: torch.device, routing_replay: bool = False,
                             deterministic: bool = False, construct_only: bool = False, **overrides):
    """megatron's TransformerConfig for this model and layout on ``device``; ``deterministic``: megatron's
    deterministic mode (train.deterministic); ``construct_only``: see build_model; ``overrides`` set
    TransformerConfig fields directly (tests)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = _is_cuda(device)
    impl = resolve_impl(cfg, device, construct_only)
    expert_impl = resolve_expert_impl(cfg, impl)
    resolve_attention_impl(cfg, impl)  # refuse a local-spec attention choice on the TE spec early
    if cfg.moe_router_fusion and routing_replay:
        # megatron-core 0.16: the fused top-k kernel returns before RouterReplay's hook, so
        # replay would be skipped silently.
        raise ConfigError("model.moe_router_fusion=true cannot be combined with routing replay: "
                          "the fused top-k path skips RouterReplay in megatron-core 0.16")
    if cfg.moe_router_fusion and impl != "transformer_engine":
        raise ConfigError("model.moe_router_fusion=true needs Transformer Engine")
    precision, _ = job_precision(cfg, device)  # "auto": a job's Trainer resolved it already; direct builds here
    kw = {**_architecture_kwargs(cfg), **_numerics_kwargs(cfg, cuda, impl, precision),
          **_moe_kwargs(cfg, device, cuda, impl, expert_impl, routing_replay), **_layout_kwargs(cfg, par),
          # megatron's own deterministic choices (no nondeterministic fused kernels); the process-wide
          # settings (torch, cuBLAS, NCCL) are parallel.set_deterministic's
          "deterministic_mode": deterministic}
    kw.update(overrides)
    if cfg.recompute_granularity == "selective":
        # megatron refuses moe_act recompute without grouped GEMM (the local spec's experts)
        kw["recompute_modules"] = ["core_attn", "moe_act"] if expert_impl == "te_grouped" else ["core_attn"]
    return TransformerConfig(**kw)


def _architecture_kwargs(cfg: ModelConfig) -> dict:
    """TransformerConfig fields of the Qwen3-MoE block itself."""
    return dict(
        num_layers=cfg.num_layers,
        hidden_size=cfg.hidden_size,
        num_attention_heads=cfg.num_attention_heads,
        num_query_groups=cfg.num_query_groups,
        kv_channels=cfg.kv_channels,
        ffn_hidden_size=cfg.moe_ffn_hidden_size,  # unused: every layer is MoE
        normalization="RMSNorm",
        layernorm_epsilon=cfg.norm_epsilon,
        qk_layernorm=cfg.qk_layernorm,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        init_method_std=cfg.init_method_std,
    )


def _numerics_kwargs(cfg: ModelConfig, cuda: bool, impl: str, precision: str) -> dict:
    """Fusions (those that need CUDA kernels, compat.py, are enabled on GPU only), dtypes, FP8."""
    return dict(
        bias_activation_fusion=cuda,
        bias_dropout_fusion=cuda,
        masked_softmax_fusion=cuda and impl == "transformer_engine",
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not cuda,
        params_dtype=torch.bfloat16 if precision == "bf16" else torch.float32,
        bf16=precision == "bf16",
        fp8=cfg.fp8,
        fp8_recipe=cfg.fp8_recipe,
    )


def _moe_kwargs(cfg: ModelConfig, device: torch.device, cuda: bool, impl: str, expert_impl: str,
                routing_replay: bool) -> dict:
    return dict(
        num_moe_experts=cfg.num_moe_experts,
        moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_router_pre_softmax=cfg.moe_router_pre_softmax,
        moe_router_dtype=cfg.moe_router_dtype,
        # seq_aux_loss is the project's (model/load_balancing.py, hooks on the routers): megatron's own is off
        moe_aux_loss_coeff=0.0 if cfg.moe_router_load_balancing_type == "seq_aux_loss" else cfg.moe_aux_loss_coeff,
        moe_router_load_balancing_type=("none" if cfg.moe_router_load_balancing_type == "seq_aux_loss"
                                        else cfg.moe_router_load_balancing_type),
        moe_token_dispatcher_type=resolve_dispatcher(cfg, device),
        moe_grouped_gemm=expert_impl == "te_grouped",
        moe_permute_fusion=cuda and impl == "transformer_engine",
        moe_router_fusion=cfg.moe_router_fusion,
        moe_enable_routing_replay=routing_replay,
    )


def _layout_kwargs(cfg: ModelConfig, par: ParallelConfig) -> dict:
    """Model parallelism, activation recompute and the loss normalization DDP relies on."""
    return dict(
        tensor_model_parallel_size=par.tensor_model_parallel_size,
        pipeline_model_parallel_size=par.pipeline_model_parallel_size,
        expert_model_parallel_size=par.expert_model_parallel_size,
        expert_tensor_parallel_size=par.etp,
        sequence_parallel=par.sp,
        recompute_granularity=cfg.recompute_granularity,
        recompute_method=cfg.recompute_method,
        recompute_num_layers=cfg.recompute_num_layers,
        # losses are normalized by global token/sequence counts; DDP then sums (see wrap_ddp)
        calculate_per_token_loss=True,
    )


def build_layer_spec(tcfg, cfg: ModelConfig, device: torch.device, pp_rank: Optional[int] = None,
                     construct_only: bool = False):
    """TransformerBlockSubmodules for this pipeline stage of a job on ``device`` (``construct_only``: see
    build_model)."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    impl = resolve_impl(cfg, device, construct_only)
    if impl == "transformer_engine":
        from megatron.core.extensions.transformer_engine import TENorm

        layer = specs.get_gpt_layer_with_transformer_engine_spec(
            num_experts=cfg.num_moe_experts,
            moe_grouped_gemm=tcfg.moe_grouped_gemm,
            qk_layernorm=cfg.qk_layernorm,
        )
        final_norm = TENorm
    else:
        layer = specs.get_gpt_layer_local_spec(
            num_experts=cfg.num_moe_experts,
            moe_grouped_gemm=False,
            qk_layernorm=cfg.qk_layernorm,
            normalization="RMSNorm",
        )
        # Swap megatron's WrappedTorchNorm (refuses sequence parallel; compat.py).
        sub = layer.submodules
        sub.input_layernorm = RMSNorm
        sub.pre_mlp_layernorm = RMSNorm
        if cfg.qk_layernorm:
            sub.self_attention.submodules.q_layernorm = QKRMSNorm
            sub.self_attention.submodules.k_layernorm = QKRMSNorm
        # Checkpoint names as the TE spec writes them, so a checkpoint moves between specs: TE
        # fuses the input norm into linear_qkv (layer_norm_weight) but keeps the MoE pre-MLP norm
        # a separate module (pre_mlp_layernorm.weight).
        sub.sharded_state_dict_keys_map = {"input_layernorm.": "self_attention.linear_qkv.layer_norm_"}
        final_norm = RMSNorm
        if resolve_attention_impl(cfg, impl) == "sdpa":
            from megatron_gspo.model.attention import SDPAttention

            sub.self_attention.submodules.core_attention = SDPAttention
        if resolve_expert_impl(cfg, impl) == "batched":
            from megatron_gspo.model.experts import BatchedSequentialMLP

            moe = compat.spec_submodules(sub.mlp)
            moe.experts = compat.with_module(moe.experts, BatchedSequentialMLP)
    n = get_num_layers_to_build(tcfg, vp_stage=None, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=final_norm)


def build_model(cfg: ModelConfig, par: ParallelConfig, state: ParallelState, routing_replay: bool = False,
                init_from_seed: bool = True, deterministic: bool = False, construct_only: bool = False,
                **config_overrides):
    """Build this rank's shard of the GPTModel on ``state.device``, its weights drawn from ``par.seed``
    alone whatever the layout (init_weights.py; ``init_from_seed=False`` keeps megatron's own,
    layout-dependent init). ``state`` comes from parallel.initialize, which also applied compat.py's
    workarounds for that device.

    ``construct_only=True`` (tests, and tools that only move weights): the Transformer Engine spec
    (``cfg.transformer_impl='transformer_engine'``) built on a CPU ``state`` where TE is installed but no
    GPU runs it: TE's modules with their parameters on the CPU (compat.te_modules_on_cpu, during
    construction only), megatron's CPU choices otherwise (CPU initialization, the allgather dispatcher, no
    fusions), the same init, state-dict and sharded-state-dict names as on a GPU. Its forward is refused
    (ConstructOnlyError): TE's kernels need CUDA. The model says so in ``model.construct_only``."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    # RouterReplay keeps a class-level list of instances, one per MoE layer, in build order; a rebuilt
    # replay model must start from an empty list or replay data goes to stale routers
    if routing_replay:
        RouterReplay.clear_global_router_replay_instances()
    tcfg = build_transformer_config(cfg, par, state.device, routing_replay=routing_replay,
                                    deterministic=deterministic, construct_only=construct_only, **config_overrides)
    pp_rank = state.pp_rank
    spec = build_layer_spec(tcfg, cfg, state.device, pp_rank=pp_rank, construct_only=construct_only)
    with compat.te_modules_on_cpu() if construct_only else contextlib.nullcontext():
        model = GPTModel(
            config=tcfg,
            transformer_layer_spec=spec,
            vocab_size=cfg.padded_vocab_size,
            max_sequence_length=cfg.max_position_embeddings,
            pre_process=pp_rank == 0,
            post_process=pp_rank == state.pp - 1,
            parallel_output=True,
            share_embeddings_and_output_weights=not cfg.untie_embeddings_and_output_weights,
            position_embedding_type="rope",
            rotary_base=int(cfg.rotary_base),
            pg_collection=state.pg)
    if model.post_process:
        from megatron_gspo.model.output_layer import use_batch_first_output

        use_batch_first_output(model)  # logits [b, s, V] without megatron's transpose copy
    if state.device.type == "cuda":  # a CPU job initialized on the CPU (use_cpu_initialization)
        model = model.to(state.device)
    # megatron's own init draws from each rank's RNG stream (layout dependent): re-draw every weight from the
    # seed alone (its pass stays: perform_initialization=False also skips the TP attributes grad-norm reads)
    if init_from_seed:
        from megatron_gspo.model.init_weights import init_weights

        init_weights(model, par.seed, state, init_method_std=cfg.init_method_std, num_layers=cfg.num_layers,
                     gated_linear_unit=tcfg.gated_linear_unit)
    model.construct_only = construct_only
    if construct_only:
        _refuse_forward(model)
    elif cfg.moe_router_load_balancing_type == "seq_aux_loss":
        from megatron_gspo.model.load_balancing import SequenceAuxLoss

        # its gradient scale is set per micro-batch (aux_loss_scales): 0 while the coefficient is 0
        model.seq_aux_loss = SequenceAuxLoss(model, state.pg.tp_cp)
    return model


class ConstructOnlyError(RuntimeError):
    """A forward on a model built with build_model(construct_only=True)."""


def _is_te_module(module: torch.nn.Module) -> bool:
    return any(c.__module__.startswith(("transformer_engine.", "megatron.core.extensions.transformer_engine"))
               for c in type(module).__mro__)


def _refuse_forward(model: torch.nn.Module) -> None:
    """A construct-only model's forward (and any TE module's inside it, called directly) raises
    ConstructOnlyError before TE reaches for a CUDA kernel ("CUDA driver version is insufficient", or
    worse, a half-run step)."""

    def refuse(module, args):
        raise ConstructOnlyError(
            f"{type(module).__name__}.forward on a model built construct-only (build_model(construct_only=True): "
            "the Transformer Engine spec with its parameters on the CPU): Transformer Engine's kernels need a CUDA "
            "device, so this model serves state dicts, checkpoints, conversions and weight reading only; build it "
            "on a CUDA device to run it, or use model.transformer_impl='local' on the CPU")

    for module in model.modules():
        if module is model or _is_te_module(module):
            module.register_forward_pre_hook(refuse)


def causal_attention_mask(seq_len: int, device) -> torch.Tensor:
    """Explicit boolean causal mask [1, 1, s, s] (True = masked): megatron's default mask path
    assumes CUDA (compat.py)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def forward_logits(model, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                   attention_mask: Optional[torch.Tensor] = None,
                   padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """tokens [b, s] -> this TP rank's vocab shard of the logits [b, s, V_padded / tp].

    padding_mask [b, s] bool, True at positions that hold no real token: megatron leaves them out of
    the MoE load-balancing statistics (and counts), so the aux loss does not depend on how much
    padding a batch or a layout adds. Under sequence parallelism megatron splits the sequence over
    the TP ranks and needs s % TP == 0, and FP8 GEMMs need b x s / TP divisible by the recipe's
    alignment (fp8_alignment.py): a shorter input is right-padded here (the extra columns are
    padding) and the logits are cut back to s columns; causal attention keeps the extra columns from
    touching real positions. (The trainer's micro-batches come aligned: rollout.forward_width_multiple.
    Routing replay needs the caller to pad instead: its routes are per position of the input it was
    given.)
    """
    from megatron_gspo.model import fp8_alignment

    b, s = tokens.shape
    cfg = unwrap(model).config
    sp = cfg.tensor_model_parallel_size if cfg.sequence_parallel else 1
    extra = fp8_alignment.padded_length(s, b, sp, fp8_alignment.token_alignment(cfg)) - s
    if extra:
        tokens = F.pad(tokens, (0, extra))
        if padding_mask is None:
            padding_mask = torch.zeros(b, s, dtype=torch.bool, device=tokens.device)
        padding_mask = F.pad(padding_mask, (0, extra), value=True)
        if position_ids is not None:
            position_ids = torch.cat([position_ids, position_ids[:, -1:] + torch.arange(1, extra + 1, device=tokens.device)], 1)
        if attention_mask is not None:
            raise ValueError(f"forward_logits: an input of {b} x {s} tokens needs {extra} padding column(s) (sequence "
                             f"parallel over TP={sp}, FP8 token alignment {fp8_alignment.token_alignment(cfg)}) and an "
                             f"explicit attention_mask was given: pad the input (and its mask) to {s + extra} columns")
    n = s + extra
    if position_ids is None:
        position_ids = torch.arange(n, device=tokens.device).unsqueeze(0).expand(b, n)
    if attention_mask is None and tokens.device.type != "cuda":
        attention_mask = causal_attention_mask(n, tokens.device)
    kw = {} if padding_mask is None else {"padding_mask": padding_mask}
    logits = model(input_ids=tokens, position_ids=position_ids, attention_mask=attention_mask, **kw)
    return logits[:, :s] if extra else logits


def forward_logprobs(model, tokens: torch.Tensor, target: torch.Tensor, vocab_size: int, temperature: float = 1.0,
                     with_entropy: bool = True, padding_mask: Optional[torch.Tensor] = None,
                     position_ids: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """tokens [b, s] -> (log-probs [b, s] fp32 of ``target`` [b, s], entropy [b, s] fp32 or None).

    What ``vocab_parallel_logprobs(forward_logits(model, tokens, ...), target, ...)`` computes, without
    the [b, s, V/tp] logits: the model's forward returns its final hidden states and the output layer
    runs inside the chunked log-prob function (fused_logprobs.py), so the memory of the output layer,
    the log-probs and their backward does not grow with tokens x vocabulary. Padding mask, sequence-
    parallel padding and routing hooks are those of forward_logits (the decoder runs unchanged); the
    vocabulary shards and their statistics are reduced over the output layer's TP group."""
    from megatron_gspo.model.fused_logprobs import output_layer_logprobs
    from megatron_gspo.model.output_layer import returning_hidden

    m = unwrap(model)
    with returning_hidden(m):
        hidden = forward_logits(model, tokens, position_ids=position_ids, padding_mask=padding_mask)  # [b, s, h]
    weight = m.shared_embedding_or_output_weight() if m.share_embeddings_and_output_weights else m.output_layer.weight
    group = m.output_layer.tp_group
    group = group if group is not None and group.size() > 1 else None
    return output_layer_logprobs(hidden, weight, target, vocab_size, group, temperature=temperature,
                                 with_entropy=with_entropy)


def input_padding_mask(lengths: torch.Tensor, width: int) -> torch.Tensor:
    """Padding mask [b, width] of a forward's input ``tokens[:, :width]`` for rows of ``lengths`` real
    tokens: True at positions >= length - 1. A row's last token predicts nothing, and it is an input
    only when the grid happens to be wider than the row (another row is longer, or sequence parallel
    padded the grid): counting it would make the MoE statistics depend on the batch and the layout."""
    return torch.arange(width, device=lengths.device)[None, :] >= (lengths[:, None] - 1)


# ----------------------------------------------------------------------------------------------
# MoE load-balancing loss: the same weight whatever the micro-batch split and layout
# ----------------------------------------------------------------------------------------------
# megatron adds the load-balancing loss inside the router (MoEAuxLossAutoScaler) and, with
# calculate_per_token_loss (ours), multiplies each rank's share of a micro-batch's aux loss by a
# valid token count n_j (this rank's, or its statistic group's: see _aux_count_is_group_total) before its
# gradient is scaled by MoEAuxLossAutoScaler's loss scale.
# Megatron's own schedule then divides every gradient by the step's token count; we normalize the
# policy loss ourselves and sum gradients, so the scale is set per micro-batch here:
#     scale_j(m) = w_m / n_j(m),   w_m = (valid tokens megatron's statistic of micro-batch m spans) / N
# with N the valid tokens of the whole optimizer step over every DP rank. The weights w_m sum to 1,
# so the aux loss enters with exactly its coefficient however the step is split over micro-batches,
# TP, EP and DP ranks (a constant scale made it grow with the tokens per micro-batch and shrink 1/TP).
# What remains split-dependent is megatron's statistic itself: "aux_loss" counts expert loads per
# micro-batch (over the TP group), "global_aux_loss" over the DP group too, as a running average across
# the step's micro-batches (exact when each rank runs one micro-batch per step).
# "seq_aux_loss" (the default) is the project's own (model/load_balancing.py): one Switch loss per
# sequence, on that sequence's tokens alone, summed over the step's sequences and divided by their
# number R over every DP rank: scale_j = coeff / R for every micro-batch, and nothing depends on the split.


def aux_loss_scales(padding_masks: list[torch.Tensor], state: ParallelState, load_balancing_type: str,
                    coeff: float) -> list[float]:
    """Loss scale of each micro-batch of one optimizer step on this rank (see above).

    padding_masks: per micro-batch [b, s] bool (True = padding) of the training forwards' inputs,
    every rank of the DP group passing the same number of micro-batches. Collective over DP (one
    all-reduce) unless the aux loss is off."""
    from megatron_gspo.runtime import comm

    if coeff == 0 or load_balancing_type == "none" or not padding_masks:
        return [0.0] * len(padding_masks)
    valid = [~m for m in padding_masks]
    if load_balancing_type == "seq_aux_loss":
        rows = sum(v.any(1).sum() for v in valid).to(torch.float64).reshape(1)  # sequences with a token
        rows = comm.all_reduce(rows, "sum", state.dp_group, what="seq_aux_loss weight: sequences of the step")
        return [coeff / float(rows) if float(rows) > 0 else 0.0] * len(padding_masks)
    counts = torch.stack([v.sum() for v in valid]).to(torch.float64)  # [M] valid tokens per micro-batch
    dp_counts = comm.all_reduce(counts.clone(), "sum", state.dp_group, what="aux-loss weights: valid tokens per micro-batch")
    total = float(dp_counts.sum())
    # the tokens megatron's statistic of a micro-batch spans, and the group it reduces them over
    is_global = load_balancing_type == "global_aux_loss"
    spans, group = (dp_counts, state.pg.tp_dp_cp) if is_global else (counts, state.pg.tp_cp)
    group_total = _aux_count_is_group_total(group, state)
    scales = []
    for m, v in enumerate(valid):
        if group_total:
            n_j = float(spans[m])
        else:  # this rank's own tokens: its contiguous sequence chunk under sequence parallel
            local = v
            if state.sequence_parallel and state.tp > 1:
                n = v.shape[1] + (-v.shape[1]) % state.tp
                v = F.pad(v, (0, n - v.shape[1]))
                local = v[:, state.tp_rank * (n // state.tp):(state.tp_rank + 1) * (n // state.tp)]
            n_j = float(local.sum())
        scales.append(float(spans[m]) / total / n_j if n_j > 0 and total > 0 else 0.0)
    return scales


def aux_loss_needs_one_plan_over_dp(load_balancing_type: str, coeff: float) -> bool:
    """Whether every data-parallel rank must run the same micro-batches (their number and widths) for the
    load-balancing statistic. megatron's aux_loss and global_aux_loss weigh each micro-batch by its tokens
    over DP (aux_loss_scales all-reduces a count per micro-batch), and global_aux_loss also reduces its expert
    counts over TP x DP inside every training forward: ranks with different micro-batch counts would meet in
    mismatched collectives. seq_aux_loss needs one all-reduce per step whatever the split."""
    return coeff != 0 and load_balancing_type in ("aux_loss", "global_aux_loss")


def _aux_count_is_group_total(group, state: ParallelState) -> bool:
    """Which token count megatron multiplies a rank's aux-loss share by.

    megatron-core 0.16's get_tokens_per_expert_and_token_count all-reduces the local expert counts
    *in place* over the statistic's group (TP, or TP x DP for global_aux_loss) before it derives the
    "local" token count from them when a padding mask is given: the count is then the whole group's
    valid tokens, not this rank's (without a mask it is this rank's). Asked once per group with a
    one-token routing map rather than assumed, so a megatron that fixes the aliasing gets the right
    scale too. Collective over ``group``; the answer is kept on the parallel state (it dies with the groups)."""
    if group.size() == 1:
        return True  # one rank: its count is the group's either way
    key = ("aux_count_is_group_total", id(group))
    if key not in state.probes:
        from megatron.core.transformer.moe.moe_utils import get_tokens_per_expert_and_token_count

        one_token = torch.ones(1, 2, dtype=torch.bool, device=state.device)  # 1 token routed to both of 2 experts
        _, local, _ = get_tokens_per_expert_and_token_count(one_token, group, topk=2, with_padding_mask=True)
        state.probes[key] = round(float(local)) == group.size()
    return state.probes[key]


def clear_aux_losses_tracker() -> None:
    """Zero megatron's MoE aux-loss logging tracker (filled by every training forward; Megatron-LM clears
    it after logging each iteration)."""
    from megatron.core.transformer.moe import moe_utils

    moe_utils.clear_aux_losses_tracker()


def set_aux_loss_scale(scale: float, device: torch.device) -> None:
    """Scale of the MoE aux-loss gradient for the next backward (megatron reads it in backward)."""
    from megatron.core.transformer.moe.moe_utils import MoEAuxLossAutoScaler

    MoEAuxLossAutoScaler.set_loss_scale(torch.tensor(scale, dtype=torch.float32, device=device))


def unwrap(model):
    """The GPTModel inside DDP / Float16Module wrappers."""
    while hasattr(model, "module"):
        model = model.module
    return model


def _human(n: int) -> str:
    for unit, div in (("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= div:
            return f"{n / div:.2f}{unit}"
    return str(n)


def model_summary(cfg: ModelConfig, device: torch.device) -> str:
    impl = resolve_impl(cfg, device)
    return (f"{cfg.preset or 'custom'}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.num_moe_experts} experts top-{cfg.moe_router_topk}, "
            f"{_human(cfg.num_parameters())} params ({_human(cfg.num_parameters(active=True))} active), "
            f"impl={impl}, attention={resolve_attention_impl(cfg, impl)}, experts={resolve_expert_impl(cfg, impl)}, "
            f"precision={job_precision(cfg, device)[0]}")


def wrap_ddp(model, state: ParallelState):
    """megatron-core DDP with contiguous grad buffers; gradients are reduce-scattered when
    ``state.use_distributed_optimizer`` (the optimizer then steps only this rank's shard) and
    all-reduced otherwise.

    The TransformerConfig sets calculate_per_token_loss=True, so DDP *sums* gradients over
    data-parallel ranks (no 1/dp scaling): our losses divide by the global number of
    sequences/tokens themselves, which makes any DP/EP layout give the single-rank gradient.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    mark_expert_shards(model, state)
    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=state.use_distributed_optimizer,
        # a bucket per ~40M params on GPU; one bucket on CPU (gloo, no overlap to win)
        bucket_size=None,
    )
    ddp = DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model, pg_collection=state.pg)
    # megatron registers its gradient hook on each parameter's grad accumulator (a C++ autograd node) and
    # keeps no handle. The hook holds the DDP, the DDP the model and its process groups, the node its hook:
    # a cycle through C++ that Python's collector cannot see once a backward has run, so a finished job's
    # model, grad buffers and gloo threads (3 per process group, ~48 per job) would live as long as the
    # process. The hooks' dicts (what a RemovableHandle removes from) are taken now, while the collector
    # still reaches them through the nodes, so that release_ddp can remove the hooks.
    ddp._gspo_hook_dicts = [d for acc in getattr(ddp, "grad_accs", ()) for d in gc.get_referents(acc)
                            if isinstance(d, dict)]
    return ddp


def mark_expert_shards(model, state: ParallelState) -> None:
    """Mark the routed experts' weights as expert-parallel (``allreduce=False``) where they are sharded over an
    expert-TP group that is not the TP group: EP 1, expert-TP > 1 and != TP.

    DDP and megatron's optimizer read ``param.allreduce``: False puts a weight in the expert buffers (gradients
    reduced over the expert-data-parallel group, the grad norm summed over expert-TP x EP). megatron-core 0.16
    sets it False only when EP > 1 (tensor_parallel/layers.py: ``not (is_expert and expert_parallel)``), so at
    TP 1 / EP 1 / expert-TP 2 the two expert-TP shards, which sit on the two DP ranks, were summed as if
    replicas of one weight: each shard's gradient became its own plus the other's (measured: cosine 0.71 and
    norm 1.41x against one rank's). Under EP > 1, or expert-TP = TP (the TP group's ranks are no DP replicas),
    megatron's marking is already right and nothing changes; expert-TP 1 (unsharded experts) is left as
    megatron marks it too."""
    if state.ep > 1 or state.etp == 1 or state.etp == state.tp:
        return
    for name, param in model.named_parameters():
        if ".experts." in name:  # the routed experts (not mlp.shared_experts: dense, replicated)
            param.allreduce = False


def release_ddp(ddp) -> None:
    """After the job (Trainer.close): remove DDP's gradient hooks (see wrap_ddp), so that the model, its
    buffers and its process groups are freed with the last reference to them. The DDP takes no backward
    after this."""
    for hooks in getattr(ddp, "_gspo_hook_dicts", ()):
        hooks.clear()
    ddp._gspo_hook_dicts = []
    if hasattr(ddp, "grad_accs"):
        ddp.grad_accs.clear()


def finalize_grads(ddp_model, state: ParallelState) -> None:
    """Reduce gradients over DP (and expert-DP), and over TP for sequence-parallel norms."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ddp_model], pg_collection=state.pg)
