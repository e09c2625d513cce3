"""Typed configuration: dataclasses, model presets, YAML loading and command-line overrides.

Every section of a job is a dataclass validated in ``__post_init__`` with a message that names
the field (``ConfigError: model.num_attention_heads=...``). A job is loaded from YAML and then
patched with ``section.field=value`` (or ``--section.field value``) overrides, the way torchtitan
and Hydra users expect. Field names follow Megatron-LM's argument names where one exists
(``tensor_model_parallel_size``, ``num_query_groups``, ``moe_router_topk`` ...).

Sections that belong to one subsystem (loss, rollout, data, ...) are defined next to the code that
uses them and only composed here, so each module owns its knobs.
"""

from __future__ import annotations

import dataclasses
import difflib
import json
import os
import types
import typing
from dataclasses import dataclass, field, fields
from typing import Any, Optional


class ConfigError(ValueError):
    """A configuration value or layout is invalid; the message names the field and the numbers."""


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise ConfigError(msg)


# ----------------------------------------------------------------------------------------------
# Model
# ----------------------------------------------------------------------------------------------


@dataclass
class ModelConfig:
    """Architecture of a Qwen3-MoE-family decoder (all layers MoE), in Megatron's argument names."""

    preset: Optional[str] = None
    num_layers: int = 2
    hidden_size: int = 64
    num_attention_heads: int = 4
    num_query_groups: int = 2
    kv_channels: int = 16
    vocab_size: int = 128
    # The embedding/output table is padded to a multiple of this. A fixed multiple (not 128 x TP as
    # in Megatron-LM) keeps checkpoints loadable under any TP that divides it.
    make_vocab_size_divisible_by: int = 128
    max_position_embeddings: int = 512
    rotary_base: float = 1_000_000.0
    norm_epsilon: float = 1e-6
    qk_layernorm: bool = True
    untie_embeddings_and_output_weights: bool = True
    # MoE
    num_moe_experts: int = 4
    moe_router_topk: int = 2
    moe_ffn_hidden_size: int = 32
    # Qwen3 renormalizes the top-k probabilities (norm_topk_prob): softmax over the top-k logits,
    # i.e. megatron's pre_softmax=False.
    moe_router_pre_softmax: bool = False
    # RL peers found bf16 router logits make log-probs drift between passes: route in fp32.
    moe_router_dtype: Optional[str] = "fp32"
    moe_aux_loss_coeff: float = 1e-3
    moe_router_load_balancing_type: str = "aux_loss"
    # "auto": alltoall on GPU, allgather on CPU (alltoall creates CUDA streams).
    moe_token_dispatcher_type: str = "auto"
    # "auto": TE grouped GEMM with TE; otherwise "batched" (megatron_gspo.experts: SequentialMLP's
    # parameters, all local experts in grouped GEMMs). "sequential" = megatron's per-expert loop.
    moe_expert_impl: str = "auto"
    moe_router_fusion: bool = False
    init_method_std: float = 0.02
    # Implementation: "auto" picks Transformer Engine when TE and CUDA are both present.
    transformer_impl: str = "auto"
    # Numerics: "fp32" | "bf16". FP8 (TE only) is "e4m3" | "hybrid" with a recipe.
    precision: str = "fp32"
    fp8: Optional[str] = None
    fp8_recipe: str = "delayed"
    # Activation recompute (Megatron names): None | "selective" | "full".
    recompute_granularity: Optional[str] = None
    recompute_method: Optional[str] = None
    recompute_num_layers: Optional[int] = None

    def __post_init__(self) -> None:
        for name in (
            "num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "kv_channels",
            "vocab_size", "max_position_embeddings", "num_moe_experts", "moe_router_topk",
            "moe_ffn_hidden_size", "make_vocab_size_divisible_by",
        ):
            v = getattr(self, name)
            _check(isinstance(v, int) and v > 0, f"model.{name} must be a positive integer, got {v!r}")
        _check(
            self.num_attention_heads % self.num_query_groups == 0,
            f"model.num_attention_heads={self.num_attention_heads} must be a multiple of "
            f"model.num_query_groups={self.num_query_groups} (GQA groups)",
        )
        _check(
            self.moe_router_topk <= self.num_moe_experts,
            f"model.moe_router_topk={self.moe_router_topk} exceeds model.num_moe_experts={self.num_moe_experts}",
        )
        _check(self.norm_epsilon > 0, f"model.norm_epsilon must be > 0, got {self.norm_epsilon}")
        _choice("model.moe_router_dtype", self.moe_router_dtype, (None, "fp32", "fp64"))
        _choice("model.moe_router_load_balancing_type", self.moe_router_load_balancing_type,
                ("aux_loss", "seq_aux_loss", "global_aux_loss", "none"))
        _choice("model.moe_token_dispatcher_type", self.moe_token_dispatcher_type, ("auto", "allgather", "alltoall", "flex"))
        _choice("model.moe_expert_impl", self.moe_expert_impl, ("auto", "sequential", "batched", "te_grouped"))
        _choice("model.transformer_impl", self.transformer_impl, ("auto", "local", "transformer_engine"))
        _choice("model.precision", self.precision, ("fp32", "bf16"))
        _choice("model.fp8", self.fp8, (None, "e4m3", "hybrid"))
        _choice("model.fp8_recipe", self.fp8_recipe, ("delayed", "tensorwise", "mxfp8", "blockwise"))
        _choice("model.recompute_granularity", self.recompute_granularity, (None, "selective", "full"))
        _choice("model.recompute_method", self.recompute_method, (None, "uniform", "block"))
        if self.fp8 is not None:
            _check(self.precision == "bf16", f"model.fp8={self.fp8!r} needs model.precision='bf16', got {self.precision!r}")
            _check(self.transformer_impl != "local", "model.fp8 needs Transformer Engine; model.transformer_impl='local' cannot run FP8")
        if self.recompute_granularity == "full":
            _check(self.recompute_method is not None and self.recompute_num_layers is not None,
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


def _choice(name: str, value: Any, allowed: tuple) -> None:
    _check(value in allowed, f"{name}={value!r} is not one of {list(allowed)}")


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
        precision="fp32",
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
        with open(path, encoding="utf-8") as f:
            hf = json.load(f)
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


# ----------------------------------------------------------------------------------------------
# Parallelism
# ----------------------------------------------------------------------------------------------


@dataclass
class ParallelConfig:
    """Parallel layout (Megatron names). DP is derived: world / (TP x PP)."""

    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    expert_model_parallel_size: int = 1
    # None means "same as tensor_model_parallel_size" (Megatron's default).
    expert_tensor_parallel_size: Optional[int] = None
    # None means "on whenever TP > 1" (MoE with TP requires it in megatron-core).
    sequence_parallel: Optional[bool] = None
    # megatron's DistributedOptimizer (gradients reduce-scattered, Adam states sharded over DP). None =
    # where it can run and checkpoint (CUDA with Transformer Engine's or apex's fused Adam), else the
    # replicated optimizer; true where it cannot is refused (parallel.resolve_distributed_optimizer).
    use_distributed_optimizer: Optional[bool] = None
    # Minutes before a collective gives up (a dead rank must not hang the others forever).
    distributed_timeout_minutes: float = 10.0
    seed: int = 1234

    def __post_init__(self) -> None:
        for name in ("tensor_model_parallel_size", "pipeline_model_parallel_size", "expert_model_parallel_size"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v >= 1, f"parallel.{name} must be an integer >= 1, got {v!r}")
        if self.expert_tensor_parallel_size is not None:
            v = self.expert_tensor_parallel_size
            _check(isinstance(v, int) and v >= 1, f"parallel.expert_tensor_parallel_size must be an integer >= 1, got {v!r}")
        _check(self.distributed_timeout_minutes > 0, "parallel.distributed_timeout_minutes must be > 0")

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def sp(self) -> bool:
        return self.tensor_model_parallel_size > 1 if self.sequence_parallel is None else self.sequence_parallel


# ----------------------------------------------------------------------------------------------
# YAML / CLI plumbing
# ----------------------------------------------------------------------------------------------


def _resolve_type(tp: Any) -> tuple[Any, bool]:
    """Return (base type, optional?) for a dataclass field annotation."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else Any), True
    return tp, False


def _coerce(value: Any, tp: Any, where: str) -> Any:
    base, optional = _resolve_type(tp)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and optional):
        if optional or base is Any:
            return None
        raise ConfigError(f"{where} may not be null")
    if dataclasses.is_dataclass(base):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
        return from_dict(base, value, where)
    origin = typing.get_origin(base)
    if base is Any:
        return value
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{where} must be a boolean, got {value!r}")
    if base is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be an integer, got {value!r}") from None
        if not f.is_integer():
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return int(f)
    if base is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
    if base is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare off/on as a bool
            return "off" if value is False else "on"
        if isinstance(value, (dict, list)):
            raise ConfigError(f"{where} must be a string, got {type(value).__name__}")
        return str(value)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        (item_t, *_) = typing.get_args(base) or (Any,)
        return [_coerce(v, item_t, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return dict(value)
    return value


def _unknown_key(cls: type, key: str, where: str) -> ConfigError:
    names = [f.name for f in fields(cls)]
    close = difflib.get_close_matches(key, names, n=3)
    hint = f"; did you mean {close}?" if close else f"; valid keys: {names}"
    return ConfigError(f"unknown config key {where + '.' if where else ''}{key}{hint}")


def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass ``cls`` from a (possibly nested) dict, rejecting unknown keys by name."""
    hints = typing.get_type_hints(cls)
    known = {f.name: f for f in fields(cls) if f.init}
    kwargs = {}
    # A model section names a preset ("tiny" when absent, null for none); its values are the
    # defaults the other keys override, so `model.hidden_size=128` alone tweaks the tiny model.
    if cls is ModelConfig and data.get("preset", "tiny"):
        name = data.get("preset", "tiny")
        data = {"preset": name, **data}
        if name not in MODEL_PRESETS:
            raise ConfigError(f"model.preset={name!r} is unknown; valid presets: {sorted(MODEL_PRESETS)}")
        data = {**MODEL_PRESETS[name], **data}
    for key, value in data.items():
        if key not in known:
            raise _unknown_key(cls, key, where)
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}" if where else key)
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - defensive: a required field without default
        raise ConfigError(f"{where or cls.__name__}: {e}") from None


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """``a.b=1``, ``--a.b=1`` and ``--a.b 1`` -> [("a.b", "1"), ...]."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("--"):
            tok = tok[2:]
            if "=" not in tok:
                if i + 1 >= len(argv):
                    raise ConfigError(f"flag --{tok} needs a value")
                out.append((tok.replace("-", "_") if "." not in tok else tok, argv[i + 1]))
                i += 2
                continue
        if "=" not in tok:
            raise ConfigError(f"cannot parse override {argv[i]!r}; expected section.key=value")
        k, v = tok.split("=", 1)
        out.append((k, v))
        i += 1
    return out


def _yaml_scalar(text: str) -> Any:
    """Parse an override's value the way YAML would (numbers, bools, null, lists)."""
    import yaml

    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[tuple[str, str]]) -> dict:
    """Set dotted keys in a nested dict (validation happens when the dataclasses are built)."""
    for key, raw in overrides:
        parts = key.split(".")
        node = data
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {key}: {p} is not a section")
            node = nxt
        node[parts[-1]] = _yaml_scalar(raw)
    return data


def load_yaml(path: str | os.PathLike) -> dict:
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    with open(path, encoding="utf-8") as f:
        try:
            data = yaml.safe_load(f) or {}
        except yaml.YAMLError as e:
            raise ConfigError(f"{path}: invalid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    return data


# ----------------------------------------------------------------------------------------------
# The whole job
# ----------------------------------------------------------------------------------------------
# Subsystem sections live next to their code; imported here (after ConfigError exists, which they
# import back) so that one JobConfig describes a run.
from megatron_gspo.data import DataConfig  # noqa: E402
from megatron_gspo.generation import GenerationConfig  # noqa: E402
from megatron_gspo.losses import LossConfig  # noqa: E402
from megatron_gspo.optim import OptimizerConfig  # noqa: E402
from megatron_gspo.rewards import RewardConfig  # noqa: E402
from megatron_gspo.tokenizer import TokenizerConfig  # noqa: E402

ROUTING_REPLAY_MODES = ("off", "R2", "R3")


@dataclass
class TrainConfig:
    """The RL loop: P prompts x G samples per step, split into minibatches (one optimizer step each)."""

    num_steps: int = 40
    prompts_per_step: int = 16
    # Optimizer steps per rollout: the rollout is split into this many minibatches, so the
    # later ones are trained off-policy (ratios really leave 1).
    num_minibatches: int = 2
    # Sequences per forward/backward (gradient accumulation inside a minibatch).
    micro_batch_size: int = 16
    advantage_estimator: str = "grpo"
    # MoE routing replay for the GRPO baseline: off | R2 (old-log-prob pass) | R3 (rollout).
    routing_replay: str = "off"
    # Supervised warm start on the task's reference answers before RL (0 = none).
    sft_steps: int = 0
    sft_lr: float = 1e-3
    sft_batch_size: int = 32
    # Non-finite loss / gradients skip the update on every rank; this many in a row stop the run.
    max_consecutive_skips: int = 5
    output_dir: str = "runs/gspo"
    tensorboard: bool = True
    log_interval: int = 1
    seed: int = 1234

    def __post_init__(self) -> None:
        for name in ("num_steps", "prompts_per_step", "num_minibatches", "micro_batch_size", "log_interval"):
            v = getattr(self, name)
            _check(isinstance(v, int) and v >= 1, f"train.{name} must be an integer >= 1, got {v!r}")
        _check(self.sft_steps >= 0, f"train.sft_steps must be >= 0, got {self.sft_steps}")
        _check(self.max_consecutive_skips >= 1, f"train.max_consecutive_skips must be >= 1, got {self.max_consecutive_skips}")
        _choice("train.routing_replay", self.routing_replay, ROUTING_REPLAY_MODES)
        from megatron_gspo.advantages import ADVANTAGE_ESTIMATORS

        _choice("train.advantage_estimator", self.advantage_estimator, tuple(ADVANTAGE_ESTIMATORS))


@dataclass
class CheckpointConfig:
    """Megatron-LM names: save / save_interval / load. ``resume`` continues from save's latest."""

    save: Optional[str] = None
    save_interval: int = 0
    load: Optional[str] = None
    resume: bool = False
    keep_last: int = 0

    def __post_init__(self) -> None:
        _check(self.save_interval >= 0, f"checkpoint.save_interval must be >= 0, got {self.save_interval}")
        _check(self.keep_last >= 0, f"checkpoint.keep_last must be >= 0, got {self.keep_last}")
        _check(not (self.resume and not (self.save or self.load)),
               "checkpoint.resume=true needs checkpoint.save (or checkpoint.load) to find a checkpoint in")


@dataclass
class JobConfig:
    model: ModelConfig = field(default_factory=lambda: model_config_from_preset("tiny"))
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    data: DataConfig = field(default_factory=DataConfig)
    tokenizer: TokenizerConfig = field(default_factory=TokenizerConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)

    def __post_init__(self) -> None:
        # Cross-section checks: fail before anything is built (TRL-style).
        t, g = self.train, self.generation
        rollout = t.prompts_per_step * g.n_samples_per_prompt
        _check(rollout % t.num_minibatches == 0,
               f"train.prompts_per_step x generation.n_samples_per_prompt = {rollout} responses is not "
               f"divisible by train.num_minibatches={t.num_minibatches}")
        if t.routing_replay != "off":
            _check(self.loss.name == "grpo",
                   f"train.routing_replay={t.routing_replay!r} is the GRPO baseline's fix; loss.name="
                   f"{self.loss.name!r} (GSPO needs no routing replay). Set train.routing_replay=off")
        if t.advantage_estimator in ("grpo",) and g.n_samples_per_prompt < 2:
            raise ConfigError("generation.n_samples_per_prompt must be >= 2 for group-relative advantages")
        # the warm start learns the reference answers (a built-in task always has them); refused
        # here rather than with a traceback at its first batch
        _check(not (t.sft_steps > 0 and self.data.answer_key is None and not self.data.source.startswith("builtin:")),
               f"train.sft_steps={t.sft_steps} (supervised warm start) needs reference answers, but "
               "data.answer_key is null; set train.sft_steps=0 for data without answers")
        # The RL loop has no pipeline schedule (forward_backward_func) yet: refuse PP up front.
        _check(self.parallel.pipeline_model_parallel_size == 1,
               f"parallel.pipeline_model_parallel_size={self.parallel.pipeline_model_parallel_size}: the RL "
               "trainer supports PP=1 only (use TP/EP/DP; model building and checkpoints support PP)")
        need = self.data.max_prompt_length + g.max_new_tokens
        _check(need <= self.model.max_position_embeddings,
               f"data.max_prompt_length + generation.max_new_tokens = {need} exceeds "
               f"model.max_position_embeddings={self.model.max_position_embeddings}")


def load_job_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> JobConfig:
    """YAML (optional) + ``section.key=value`` overrides -> validated JobConfig."""
    data = load_yaml(path) if path else {}
    data = apply_overrides(data, parse_overrides(list(overrides or [])))
    return from_dict(JobConfig, data)
