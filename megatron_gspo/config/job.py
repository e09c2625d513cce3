"""The whole job: one dataclass of sections, the checks that span sections, and loading it."""

from __future__ import annotations

import difflib
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
from megatron_gspo.config.model import ModelConfig, model_config_from_preset, resolve_precision
from megatron_gspo.config.rollout import RolloutConfig, check_rollout
from megatron_gspo.config.sections import (
    MIN_SAMPLING_TEMPERATURE,
    TOKEN_RATIO_LOSSES,
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

    def __post_init__(self) -> None:
        # Cross-section checks: fail before anything is built (TRL-style).
        t, g = self.train, self.generation
        rollout = t.prompts_per_step * g.n_samples_per_prompt
        check(rollout % t.num_minibatches == 0,
               f"train.prompts_per_step x generation.n_samples_per_prompt = {rollout} responses is not "
               f"divisible by train.num_minibatches={t.num_minibatches}")
        if t.routing_replay != "off":
            check(self.loss.name in TOKEN_RATIO_LOSSES,
                   f"train.routing_replay={t.routing_replay!r} is for the losses with per-token ratios "
                   f"({', '.join(TOKEN_RATIO_LOSSES)}); loss.name={self.loss.name!r} uses GSPO's sequence ratio "
                   "(GSPO needs no routing replay). Set train.routing_replay=off")
        # the warm start learns the reference answers (a built-in task always has them); refused
        # here rather than with a traceback at its first batch
        check(not (t.sft_steps > 0 and self.data.answer_key is None
                   and not self.data.source.startswith(("builtin:", "reasoning_gym:"))),
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
        # every estimator is group-relative (advantages.py: dr_grpo and mean_only subtract the group mean
        # too): a group of one has advantage 0 whatever its reward, and no loss trains on that
        check(g.n_samples_per_prompt >= 2,
              f"generation.n_samples_per_prompt must be >= 2 for group-relative advantages, got "
              f"{g.n_samples_per_prompt}: with train.advantage_estimator={t.advantage_estimator} a group of one "
              "response has advantage r - mean(r) = 0 whatever its reward, so nothing would train")
        # greedy decoding gives every sample of a prompt the same response: every group's rewards are
        # equal and its advantages 0 (evaluation refuses eval.temperature=0 with pass@k likewise)
        check(not (g.temperature == 0 and g.n_samples_per_prompt > 1),
              f"generation.temperature=0 (greedy) with generation.n_samples_per_prompt={g.n_samples_per_prompt}: "
              "every sample of a prompt would be the same response, so every group has equal rewards and zero "
              "advantage and nothing trains; use a temperature > 0 (e.g. 1.0)")
        # the same in all but name, and the loss's log-probs are log-softmax(logits / T): any change of
        # a logit (one optimizer step) moves them 1/T times as much, so the ratios and the KL explode
        check(not 0 < g.temperature < MIN_SAMPLING_TEMPERATURE,
              f"generation.temperature={g.temperature:g} is below {MIN_SAMPLING_TEMPERATURE:g}: sampling at it is "
              "greedy in all but name (the samples of a prompt are the same response: zero advantage), and the "
              f"loss's log-probs, log-softmax(logits / T), move {1 / g.temperature:.3g} times as much as the logits, "
              "so one update makes log-ratios and loss/approx_kl explode; use a temperature >= "
              f"{MIN_SAMPLING_TEMPERATURE:g} (e.g. 1.0)")
        check(not (g.top_k == 1 and g.n_samples_per_prompt > 1),
              f"generation.top_k=1 with generation.n_samples_per_prompt={g.n_samples_per_prompt}: only the most "
              "likely token can be drawn (greedy decoding), so every sample of a prompt would be the same response, "
              "every group has equal rewards and zero advantage and nothing trains; use top_k=0 (off) or >= 2")
        check(not (g.top_p <= 1 / self.model.vocab_size and g.n_samples_per_prompt > 1),
              f"generation.top_p={g.top_p:g} <= 1 / model.vocab_size: the most likely token alone always reaches it "
              "(greedy decoding), so every sample of a prompt would be the same response and every group has zero "
              "advantage; use a larger top_p (1 = off)")
        # overlong filtering masks out responses that reach max_new_tokens without a stop token; these
        # settings make every response one of them, and then no step ever trains anything
        check(not (t.overlong_filtering and g.ignore_eos),
              "train.overlong_filtering=true with generation.ignore_eos=true: every response runs to "
              "generation.max_new_tokens without a stop token, so overlong filtering would mask every response "
              "out of the loss and nothing would train; turn one of them off")
        check(not (t.overlong_filtering and g.min_new_tokens >= g.max_new_tokens),
              f"train.overlong_filtering=true with generation.min_new_tokens={g.min_new_tokens} >= "
              f"generation.max_new_tokens={g.max_new_tokens}: no response can end with a stop token, so overlong "
              "filtering would mask every response out of the loss; lower generation.min_new_tokens")
        if self.parallel.device == "cpu":
            self._check_cpu_device()
        if g.decode_impl == "lean":
            self._check_lean_decode()
        self._check_allow_config_change()
        budget = t.max_tokens_per_micro_batch
        if budget is not None:
            # (under expert parallelism the ranks agree one plan: rollout.agreed_length_profile)
            check(budget >= need, f"train.max_tokens_per_micro_batch={budget} cannot hold one row of up to "
                                  f"data.max_prompt_length + generation.max_new_tokens = {need} tokens")
        check_rollout(self)  # rollout.mode=async against the other sections

    def _check_cpu_device(self) -> None:
        """parallel.device=cpu with a choice only Transformer Engine on a GPU can run: refused here, by key,
        rather than when the model is built on every rank (model.resolve_impl says the same there). TE-spec
        models are built on the CPU only construct-only, by tests (model.build_model), never by a job."""
        m = self.model
        # (te_grouped experts and the fused router are refused for the local spec when the model is built, with
        # their own messages, on any device)
        for key, bad in (("model.transformer_impl", m.transformer_impl == "transformer_engine"),
                         ("model.fp8", m.fp8 is not None)):
            check(not bad, f"{key}={getattr(m, key.split('.')[1])!r} needs Transformer Engine's CUDA kernels, but "
                           "parallel.device='cpu': Transformer Engine does not run on the CPU; use parallel.device=auto "
                           "or cuda on a GPU machine, or the local spec on the CPU (model.transformer_impl=local or auto)")

    def _check_lean_decode(self) -> None:
        """generation.decode_impl=lean runs on one rank of model parallelism, on the local or the
        Transformer Engine spec's weights (decode.lean_decode_unsupported); what the config alone shows
        is refused here, by key, rather than on every rank after the model is built."""
        p, m = self.parallel, self.model
        for key, bad in (
            ("parallel.tensor_model_parallel_size", p.tensor_model_parallel_size),
            ("parallel.pipeline_model_parallel_size", p.pipeline_model_parallel_size),
            ("parallel.expert_model_parallel_size", p.expert_model_parallel_size),
            ("parallel.expert_tensor_parallel_size", p.etp),
        ):
            check(bad == 1, f"generation.decode_impl=lean runs on one rank of tensor / pipeline / expert "
                            f"parallelism only, got {key}={bad}; use generation.decode_impl=auto (lean where it "
                            "can run, megatron's forward elsewhere) or megatron")
        check(not p.sp, "generation.decode_impl=lean does not support sequence parallelism "
                        "(parallel.sequence_parallel=true); use generation.decode_impl=auto or megatron")
        check(m.fp8 is None, f"generation.decode_impl=lean does not support FP8 (model.fp8={m.fp8!r}); "
                             "use generation.decode_impl=auto or megatron")
        check(not m.moe_router_fusion, "generation.decode_impl=lean does not run Transformer Engine's fused router "
                                       "top-k (model.moe_router_fusion=true); use generation.decode_impl=auto or megatron")

    def _check_allow_config_change(self) -> None:
        """checkpoint.allow_config_change names sections or section.key of this job (a typo would
        silently accept nothing)."""
        sections = [f.name for f in fields(self)]
        for entry in self.checkpoint.allow_config_change:
            section, _, key = entry.partition(".")
            if section not in sections:
                raise ConfigError(f"checkpoint.allow_config_change: {entry!r} names no config section; sections: "
                                  f"{sections}")
            if key:
                names = [f.name for f in fields(getattr(self, section))]
                if key not in names:
                    close = difflib.get_close_matches(key, names, n=3)
                    raise ConfigError(f"checkpoint.allow_config_change: unknown config key {entry}"
                                      + (f"; did you mean {[f'{section}.{c}' for c in close]}?" if close else ""))

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
        check(not (t.dynamic_sampling and dp > 1),
              f"train.dynamic_sampling=true needs data-parallel size 1, got {dp}: the kept groups would have to "
              "move between data-parallel ranks (use TP / EP for more GPUs)")


# The packaged demo job (GSPO on the tiny MoE and the built-in arithmetic task): what the trainer
# and the launcher's --dry-run load when the command line names no YAML file.
DEMO_CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs", "demo_gspo.yaml")


def split_job_args(argv: list[str]) -> tuple[str, list[str]]:
    """A trainer command line -> (YAML path, overrides): the first argument is the YAML file when it
    does not start with ``-`` and holds no ``=``; without one, the demo job (DEMO_CONFIG)."""
    argv = list(argv)
    path = argv.pop(0) if argv and not argv[0].startswith("-") and "=" not in argv[0] else None
    return (path or DEMO_CONFIG), argv


# Largest |sequence ratio - 1| the first (on-policy) minibatch may show: 30x inside GSPO's 3e-4 clip
# range. "auto" takes the rollout's log-probs only where rollout and training agree to within it.
ON_POLICY_RATIO_TOLERANCE = 1e-5


def old_logprob_source(cfg: JobConfig, device) -> tuple[bool, str]:
    """The one decision of where the old policy's log-probs come from (train.old_logprobs), for a job
    on ``device``: (recompute?, why, in words for the log).

    The rollout's log-probs come from the decode (a KV-cache forward, other kernel shapes, under TP
    without sequence parallelism): the same policy, other rounding. In fp32 the gap is float noise
    (measured on the CPU: docs/algorithms.md); in bf16 it is 1e-3 to 3e-3 per token (CPU and H100),
    larger than GSPO's 3e-4 clip range, so a fully on-policy minibatch would clip from rounding alone.
    On a GPU fp32 has not been measured, so "auto" recomputes there too."""
    t, m = cfg.train, cfg.model
    if t.old_logprobs != "auto":
        return t.old_logprobs == "recompute", f"train.old_logprobs={t.old_logprobs}"
    if cfg.rollout.is_async:
        return True, ("auto: asynchronous rollouts (rollout.mode=async): the rollout ranks' log-probs are the "
                      "behaviour policy's and they record no routes")
    if t.routing_replay == "R2":
        return True, "auto: routing replay R2 records its routes in the old-log-prob pass"
    if t.dynamic_sampling:
        return True, "auto: dynamic sampling keeps rows of several generation rounds"
    # (model.precision=auto: the Trainer resolved it for its device already; a caller that did not gets the
    # same answer for a device with bf16)
    precision, _ = resolve_precision(m.precision, "cuda" if str(device).startswith("cuda") else "cpu", True)
    if precision != "fp32" or m.fp8:
        return True, (f"auto: in {precision}{' + FP8' if m.fp8 else ''} the decode's rounding differs from the training "
                      "forward's by more than the on-policy tolerance")
    if str(device).startswith("cuda"):
        return True, "auto: fp32 rollout-vs-training agreement is not measured on a GPU"
    return False, "auto: fp32 on the CPU, where rollout and training log-probs agree to float noise"


def load_job_config(path: Optional[str] = None, overrides: Optional[list[str]] = None) -> JobConfig:
    """YAML (optional) + ``section.key=value`` overrides -> validated JobConfig."""
    if path and not os.path.isfile(path) and looks_like_a_key(os.path.basename(path)):
        # `train.num_steps` alone was taken for the config file (it comes first and holds no "=")
        section = os.path.basename(path).split(".")[0]
        if section in {f.name for f in fields(JobConfig)}:
            raise ConfigError(no_value_message(os.path.basename(path)))
    data = load_yaml(path) if path else {}
    data = apply_overrides(data, parse_overrides(list(overrides or [])))
    return from_dict(JobConfig, data)
