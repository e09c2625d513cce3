"""Build a megatron-core ``GPTModel`` with MoE layers (Qwen3-MoE family) from a ``ModelConfig``.

Two implementations share one TransformerConfig:
- Transformer Engine spec (TE linear/attention, fused norms, grouped-GEMM experts, FP8-capable)
  when TE and CUDA are both present;
- megatron-core's local pure-PyTorch spec otherwise, with a sequence-parallel-capable RMSNorm
  (megatron's WrappedTorchNorm refuses sequence parallel).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_gspo import cpu_compat
from megatron_gspo.config import ConfigError, ModelConfig, ParallelConfig
from megatron_gspo.parallel import ParallelState


def have_te() -> bool:
    try:
        import transformer_engine  # noqa: F401
        import megatron.core.extensions.transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


def resolve_impl(cfg: ModelConfig) -> str:
    """"local" or "transformer_engine" for this machine; an explicit TE request without TE fails."""
    te_ok = have_te() and torch.cuda.is_available()
    if cfg.transformer_impl == "auto":
        return "transformer_engine" if te_ok else "local"
    if cfg.transformer_impl == "transformer_engine" and not te_ok:
        raise ConfigError(
            "model.transformer_impl='transformer_engine' needs Transformer Engine and CUDA "
            f"(TE importable: {have_te()}, CUDA: {torch.cuda.is_available()}); use 'local' or 'auto'"
        )
    return cfg.transformer_impl


def resolve_expert_impl(cfg: ModelConfig, impl: str) -> str:
    # "batched" (megatron_gspo.experts.BatchedSequentialMLP): SequentialMLP's parameters and
    # checkpoint layout, all local experts in grouped GEMMs; equal to "sequential" and faster.
    if cfg.moe_expert_impl == "auto":
        return "te_grouped" if impl == "transformer_engine" else "batched"
    if cfg.moe_expert_impl == "te_grouped" and impl != "transformer_engine":
        raise ConfigError("model.moe_expert_impl='te_grouped' needs model.transformer_impl='transformer_engine'")
    if cfg.moe_expert_impl == "batched" and impl == "transformer_engine":
        raise ConfigError("model.moe_expert_impl='batched' is the local spec's expert path; with "
                          "model.transformer_impl='transformer_engine' use 'te_grouped' or 'sequential'")
    return cfg.moe_expert_impl


def resolve_dispatcher(cfg: ModelConfig) -> str:
    if cfg.moe_token_dispatcher_type == "auto":
        # alltoall creates CUDA streams (CPU workaround 6); on GPU it is the fast path.
        return "alltoall" if torch.cuda.is_available() else "allgather"
    if cfg.moe_token_dispatcher_type != "allgather" and not torch.cuda.is_available():
        raise ConfigError(f"model.moe_token_dispatcher_type={cfg.moe_token_dispatcher_type!r} needs CUDA; use 'allgather' on CPU")
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


def build_transformer_config(cfg: ModelConfig, par: ParallelConfig, routing_replay: bool = False):
    from megatron.core.transformer.transformer_config import TransformerConfig

    cuda = torch.cuda.is_available()
    impl = resolve_impl(cfg)
    expert_impl = resolve_expert_impl(cfg, impl)
    if cfg.moe_router_fusion and routing_replay:
        # megatron-core 0.16: the fused top-k kernel returns before RouterReplay's hook, so
        # replay would be skipped silently.
        raise ConfigError("model.moe_router_fusion=true cannot be combined with routing replay: "
                          "the fused top-k path skips RouterReplay in megatron-core 0.16")
    if cfg.moe_router_fusion and impl != "transformer_engine":
        raise ConfigError("model.moe_router_fusion=true needs Transformer Engine")
    dtype = torch.bfloat16 if cfg.precision == "bf16" else torch.float32
    kw = dict(
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
        # fusions that need CUDA kernels (CPU workaround 8) are enabled on GPU only
        bias_activation_fusion=cuda,
        bias_dropout_fusion=cuda,
        masked_softmax_fusion=cuda and impl == "transformer_engine",
        persist_layer_norm=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        use_cpu_initialization=not cuda,
        params_dtype=dtype,
        bf16=cfg.precision == "bf16",
        fp8=cfg.fp8,
        fp8_recipe=cfg.fp8_recipe,
        # MoE
        num_moe_experts=cfg.num_moe_experts,
        moe_router_topk=cfg.moe_router_topk,
        moe_ffn_hidden_size=cfg.moe_ffn_hidden_size,
        moe_router_pre_softmax=cfg.moe_router_pre_softmax,
        moe_router_dtype=cfg.moe_router_dtype,
        moe_aux_loss_coeff=cfg.moe_aux_loss_coeff,
        moe_router_load_balancing_type=cfg.moe_router_load_balancing_type,
        moe_token_dispatcher_type=resolve_dispatcher(cfg),
        moe_grouped_gemm=expert_impl == "te_grouped",
        moe_permute_fusion=cuda and impl == "transformer_engine",
        moe_router_fusion=cfg.moe_router_fusion,
        moe_enable_routing_replay=routing_replay,
        # parallel
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
    if cfg.recompute_granularity == "selective":
        # megatron refuses moe_act recompute without grouped GEMM (the local spec's experts)
        kw["recompute_modules"] = ["core_attn", "moe_act"] if expert_impl == "te_grouped" else ["core_attn"]
    return TransformerConfig(**kw)


def build_layer_spec(tcfg, cfg: ModelConfig, pp_rank: Optional[int] = None):
    """TransformerBlockSubmodules for this pipeline stage."""
    from megatron.core.models.gpt import gpt_layer_specs as specs
    from megatron.core.transformer.transformer_block import (
        TransformerBlockSubmodules,
        get_num_layers_to_build,
    )

    impl = resolve_impl(cfg)
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
        # Swap megatron's WrappedTorchNorm (refuses sequence parallel, CPU workaround 7).
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
        if resolve_expert_impl(cfg, impl) == "batched":
            from megatron_gspo.experts import BatchedSequentialMLP

            sub.mlp.submodules.experts.module = BatchedSequentialMLP
    n = get_num_layers_to_build(tcfg, vp_stage=None, pp_rank=pp_rank)
    return TransformerBlockSubmodules(layer_specs=[layer] * n, layer_norm=final_norm)


def build_model(cfg: ModelConfig, par: ParallelConfig, state: ParallelState, routing_replay: bool = False):
    """Build this rank's shard of the GPTModel (on GPU: moved to the local device)."""
    from megatron.core.models.gpt import GPTModel
    from megatron.core.transformer.moe.router_replay import RouterReplay

    cpu_compat.apply()
    # RouterReplay keeps a class-level list of instances, one per MoE layer, in build order; a
    # rebuilt replay model must start from an empty list or replay data goes to stale routers.
    # (Models without replay create no instances and leave the list alone.)
    if routing_replay:
        RouterReplay.clear_global_router_replay_instances()
    tcfg = build_transformer_config(cfg, par, routing_replay=routing_replay)
    pp_rank = state.pp_rank
    spec = build_layer_spec(tcfg, cfg, pp_rank=pp_rank)
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
        pg_collection=state.pg,
    )
    if torch.cuda.is_available():
        model = model.to(state.device)
    return model


def causal_attention_mask(seq_len: int, device) -> torch.Tensor:
    """Explicit boolean causal mask [1, 1, s, s] (True = masked): megatron's default mask path
    assumes CUDA (CPU workaround 3)."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def forward_logits(model, tokens: torch.Tensor, position_ids: Optional[torch.Tensor] = None,
                   attention_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """tokens [b, s] -> this TP rank's vocab shard of the logits [b, s, V_padded / tp]."""
    b, s = tokens.shape
    if position_ids is None:
        position_ids = torch.arange(s, device=tokens.device).unsqueeze(0).expand(b, s)
    if attention_mask is None and not torch.cuda.is_available():
        attention_mask = causal_attention_mask(s, tokens.device)
    return model(input_ids=tokens, position_ids=position_ids, attention_mask=attention_mask)


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


def model_summary(cfg: ModelConfig) -> str:
    return (f"{cfg.preset or 'custom'}: {cfg.num_layers} layers, hidden {cfg.hidden_size}, "
            f"{cfg.num_moe_experts} experts top-{cfg.moe_router_topk}, "
            f"{_human(cfg.num_parameters())} params ({_human(cfg.num_parameters(active=True))} active), "
            f"impl={resolve_impl(cfg)}, precision={cfg.precision}")


def wrap_ddp(model, state: ParallelState, use_distributed_optimizer: bool = False):
    """megatron-core DDP with contiguous grad buffers.

    The TransformerConfig sets calculate_per_token_loss=True, so DDP *sums* gradients over
    data-parallel ranks (no 1/dp scaling): our losses divide by the global number of
    sequences/tokens themselves, which makes any DP/EP layout give the single-rank gradient.
    """
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig

    ddp_cfg = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
        # a bucket per ~40M params on GPU; one bucket on CPU (gloo, no overlap to win)
        bucket_size=None,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_cfg, module=model, pg_collection=state.pg)


def finalize_grads(ddp_model, state: ParallelState) -> None:
    """Reduce gradients over DP (and expert-DP), and over TP for sequence-parallel norms."""
    from megatron.core.distributed import finalize_model_grads

    finalize_model_grads([ddp_model], pg_collection=state.pg)
