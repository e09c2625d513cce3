"""The whole job: one dataclass of sections (checked across sections by config/rules.py), and loading it."""

from __future__ import annotations

import os
from dataclasses import dataclass, field, fields
from typing import Optional

from megatron_gspo.config.checks import check
from megatron_gspo.config.loader import (
    apply_overrides,
    from_dict,
    load_yaml,
    looks_like_a_key,
    no_value_message,
    parse_overrides,
)
from megatron_gspo.config.model import ModelConfig, model_config_from_preset
from megatron_gspo.config.env import EnvConfig
from megatron_gspo.config.rollout import RolloutConfig
from megatron_gspo.config.rules import check_job
from megatron_gspo.config.sections import (
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
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)

    def __post_init__(self) -> None:
        check_job(self)  # the rules across sections (config/rules.py), in order

    def check_data_parallel(self, dp: int) -> None:
        """The checks that need the data-parallel size (world / (TP x PP), after parallel.validate_layout):
        the trainer runs them once the process groups exist, and the launcher's --dry-run with
        WORLD_SIZE, so a dry run refuses exactly what the run would."""
        t = self.train
        rows = t.prompts_per_step * self.generation.n_samples_per_prompt
        check(rows % (t.num_minibatches * dp) == 0,
              f"train.prompts_per_step x generation.n_samples_per_prompt = {rows} rollout rows are not divisible "
              f"by train.num_minibatches x the data-parallel size = {t.num_minibatches} x {dp}: every DP rank "
              "holds an equal share of every minibatch")
        check(not (t.sft_steps > 0 and t.sft_batch_size % dp),
              f"train.sft_batch_size={t.sft_batch_size} is not divisible by the data-parallel size {dp}")


# The packaged demo job (GSPO on the tiny MoE and the built-in arithmetic task): what the trainer
# and the launcher's --dry-run load when the command line names no YAML file.
DEMO_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo_gspo.yaml")


def split_job_args(argv: list[str]) -> tuple[str, list[str]]:
    """A trainer command line -> (YAML path, overrides): the first argument is the YAML file when it
    does not start with ``-`` and holds no ``=``; without one, the demo job (DEMO_CONFIG)."""
    argv = list(argv)
    path = argv.pop(0) if argv and not argv[0].startswith("-") and "=" not in argv[0] else None
    return (path or DEMO_CONFIG), argv


# Files a YAML names next to itself (its data), read relative to the YAML's directory so that the job runs from any
# working directory; on the command line they stay relative to the working directory.
YAML_RELATIVE_KEYS = (("env", "sft_source"),)


def _resolve_against(data: dict, path: Optional[str]) -> None:
    """Make the YAML's relative YAML_RELATIVE_KEYS paths absolute, against the YAML file's directory (in place)."""
    if not path:
        return
    for section, key in YAML_RELATIVE_KEYS:
        value = (data.get(section) or {}).get(key) if isinstance(data.get(section), dict) else None
        if isinstance(value, str) and value and not os.path.isabs(value):
            data[section][key] = os.path.join(os.path.dirname(os.path.abspath(path)), value)


def load_job_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> JobConfig:
    """YAML (optional) + ``section.key=value`` overrides -> validated JobConfig."""
    if path and not os.path.isfile(path) and looks_like_a_key(os.path.basename(path)):
        # `train.num_steps` alone was taken for the config file (it comes first and holds no "=")
        section = os.path.basename(path).split(".")[0]
        if section in {f.name for f in fields(JobConfig)}:
            raise ConfigError(no_value_message(os.path.basename(path)))
    data = load_yaml(path) if path else {}
    _resolve_against(data, path)
    data = apply_overrides(data, parse_overrides(list(overrides or [])))
    return from_dict(JobConfig, data)
