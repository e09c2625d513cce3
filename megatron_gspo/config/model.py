"""The model section: a Qwen3-MoE-family decoder in Megatron-LM's argument names, its presets, and
the mapping from a Hugging Face ``config.json``."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Optional

from megatron_gspo.config.checks import check
from megatron_gspo.config.fields import Resume, knob, validate
from megatron_gspo.errors import ConfigError
from megatron_gspo.textfile import read_json_object


PRECISIONS = ("auto", "fp32", "bf16")


def resolve_precision(precision: str, device_type: str, bf16_supported: bool) -> tuple[str, str]:
    """The precision a job runs in: ``model.precision`` for a job on ``device_type`` ("cpu" | "cuda"), whose
    device runs bf16 matmuls (``bf16_supported``) or not -> ("fp32" | "bf16", why, in words for the log).

    "auto" is fp32 on the CPU (the CPU path's measured numbers: fp32 rollout and training log-probs agree to
    float noise, docs/algorithms.md) and bf16 on a GPU that has it: Transformer Engine's spec runs bf16 GEMMs
    and fused attention, and without TE the local spec's experts run torch._grouped_mm, which on CUDA takes
    bf16 only (experts.grouped_mm_available); in fp32 they fall back to a loop over experts with a host sync
    per layer (2.81 ms vs 6.12 ms per expert layer on an H100, ../shared/notes/h100-first-run.md)."""
    if precision != "auto":
        return precision, f"model.precision={precision}"
    if device_type != "cuda":
        return "fp32", "auto: fp32 on the CPU"
    if not bf16_supported:
        return "fp32", "auto: this GPU has no bf16"
    return "bf16", ("auto: bf16 on a GPU (Transformer Engine's kernels and torch._grouped_mm experts run in bf16; "
                    "set model.precision=fp32 for fp32)")


@dataclass
class ModelConfig:
    """Architecture of a Qwen3-MoE-family decoder (all layers MoE), in Megatron's argument names."""

    preset: Optional[str] = knob(None, resume=Resume.MAY_CHANGE)
    num_layers: int = knob(2, resume=Resume.REFUSED, gt=0)
    hidden_size: int = knob(64, resume=Resume.REFUSED, gt=0)
    num_attention_heads: int = knob(4, resume=Resume.REFUSED, gt=0)
    num_query_groups: int = knob(2, resume=Resume.REFUSED, gt=0)
    kv_channels: int = knob(16, resume=Resume.REFUSED, gt=0)
    vocab_size: int = knob(128, resume=Resume.REFUSED, gt=0)
    # The embedding/output table is padded to a multiple of this. A fixed multiple (not 128 x TP as
    # in Megatron-LM) keeps checkpoints loadable under any TP that divides it.
    make_vocab_size_divisible_by: int = knob(128, resume=Resume.REFUSED, gt=0)
    max_position_embeddings: int = knob(512, resume=Resume.REFUSED, gt=0)
    rotary_base: float = knob(1_000_000.0, resume=Resume.REFUSED)
    norm_epsilon: float = knob(1e-6, resume=Resume.REFUSED, gt=0)
    qk_layernorm: bool = knob(True, resume=Resume.REFUSED)
    untie_embeddings_and_output_weights: bool = knob(True, resume=Resume.REFUSED)
    # MoE
    num_moe_experts: int = knob(4, resume=Resume.REFUSED, gt=0)
    moe_router_topk: int = knob(2, resume=Resume.REFUSED, gt=0)
    moe_ffn_hidden_size: int = knob(32, resume=Resume.REFUSED, gt=0)
    # Qwen3 renormalizes the top-k probabilities (norm_topk_prob): softmax over the top-k logits,
    # i.e. megatron's pre_softmax=False.
    moe_router_pre_softmax: bool = knob(False, resume=Resume.REFUSED)
    # RL peers found bf16 router logits make log-probs drift between passes: route in fp32.
    moe_router_dtype: Optional[str] = knob("fp32", resume=Resume.REFUSED, choices=(None, "fp32", "fp64"))
    moe_aux_loss_coeff: float = knob(1e-3, resume=Resume.REFUSED)
    # The load-balancing loss. seq_aux_loss: the project's, one Switch loss per sequence averaged over the
    # optimizer step's sequences, the same under any layout and micro-batch split (model/load_balancing.py).
    # aux_loss / global_aux_loss: megatron-core's, over a micro-batch (and the DP group), so they depend on
    # how rows are dealt to ranks and micro-batches (docs/layouts.md). none: off.
    moe_router_load_balancing_type: str = knob("seq_aux_loss", resume=Resume.REFUSED,
                                               choices=("aux_loss", "seq_aux_loss", "global_aux_loss", "none"))
    # "auto": alltoall on GPU, allgather on CPU (alltoall creates CUDA streams).
    moe_token_dispatcher_type: str = knob("auto", resume=Resume.MAY_CHANGE,
                                          choices=("auto", "allgather", "alltoall", "flex"))
    # "auto": TE grouped GEMM with TE; otherwise "batched" (megatron_gspo.model.experts: SequentialMLP's
    # parameters, all local experts in grouped GEMMs). "sequential" = megatron's per-expert loop.
    moe_expert_impl: str = knob("auto", resume=Resume.MAY_CHANGE,
                                choices=("auto", "sequential", "batched", "te_grouped"))
    moe_router_fusion: bool = knob(False, resume=Resume.MAY_CHANGE)
    # Core attention: "auto" = TE's fused attention with TE, else "sdpa" (megatron_gspo.model.attention:
    # torch's fused scaled_dot_product_attention, no K/V copies under GQA). "unfused" = megatron's
    # DotProductAttention (baddbmm + masked softmax + bmm).
    attention_impl: str = knob("auto", resume=Resume.MAY_CHANGE, choices=("auto", "sdpa", "unfused"))
    init_method_std: float = knob(0.02, resume=Resume.REFUSED)
    # Implementation: "auto" picks Transformer Engine when TE and CUDA are both present.
    transformer_impl: str = knob("auto", resume=Resume.MAY_CHANGE, choices=("auto", "local", "transformer_engine"))
    # Numerics: "fp32" | "bf16" | "auto" (fp32 on the CPU, bf16 on a GPU that has it: resolve_precision).
    # FP8 (TE only) is "e4m3" | "hybrid" with a recipe, in bf16.
    precision: str = knob("auto", resume=Resume.REFUSED, choices=PRECISIONS)
    fp8: Optional[str] = knob(None, resume=Resume.REFUSED, choices=(None, "e4m3", "hybrid"))
    fp8_recipe: str = knob("delayed", resume=Resume.REFUSED, choices=("delayed", "tensorwise", "mxfp8", "blockwise"))
    # Activation recompute (Megatron names): None | "selective" | "full".
    recompute_granularity: Optional[str] = knob(None, resume=Resume.MAY_CHANGE, choices=(None, "selective", "full"))
    recompute_method: Optional[str] = knob(None, resume=Resume.MAY_CHANGE, choices=(None, "uniform", "block"))
    recompute_num_layers: Optional[int] = knob(None, resume=Resume.MAY_CHANGE)

    def __post_init__(self) -> None:
        validate(self, "model")
        check(
            self.num_attention_heads % self.num_query_groups == 0,
            f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
            f"model.num_query_groups={self.num_query_groups} (GQA groups)",
        )
        check(
            self.moe_router_topk <= self.num_moe_experts,
            f"model.moe_router_topk={self.moe_router_topk} exceeds model.num_moe_experts={self.num_moe_experts}",
        )
        if self.fp8 is not None:
            check(self.precision == "bf16", f"model.fp8={self.fp8!r} needs model.precision='bf16', got {self.precision!r}")
            check(self.transformer_impl != "local", "model.fp8 needs Transformer Engine; model.transformer_impl='local' cannot run FP8")
        if self.recompute_granularity == "full":
            check(self.recompute_method is not None and self.recompute_num_layers is not None,
                   "model.recompute_granularity='full' needs model.recompute_method and model.recompute_num_layers")

    @property
    def padded_vocab_size(self) -> int:
        m = self.make_vocab_size_divisible_by
        return ((self.vocab_size + m - 1) // m) * m

    def num_parameters(self, active: bool = False) -> int:
        """Parameter count from the architecture formula (unpadded vocab, like HF reports).

        active=True counts only the top-k routed experts per token (the MoE "active" size).
        """
        h, L = self.hidden_size, self.num_layers
        q = self.num_attention_heads * self.kv_channels
        kv = self.num_query_groups * self.kv_channels
        attn = h * q + 2 * h * kv + q * h  # q, k, v, o projections (no bias)
        norms = 2 * h + (2 * self.kv_channels if self.qk_layernorm else 0)
        router = self.num_moe_experts * h
        n_exp = self.moe_router_topk if active else self.num_moe_experts
        experts = n_exp * 3 * h * self.moe_ffn_hidden_size  # SwiGLU: gate, up, down
        per_layer = attn + norms + router + experts
        emb = self.vocab_size * h * (2 if self.untie_embeddings_and_output_weights else 1)
        return L * per_layer + emb + h  # + final norm


MODEL_PRESETS: dict[str, dict[str, Any]] = {
    # The real Qwen3-30B-A3B (HF Qwen/Qwen3-30B-A3B config.json).
    "qwen3-30b-a3b": dict(
        num_layers=48, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
        kv_channels=128,  # explicit: 2048 / 32 would be 64
        vocab_size=151936, max_position_embeddings=40960, rotary_base=1_000_000.0,
        norm_epsilon=1e-6, qk_layernorm=True, untie_embeddings_and_output_weights=True,
        num_moe_experts=128, moe_router_topk=8, moe_ffn_hidden_size=768,
        moe_aux_loss_coeff=1e-3, precision="bf16",
    ),
    # Same family and per-layer shape as 30B-A3B, fewer layers and experts: ~2.0B total,
    # ~1.1B active; fits one H100 with Adam for benchmarks.
    "qwen3-moe-2b-proxy": dict(
        num_layers=8, hidden_size=2048, num_attention_heads=32, num_query_groups=4,
        kv_channels=128, vocab_size=151936, max_position_embeddings=40960,
        rotary_base=1_000_000.0, norm_epsilon=1e-6, num_moe_experts=32, moe_router_topk=8,
        moe_ffn_hidden_size=768, precision="bf16",
    ),
    # Tiny CPU model for tests and the demo job.
    "tiny": dict(
        num_layers=2, hidden_size=64, num_attention_heads=4, num_query_groups=2, kv_channels=16,
        vocab_size=128, make_vocab_size_divisible_by=128, max_position_embeddings=512,
        rotary_base=10000.0, num_moe_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
        precision="auto",  # fp32 on the CPU (the tested CPU numbers), bf16 on a GPU (resolve_precision)
    ),
}


def model_config_from_preset(name: str, **overrides: Any) -> ModelConfig:
    if name not in MODEL_PRESETS:
        raise ConfigError(f"model.preset={name!r} is unknown; valid presets: {sorted(MODEL_PRESETS)}")
    return ModelConfig(preset=name, **{**MODEL_PRESETS[name], **overrides})


def model_config_from_hf(config_json: str | os.PathLike | dict, **overrides: Any) -> ModelConfig:
    """Build a ModelConfig from a Hugging Face Qwen3-MoE ``config.json`` (path, directory or dict)."""
    src = str(config_json)
    if isinstance(config_json, dict):
        hf = config_json
    else:
        path = os.path.join(src, "config.json") if os.path.isdir(src) else src
        if not os.path.isfile(path):
            raise ConfigError(f"HF config not found: {path}")
        hf = read_json_object(path, ConfigError)
    model_type = hf.get("model_type")
    if model_type != "qwen3_moe":
        raise ConfigError(f"{src}: model_type={model_type!r}; only 'qwen3_moe' is supported")
    hf = dict(hf)
    if "num_experts" not in hf and "num_local_experts" in hf:  # transformers 5 spelling
        hf["num_experts"] = hf["num_local_experts"]
    required = ("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads",
                "vocab_size", "num_experts", "num_experts_per_tok", "moe_intermediate_size")
    missing = [k for k in required if k not in hf]
    if missing:
        raise ConfigError(f"{src}: config.json lacks keys {missing}")
    if hf.get("decoder_sparse_step", 1) != 1 or hf.get("mlp_only_layers"):
        raise ConfigError(f"{src}: dense layers (decoder_sparse_step/mlp_only_layers) are not supported; every layer must be MoE")
    if hf.get("attention_bias", False):
        raise ConfigError(f"{src}: attention_bias=true is not supported (Qwen3 has no attention bias)")
    rope = hf.get("rope_theta")
    if rope is None:
        rope = (hf.get("rope_parameters") or {}).get("rope_theta", 10000.0)
    kw = dict(
        num_layers=hf["num_hidden_layers"], hidden_size=hf["hidden_size"],
        num_attention_heads=hf["num_attention_heads"], num_query_groups=hf["num_key_value_heads"],
        kv_channels=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
        vocab_size=hf["vocab_size"], max_position_embeddings=hf.get("max_position_embeddings", 4096),
        rotary_base=float(rope), norm_epsilon=hf.get("rms_norm_eps", 1e-6), qk_layernorm=True,
        untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
        num_moe_experts=hf["num_experts"], moe_router_topk=hf["num_experts_per_tok"],
        moe_ffn_hidden_size=hf["moe_intermediate_size"],
        moe_aux_loss_coeff=hf.get("router_aux_loss_coef", 1e-3),
        # norm_topk_prob (Qwen3: true) = softmax over the top-k logits = megatron pre_softmax=False;
        # false = softmax over all experts, top-k kept un-renormalized = pre_softmax=True.
        # transformers' default for a missing key is false.
        moe_router_pre_softmax=not hf.get("norm_topk_prob", False),
        init_method_std=hf.get("initializer_range", 0.02),
    )
    kw.update(overrides)
    return ModelConfig(**kw)
