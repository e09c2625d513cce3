"""Typed configuration of a job: leaf dataclasses, YAML loading and command-line overrides.

Every section is a dataclass whose fields are declared with ``knob`` (fields.py: the field's type, bounds,
allowed values and resume policy, checked by one validator) and validated in ``__post_init__`` with a
message that names the field (``ConfigError: model.num_attention_heads=...``). Field names follow Megatron-LM's argument names
where one exists (``tensor_model_parallel_size``, ``num_query_groups``, ``moe_router_topk`` ...).

This package is a leaf: it imports nothing of megatron_gspo but the leaves ``errors`` and ``textfile``
(UTF-8 files read with a bad byte's file and line); every subsystem imports
its section from here (tests/test_imports.py imports each module alone in a fresh interpreter, and checks that
no two packages import each other). The loss section is checked against its loss's spec, which is declared here
(loss_spec.py: what a loss declares; losses.py: the built-in losses' specs, the names a job can give, a plug-in
loaded by its name): algorithms/losses.py holds the formulas, registered under the same names.

    model.py     ModelConfig, the presets, a Hugging Face config.json -> ModelConfig
    sections.py  parallel, loss, generation, optimizer, data, tokenizer, reward, train, checkpoint,
                 rollout_correction, eval
    rollout.py   the rollout section (colocated / async rollouts)
    env.py       the env section (multi-turn, tool-using rollouts)
    job.py       JobConfig (the sections) and load_job_config
    rules.py     the checks across sections (run in order by JobConfig), the lean decoder's limits,
                 where the old policy's log-probs come from (old_logprob_source)
    loss_spec.py what a policy loss declares (LossSpec: ratio kind, clip range and units, aggregation,
                 settings and their bounds) and the check of its settings
    losses.py    the losses a job can name (the built-ins' specs, plug-ins) and a loss section resolved
                 through its spec (loss_settings: checked once, frozen)
    fields.py    knob(): a field's constraints and resume policy; validate(): the one validator
    loader.py    YAML / CLI plumbing: from_dict, overrides, coercion to the annotated types
    checks.py    the validation helpers shared with the loss specs
"""

from megatron_gspo.config.fields import Resume, knob, walk_knobs
from megatron_gspo.config.job import DEMO_CONFIG, JobConfig, load_job_config, split_job_args
from megatron_gspo.config.loader import apply_overrides, from_dict, load_yaml, parse_overrides, to_dict
from megatron_gspo.config.env import ENV_TOOL_FORMATS, TOOL_ERROR_POLICIES, EnvConfig
from megatron_gspo.config.rollout import PARTIAL_ROLLOUT_POLICIES, ROLLOUT_MODES, RolloutConfig
from megatron_gspo.config.rules import LEAN_DECODE_LIMITS, ON_POLICY_RATIO_TOLERANCE, lean_decode_limit, old_logprob_source
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
    LOSS_AGG_MODES,
    OLD_LOGPROB_SOURCES,
    OVERLONG_POLICIES,
    ROLLOUT_CORRECTION_LEVELS,
    ROLLOUT_CORRECTION_MODES,
    ROUTING_REPLAY_MODES,
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
    "ADVANTAGE_ESTIMATOR_NAMES", "DEMO_CONFIG", "LOSS_AGG_MODES", "MODEL_PRESETS",
    "ON_POLICY_RATIO_TOLERANCE", "PRECISIONS", "old_logprob_source", "resolve_precision", "Resume", "knob",
    "walk_knobs", "LEAN_DECODE_LIMITS", "lean_decode_limit",
    "OLD_LOGPROB_SOURCES", "OVERLONG_POLICIES", "ROLLOUT_CORRECTION_LEVELS", "ROLLOUT_CORRECTION_MODES",
    "ROUTING_REPLAY_MODES", "TOKENIZER_TYPES", "CheckpointConfig", "ConfigError",
    "DataConfig", "ENV_TOOL_FORMATS", "EnvConfig", "EvalConfig", "TOOL_ERROR_POLICIES", "GenerationConfig", "JobConfig", "LossConfig", "ModelConfig", "OptimizerConfig",
    "ParallelConfig", "PARTIAL_ROLLOUT_POLICIES", "ROLLOUT_MODES", "RewardConfig", "RolloutConfig", "RolloutCorrectionConfig", "TokenizerConfig", "TrainConfig", "apply_overrides", "from_dict",
    "load_job_config", "load_yaml", "model_config_from_hf", "model_config_from_preset", "parse_overrides",
    "split_job_args", "to_dict",
]
