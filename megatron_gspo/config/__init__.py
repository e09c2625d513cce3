"""Typed configuration of a job: leaf dataclasses, YAML loading and command-line overrides.

Every section is a dataclass validated in ``__post_init__`` with a message that names the field
(``ConfigError: model.num_attention_heads=...``). Field names follow Megatron-LM's argument names
where one exists (``tensor_model_parallel_size``, ``num_query_groups``, ``moe_router_topk`` ...).

This package is a leaf: it imports nothing of megatron_gspo but the leaves ``errors`` and ``textfile``
(UTF-8 files read with a bad byte's file and line); every subsystem imports
its section from here (tests/test_imports.py imports each module alone in a fresh interpreter).

    model.py     ModelConfig, the presets, a Hugging Face config.json -> ModelConfig
    sections.py  parallel, loss, generation, optimizer, data, tokenizer, reward, train, checkpoint,
                 rollout_correction, eval
    rollout.py   the rollout section (colocated / async rollouts) and its cross-section checks
    job.py       JobConfig (the sections + cross-section checks) and load_job_config
    loader.py    YAML / CLI plumbing: from_dict, overrides, coercion to the annotated types
    checks.py    the validation helpers
"""

from megatron_gspo.config.job import (
    DEMO_CONFIG,
    ON_POLICY_RATIO_TOLERANCE,
    JobConfig,
    load_job_config,
    old_logprob_source,
    split_job_args,
)
from megatron_gspo.config.loader import apply_overrides, from_dict, load_yaml, parse_overrides, to_dict
from megatron_gspo.config.rollout import PARTIAL_ROLLOUT_POLICIES, ROLLOUT_MODES, RolloutConfig
from megatron_gspo.config.model import (
    MODEL_PRESETS,
    PRECISIONS,
    ModelConfig,
    model_config_from_hf,
    model_config_from_preset,
    resolve_precision,
)
from megatron_gspo.config.sections import (
    ADVANTAGE_ESTIMATOR_NAMES,
    AGG_MODE_LOSSES,
    DEFAULT_CLIP_RATIOS,
    LOSS_AGG_MODES,
    LOSS_NAMES,
    OLD_LOGPROB_SOURCES,
    OVERLONG_POLICIES,
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTION_MODES,
    ROUTING_REPLAY_MODES,
    SAPO_TAUS,
    TOKEN_RATIO_LOSSES,
    TOKENIZER_TYPES,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    GenerationConfig,
    LossConfig,
    OptimizerConfig,
    ParallelConfig,
    RewardConfig,
    RolloutCorrectionConfig,
    TokenizerConfig,
    TrainConfig,
)
from megatron_gspo.errors import ConfigError

__all__ = [
    "ADVANTAGE_ESTIMATOR_NAMES", "AGG_MODE_LOSSES", "DEFAULT_CLIP_RATIOS", "DEMO_CONFIG", "LOSS_AGG_MODES", "LOSS_NAMES", "MODEL_PRESETS",
    "ON_POLICY_RATIO_TOLERANCE", "PRECISIONS", "old_logprob_source", "resolve_precision",
    "OLD_LOGPROB_SOURCES", "OVERLONG_POLICIES", "ROLLOUT_CORRECTION_LEVELS", "ROLLOUT_CORRECTION_MODES",
    "ROUTING_REPLAY_MODES", "SAPO_TAUS", "TOKEN_RATIO_LOSSES", "TOKENIZER_TYPES", "CheckpointConfig", "ConfigError",
    "DataConfig", "EvalConfig", "GenerationConfig", "JobConfig", "LossConfig", "ModelConfig", "OptimizerConfig",
    "ParallelConfig", "PARTIAL_ROLLOUT_POLICIES", "ROLLOUT_MODES", "RewardConfig", "RolloutConfig", "RolloutCorrectionConfig", "TokenizerConfig", "TrainConfig", "apply_overrides", "from_dict",
    "load_job_config", "load_yaml", "model_config_from_hf", "model_config_from_preset", "parse_overrides",
    "split_job_args", "to_dict",
]
