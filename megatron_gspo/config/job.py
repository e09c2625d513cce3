"""The whole job: one dataclass of sections, the checks that span sections, and loading it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from megatron_gspo.config.checks import check
from megatron_gspo.config.loader import apply_overrides, from_dict, load_yaml, parse_overrides
from megatron_gspo.config.model import ModelConfig, model_config_from_preset
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

    def __post_init__(self) -> None:
        # Cross-section checks: fail before anything is built (TRL-style).
        t, g = self.train, self.generation
        rollout = t.prompts_per_step * g.n_samples_per_prompt
        check(rollout % t.num_minibatches == 0,
               f"train.prompts_per_step x generation.n_samples_per_prompt = {rollout} responses is not "
               f"divisible by train.num_minibatches={t.num_minibatches}")
        if t.routing_replay != "off":
            check(self.loss.name == "grpo",
                   f"train.routing_replay={t.routing_replay!r} is the GRPO baseline's fix; loss.name="
                   f"{self.loss.name!r} (GSPO needs no routing replay). Set train.routing_replay=off")
        if t.advantage_estimator in ("grpo",) and g.n_samples_per_prompt < 2:
            raise ConfigError("generation.n_samples_per_prompt must be >= 2 for group-relative advantages")
        # the warm start learns the reference answers (a built-in task always has them); refused
        # here rather than with a traceback at its first batch
        check(not (t.sft_steps > 0 and self.data.answer_key is None and not self.data.source.startswith("builtin:")),
               f"train.sft_steps={t.sft_steps} (supervised warm start) needs reference answers, but "
               "data.answer_key is null; set train.sft_steps=0 for data without answers")
        # The RL loop has no pipeline schedule (forward_backward_func) yet: refuse PP up front.
        check(self.parallel.pipeline_model_parallel_size == 1,
               f"parallel.pipeline_model_parallel_size={self.parallel.pipeline_model_parallel_size}: the RL "
               "trainer supports PP=1 only (use TP/EP/DP; model building and checkpoints support PP)")
        need = self.data.max_prompt_length + g.max_new_tokens
        check(need <= self.model.max_position_embeddings,
               f"data.max_prompt_length + generation.max_new_tokens = {need} exceeds "
               f"model.max_position_embeddings={self.model.max_position_embeddings}")
        check(self.reward.overlong_buffer_len <= g.max_new_tokens,
              f"reward.overlong_buffer_len={self.reward.overlong_buffer_len} exceeds generation.max_new_tokens="
              f"{g.max_new_tokens}: the penalty stretch is the last tokens before that limit")
        check(not (t.dynamic_sampling and g.n_samples_per_prompt < 2),
              "train.dynamic_sampling=true needs generation.n_samples_per_prompt >= 2: a group of one response "
              "always has equal rewards and would always be dropped")
        budget = t.max_tokens_per_micro_batch
        if budget is not None:
            # (under expert parallelism the ranks agree one plan: rollout.agreed_length_profile)
            check(budget >= need, f"train.max_tokens_per_micro_batch={budget} cannot hold one row of up to "
                                  f"data.max_prompt_length + generation.max_new_tokens = {need} tokens")


def load_job_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> JobConfig:
    """YAML (optional) + ``section.key=value`` overrides -> validated JobConfig."""
    data = load_yaml(path) if path else {}
    data = apply_overrides(data, parse_overrides(list(overrides or [])))
    return from_dict(JobConfig, data)
