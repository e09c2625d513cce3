"""Every section of a job but the model's: plain dataclasses validated in ``__post_init__`` with
messages that name the field. Pure data: nothing here imports a subsystem; the subsystems import
their section from here."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Optional

from megatron_gspo.config.checks import check
from megatron_gspo.config.fields import Resume, knob, validate
from megatron_gspo.errors import ConfigError

# Names the registries must offer (tests/test_config.py checks each registry against its tuple):
# the config validates names without importing the subsystems that implement them. (The loss section names
# no loss: a loss is one spec beside its function, which config/rules.py checks the section against.)
ADVANTAGE_ESTIMATOR_NAMES = ("grpo", "dr_grpo", "mean_only", "maxrl")  # algorithms/advantages.py: ADVANTAGE_ESTIMATORS
TOKENIZER_TYPES = ("builtin", "hf", "sentencepiece")  # tokenizer.build_tokenizer
ROUTING_REPLAY_MODES = ("off", "R2", "R3")  # routing.RoutingPolicy
OLD_LOGPROB_SOURCES = ("auto", "rollout", "recompute")
LOSS_AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm")
OVERLONG_POLICIES = ("drop", "truncate_left", "error")
# rollout_correction.CORRECTIONS: weights (tis, mis, icepop) and sequence masks (geo_mask, seq_logprob_error, opsm)
ROLLOUT_CORRECTION_MODES = ("off", "tis", "mis", "icepop", "geo_mask", "seq_logprob_error", "opsm")
ROLLOUT_CORRECTION_LEVELS = ("token", "sequence")
DEVICES = ("auto", "cuda", "cpu")  # parallel.resolve_device
DECODE_IMPLS = ("auto", "lean", "megatron")  # generation/decoder.py's make_backend
SHARED_PREFIX_SETTINGS = ("auto", "on", "off")  # generation/shared_prefix.py's shared_prefix_pays
TRACKER_NAMES = ("tensorboard", "wandb", "mlflow")  # train.loggers; runtime/trackers builds each

# The most extra generation rounds train.dynamic_sampling_max_rounds may allow in one step. DAPO's
# runs need about 1-3 (verl's recipe caps them at 10); past a few dozen a step that finds no signal
# would only repeat itself for hours (the cap's fill-up then trains on constant groups anyway).
DYNAMIC_SAMPLING_ROUNDS_LIMIT = 32

# The lowest sampling temperature above 0 a job may use (generation.temperature, eval.temperature):
# below it sampling is greedy decoding in all but name, and log-softmax(logits / T) amplifies every
# change of the logits by 1 / T (vLLM clamps temperatures below the same 1e-2 for its numerics).
MIN_SAMPLING_TEMPERATURE = 0.01


@dataclass
class ParallelConfig:
    """Parallel layout (Megatron names). DP is derived: world / (TP x PP)."""

    tensor_model_parallel_size: int = knob(1, resume=Resume.LAYOUT, ge=1)
    pipeline_model_parallel_size: int = knob(1, resume=Resume.LAYOUT, ge=1)
    expert_model_parallel_size: int = knob(1, resume=Resume.LAYOUT, ge=1)
    # None means "same as tensor_model_parallel_size" (Megatron's default).
    expert_tensor_parallel_size: Optional[int] = knob(None, resume=Resume.LAYOUT, ge=1)
    # None means "on whenever TP > 1" (MoE with TP requires it in megatron-core).
    sequence_parallel: Optional[bool] = knob(None, resume=Resume.LAYOUT)
    # megatron's DistributedOptimizer (gradients reduce-scattered, Adam states sharded over DP). None =
    # where it can run and checkpoint (CUDA with Transformer Engine's or apex's fused Adam), else the
    # replicated optimizer; true where it cannot is refused (parallel.resolve_distributed_optimizer).
    use_distributed_optimizer: Optional[bool] = knob(None, resume=Resume.LAYOUT)
    # Minutes before a collective gives up (a dead rank must not hang the others forever).
    distributed_timeout_minutes: float = knob(10.0, resume=Resume.MAY_CHANGE, gt=0)
    seed: int = knob(1234, resume=Resume.MAY_CHANGE)
    # Where the job's model and tensors live: "auto" (this rank's GPU, LOCAL_RANK, when CUDA is
    # available, else the CPU), "cuda" (refused without a GPU) or "cpu" (the portable path, also on a
    # GPU machine). The backend follows: NCCL for cuda, gloo for cpu. Decided once, by
    # parallel.resolve_device; every other module reads ParallelState.device.
    device: str = knob("auto", resume=Resume.REFUSED, choices=DEVICES)

    def __post_init__(self) -> None:
        validate(self, "parallel")

    @property
    def etp(self) -> int:
        return self.expert_tensor_parallel_size or self.tensor_model_parallel_size

    @property
    def sp(self) -> bool:
        return self.tensor_model_parallel_size > 1 if self.sequence_parallel is None else self.sequence_parallel


@dataclass
class LossConfig:
    """The ``loss`` section of a job: which policy loss, and its settings. Which keys a loss reads, their defaults
    and bounds are its spec's (config/losses.py; the table of losses below): a key it does not read is
    refused by name, as is a value out of bounds, in the training precision for those that overflow (checked
    when the job is loaded, config/rules.py, and once more when the job's objective resolves its loss).

    name: a registered loss, "gspo" | "gspo_token" | "grpo" | "sapo" | "cispo" | "gmpo" | "luspo" | "vespo" |
        "dppo_tv" | "dppo_kl", or your own as "package.module:function" / "path/to/file.py:function" (a function
        made by losses.policy_loss).
    clip_ratio_low / clip_ratio_high: the clip range, in the loss's own units (a ratio range [1 - low, 1 + high],
        an importance weight's truncation, a log-ratio range); None picks the loss's default (its paper's).
        A loss without a clip range (sapo) refuses them.
    For dppo_tv / dppo_kl the clip range is DPPO's trust region, delta_low / delta_high: the largest drop / rise
        of a token's probability (dppo_tv: p - p_old; dppo_kl: the binary KL) before the token is masked.
    loss_agg_mode (the losses that take it: grpo, cispo, dppo_tv, dppo_kl): "token-mean" (every response token of the batch weighs
        the same; CISPO's own), "seq-mean-token-mean" (GRPO paper: mean over tokens within a sequence, then
        over sequences), "seq-mean-token-sum-norm" (Dr. GRPO: token sum / loss_agg_norm_constant, then mean over
        sequences). The other losses aggregate as their papers do (per sequence).
    loss_agg_norm_constant: the constant of "seq-mean-token-sum-norm", normally the maximum
        response length; required by that mode and rejected by the others.
    kl_coef: weight of the k3 KL estimator to the reference policy (needs ref_logp).
    dual_clip_c (grpo only): > 1; for A < 0 the objective is bounded below by c * A.
    log_ratio_bound: |log-ratio| cap before exp (see the losses module docstring).
    entropy_coef: weight of the entropy bonus (needs an entropy tensor).
    sapo_tau_pos / sapo_tau_neg (sapo only): temperatures of SAPO's gate for tokens with positive /
        non-positive advantage (paper values 1.0 / 1.05; higher = the gate closes faster as the
        ratio leaves 1).
    vespo_k_pos / vespo_lambda_pos / vespo_k_neg / vespo_lambda_neg (vespo only): the power k and decay lambda of
        VESPO's sequence weight phi(w) = e^lambda w^k e^(-lambda w) for advantages >= 0 / < 0 (paper and TRL
        values 2 / 3 / 3 / 2).
    dppo_kl_tau (dppo_tv / dppo_kl only): weight of the squared log-ratio term, tau (log r)^2 per token
        (Kimi-K2.5's; prime-rl's default loss is DPPO-TV with tau = 1e-3); 0 = DPPO as its paper states it.
    """

    name: str = knob("gspo", resume=Resume.REFUSED)
    clip_ratio_low: Optional[float] = knob(None, resume=Resume.REFUSED)
    clip_ratio_high: Optional[float] = knob(None, resume=Resume.REFUSED)
    loss_agg_mode: str = knob("token-mean", resume=Resume.REFUSED, choices=LOSS_AGG_MODES)
    loss_agg_norm_constant: Optional[float] = knob(None, resume=Resume.REFUSED)
    kl_coef: float = knob(0.0, resume=Resume.REFUSED, ge=0)
    dual_clip_c: Optional[float] = knob(None, resume=Resume.REFUSED, gt=1)
    log_ratio_bound: float = knob(20.0, resume=Resume.REFUSED, gt=0)
    entropy_coef: float = knob(0.0, resume=Resume.REFUSED, ge=0)
    sapo_tau_pos: float = knob(1.0, resume=Resume.REFUSED, gt=0)
    sapo_tau_neg: float = knob(1.05, resume=Resume.REFUSED, gt=0)
    vespo_k_pos: float = knob(2.0, resume=Resume.REFUSED, ge=0)
    vespo_lambda_pos: float = knob(3.0, resume=Resume.REFUSED, gt=0)
    vespo_k_neg: float = knob(3.0, resume=Resume.REFUSED, ge=0)
    vespo_lambda_neg: float = knob(2.0, resume=Resume.REFUSED, gt=0)
    dppo_kl_tau: float = knob(0.0, resume=Resume.REFUSED, ge=0)

    def __post_init__(self) -> None:
        validate(self, "loss")  # each knob's own type and bounds; the loss's spec is read by the job's rules


@dataclass
class GenerationConfig:
    """Sampling settings of a rollout."""

    max_new_tokens: int = knob(256, resume=Resume.REFUSED, ge=1)
    # 0 = greedy (argmax); otherwise logits are divided by it before sampling. A job's rollouts need
    # one >= 0.01 (MIN_SAMPLING_TEMPERATURE: greedy samples give every group zero advantage).
    temperature: float = knob(1.0, resume=Resume.REFUSED, ge=0, hint="(0 = greedy)")
    # Nucleus sampling: keep the smallest set of tokens whose probability reaches top_p (1 = off).
    top_p: float = knob(1.0, resume=Resume.REFUSED, gt=0, le=1, hint="(1 = off)")
    # Keep the top_k most likely tokens (0 = off).
    top_k: int = knob(0, resume=Resume.REFUSED, ge=0, hint="(0 = off)")
    # Samples per prompt (the group size G of GRPO/GSPO): each prompt is repeated G times.
    n_samples_per_prompt: int = knob(4, resume=Resume.REFUSED, ge=1)
    # Base seed of the sampling noise; the trainer mixes it with the step (sampling.counter_uniform
    # keys every draw by seed, sample index and position, never by rank).
    seed: int = knob(1234, resume=Resume.REFUSED, ge=0)
    # A response ends after the first of these tokens (which is kept as its last token).
    stop_token_ids: list[int] = knob(default_factory=list, resume=Resume.REFUSED, ge=0)
    # Token written after a response ends (and fed for finished rows). None: first stop token, or 0.
    pad_token_id: Optional[int] = knob(None, resume=Resume.REFUSED, ge=0)
    # Stop tokens cannot be drawn before this many response tokens (HF's min_new_tokens); the
    # recorded log-probs stay the unrestricted policy's, like top-k / top-p.
    min_new_tokens: int = knob(0, resume=Resume.REFUSED, ge=0)
    # Never end a response at a stop token (vLLM's ignore_eos): every response has max_new_tokens
    # tokens. For throughput measurements; a stop token drawn is kept as an ordinary token.
    ignore_eos: bool = knob(False, resume=Resume.REFUSED)
    # Drop finished rows from the decode batch and its KV cache once at least this share of the batch
    # has finished (0 = never: the static batch decodes until its longest row ends). Results do not
    # depend on it; long-tailed response lengths run faster with it.
    compact_finished_rows: float = knob(0.25, resume=Resume.MAY_CHANGE, ge=0, lt=1, hint="(0 = off)")
    # Continuous batching: decode at most this many rows at once (the KV cache's rows); the step's other
    # rows wait, and a row that ends hands its cache row to the next waiting one, whose prompt's KV (from
    # the one prefill per prompt) is copied in, so the batch stays full while the long tail runs. Each
    # row's tokens and log-probs do not depend on it (the noise is keyed by the row). 0 = every row of
    # the call in one decode batch. Lean decode path only.
    max_batch_rows: int = knob(0, resume=Resume.MAY_CHANGE, ge=0, hint="(0 = all rows)")
    # The forward of prefill and decode steps: "lean" (megatron_gspo/generation/lean_decoder.py: the model's own
    # modules and weights, a KV cache of roped keys, last-position logits only), "megatron"
    # (GPTModel.forward with megatron's StaticInferenceContext), "auto" (lean where it supports
    # the model, i.e. any TP/EP/expert-TP on one pipeline stage, RoPE, no FP8; else megatron). Routing
    # replay's recorders (R2/R3) run on either path. "lean" on a layout it cannot run is refused.
    decode_impl: str = knob("auto", resume=Resume.MAY_CHANGE, choices=DECODE_IMPLS)
    # Check which rows finished (a host sync, and under EP / TP a lockstep all-reduce) every this many
    # generated tokens; rows that finish in between are fed pad tokens until the check (results do not
    # change, at most this many - 1 forwards more). 0 = auto: every token on the CPU (a sync costs
    # nothing there), every 4 on CUDA (docs/performance.md has the
    # measured decode step times).
    finished_check_interval: int = knob(0, resume=Resume.MAY_CHANGE, ge=0, hint="(0 = auto)")
    # Capture the lean decode step once per batch-size bucket with CUDA graphs and replay it (CUDA,
    # decode_impl lean or auto where lean runs). Off by default: the captured step's agreement with
    # the eager one is checked by the preflight on each node first (docs/performance.md has the figures).
    cuda_graphs: bool = knob(False, resume=Resume.MAY_CHANGE)
    # Shared-prefix ("cascade") decode attention in the lean decoder: a prompt's samples read its prompt
    # block's KV once per decode step (one block per prompt, not a copy per sample) and their own generated
    # tokens separately, the two softmaxes merged exactly (megatron_gspo/generation/shared_prefix.py). Tokens
    # equal the plain step's, log-probs to rounding. A multi-turn row's resumed turns (KV kept) read their first
    # turn's prompt once too, where every prompt of the call fits left of the split slot (the leftmost prompt
    # end; equal prompt lengths always do), else plain attention. "auto": on where it pays on the CPU measured
    # (the decode batch's copies of the prompt keys per layer >= 3 MiB: shared_prefix.SHARED_PREFIX_MIN_KEY_BYTES),
    # never with cuda_graphs (its captured shapes cannot follow a call's prompts); "on" / "off" force it.
    shared_prefix_attention: str = knob("auto", resume=Resume.MAY_CHANGE, choices=SHARED_PREFIX_SETTINGS)

    def __post_init__(self) -> None:
        validate(self, "generation")
        check(self.min_new_tokens <= self.max_new_tokens,
              f"generation.min_new_tokens must be an integer in [0, generation.max_new_tokens={self.max_new_tokens}], "
              f"got {self.min_new_tokens!r}")
        check(not (self.cuda_graphs and self.decode_impl == "megatron"),
              "generation.cuda_graphs=true captures the lean decode step; use generation.decode_impl=auto or lean")
        check(not (self.max_batch_rows and self.decode_impl == "megatron"),
              f"generation.max_batch_rows={self.max_batch_rows} refills the lean decoder's batch; use "
              "generation.decode_impl=auto or lean, or max_batch_rows=0")
        check(not (self.shared_prefix_attention == "on" and self.cuda_graphs),
              "generation.shared_prefix_attention=on with generation.cuda_graphs=true: a captured decode step cannot "
              "follow a call's prompt count; use shared_prefix_attention=auto or off")
        check(not (self.shared_prefix_attention == "on" and self.decode_impl == "megatron"),
              "generation.shared_prefix_attention=on is the lean decoder's decode attention; use "
              "generation.decode_impl=auto or lean, or shared_prefix_attention=auto")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def pad_id(self) -> int:
        if self.pad_token_id is not None:
            return self.pad_token_id
        return self.stop_token_ids[0] if self.stop_token_ids else 0


@dataclass
class OptimizerConfig:
    """Adam + warmup/decay schedule (Megatron-LM argument names)."""

    optimizer: str = knob("adam", resume=Resume.REFUSED, choices=("adam", "sgd"))
    lr: float = knob(1e-6, resume=Resume.REFUSED, gt=0)
    min_lr: float = knob(0.0, resume=Resume.REFUSED, ge=0)
    lr_warmup_steps: int = knob(0, resume=Resume.REFUSED, ge=0)
    # None: decay over all optimizer steps of the run (train.num_steps x train.num_minibatches).
    lr_decay_steps: Optional[int] = knob(None, resume=Resume.REFUSED)
    lr_decay_style: str = knob("constant", resume=Resume.REFUSED,
                               choices=("constant", "linear", "cosine", "inverse-square-root"))
    weight_decay: float = knob(0.01, resume=Resume.REFUSED)
    adam_beta1: float = knob(0.9, resume=Resume.REFUSED, ge=0, lt=1)
    adam_beta2: float = knob(0.999, resume=Resume.REFUSED, ge=0, lt=1)
    adam_eps: float = knob(1e-8, resume=Resume.REFUSED)
    clip_grad: float = knob(1.0, resume=Resume.REFUSED, ge=0, hint="(0 disables)")

    def __post_init__(self) -> None:
        validate(self, "optimizer")
        if not self.min_lr <= self.lr:
            raise ConfigError(f"optimizer.min_lr={self.min_lr} must be in [0, optimizer.lr={self.lr}]")


@dataclass
class DataConfig:
    """``data:`` section of a job.

    source: ``builtin:arithmetic`` / ``builtin:sort`` (generated from ``seed``, see
        :mod:`megatron_gspo.data.tasks`), ``reasoning_gym:<task>`` (a reasoning-gym task, generated from
        ``seed``, needs ``pip install -e .[tasks]``: :mod:`megatron_gspo.data.reasoning_gym_tasks`) or a path
        to a ``.jsonl`` or ``.parquet`` file.
    prompt_key / answer_key: field names in each record; a dotted name (``reward_model.ground_truth``)
        reaches into nested objects. ``answer_key: null`` for answer-free data (e.g. a format-only reward).
        A prompt is a string, or a list of chat messages (``[{"role": ..., "content": ...}]``), which
        needs ``apply_chat_template``.
    shuffle / seed: each epoch is a fresh permutation drawn from ``(seed, epoch)``.
    max_prompt_length / overlong_prompt_policy: token budget of a prompt and what to do past it
        (the trainer counts dropped and truncated prompts in ``data/dropped_prompts`` /
        ``data/truncated_prompts`` and logs a line in every step that has any).
    apply_chat_template: render prompts with the tokenizer's chat template (a string prompt becomes
        one user message); ``chat_template_kwargs`` reach the template (Qwen3: ``enable_thinking``).
    add_special_tokens: without a chat template, let the tokenizer add its BOS (the built-in
        tokenizer's ``<bos>``, Llama's ``<s>``; Qwen3 adds none).
    task_kwargs: the settings of a ``reasoning_gym:<task>`` source, the fields of that task's
        reasoning-gym config (``{min_terms: 2, max_terms: 2, max_digits: 1}`` for chain_sum); unknown
        keys are refused by name. Its seed is ``data.seed``.
    task_*: knobs of the built-in tasks; ``task_num_examples`` is the length of one epoch of a task
        (built-in or reasoning-gym).
    cache_dir: where the reasoning-gym examples made at start-up (the reference answers' check, the
        held-out set) are kept, one file per task, settings, seed, count and reasoning-gym version, so that
        a requeued or repeated job reads them back instead of making them again; null:
        ``<train.output_dir>/data_cache``.
    """

    source: str = knob("builtin:arithmetic", resume=Resume.REFUSED)
    prompt_key: str = knob("prompt", resume=Resume.REFUSED)
    answer_key: Optional[str] = knob("answer", resume=Resume.REFUSED)
    shuffle: bool = knob(True, resume=Resume.REFUSED)
    seed: int = knob(1234, resume=Resume.REFUSED)
    max_prompt_length: int = knob(64, resume=Resume.REFUSED, gt=0)
    overlong_prompt_policy: str = knob("drop", resume=Resume.REFUSED, choices=OVERLONG_POLICIES)
    apply_chat_template: bool = knob(False, resume=Resume.REFUSED)
    chat_template_kwargs: dict = knob(default_factory=dict, resume=Resume.REFUSED)
    add_special_tokens: bool = knob(True, resume=Resume.REFUSED)
    task_num_examples: int = knob(100_000, resume=Resume.REFUSED, gt=0)
    task_num_digits: int = knob(2, resume=Resume.REFUSED, gt=0)
    task_operators: str = knob("+", resume=Resume.REFUSED)
    task_sort_min_len: int = knob(3, resume=Resume.REFUSED)
    task_sort_max_len: int = knob(5, resume=Resume.REFUSED)
    task_sort_max_value: int = knob(9, resume=Resume.REFUSED)
    task_kwargs: dict = knob(default_factory=dict, resume=Resume.REFUSED)
    cache_dir: Optional[str] = knob(None, resume=Resume.MAY_CHANGE)

    def __post_init__(self) -> None:
        validate(self, "data")
        if not self.source:
            raise ConfigError("data.source is empty; use builtin:arithmetic, builtin:sort or a .jsonl/.parquet path")
        if not self.prompt_key:
            raise ConfigError("data.prompt_key is empty")
        check(not self.task_kwargs or self.source.startswith("reasoning_gym:"),
              f"data.task_kwargs={self.task_kwargs!r} configures a reasoning_gym:<task> source, but data.source="
              f"{self.source!r} (the built-in tasks take data.task_* keys)")


@dataclass
class TokenizerConfig:
    """``tokenizer:`` section of a job.

    type: "builtin" (:class:`CharTokenizer`, for the built-in tasks and the tiny model),
        "hf" (a Hugging Face tokenizer directory or ``tokenizer.json``) or
        "sentencepiece" (a ``.model`` file).
    path: the directory or file for "hf"/"sentencepiece"; unused for "builtin".
    chat_template: optional Jinja chat template (inline text, or a path to a ``.jinja`` file) that
        overrides the tokenizer's own, e.g. to give a base checkpoint or SentencePiece model one.
    """

    type: str = knob("builtin", resume=Resume.REFUSED, choices=TOKENIZER_TYPES)
    path: Optional[str] = knob(None, resume=Resume.REFUSED)
    chat_template: Optional[str] = knob(None, resume=Resume.REFUSED)

    def __post_init__(self) -> None:
        validate(self, "tokenizer")
        if self.type != "builtin" and not self.path:
            raise ConfigError(f"tokenizer.type={self.type!r} needs tokenizer.path (a file or directory)")


@dataclass
class RewardConfig:
    """``reward:`` section of a job.

    name: a registered reward (exact_match, digit_match, math, reasoning_gym, format) or your own as
        ``package.module:function`` / ``path/to/file.py:function`` (a function or a class: see
        megatron_gspo/data/rewards/registry.py).
    kwargs: the reward's settings, checked by key at start-up against what it declares (a typo or a value
        out of bounds is refused naming the key): math takes ``timeout_s`` (CPU seconds per side of a
        check, default 10) and ``wall_timeout_s`` (default 600); exact_match, digit_match and
        reasoning_gym take ``stop`` (extra stop strings).
    format_weight: when > 0, adds ``format_weight * format(...)`` (with ``format_kwargs``: ``require``,
        ``stop``) to it.
    num_workers: processes that score in parallel (verl's ``reward.num_workers``): a per-sample plug-in or
        reasoning_gym runs in that many worker processes when > 1, math checks in that many math-verify
        processes; exact_match, digit_match and format (microseconds a row) always score in the trainer's
        process. The rewards are the same, in row order, whatever the number; each rank has its own.
    overlong_buffer_len: DAPO's soft overlong punishment (arXiv 2503.14476 eq. 13) over the last
        ``overlong_buffer_len`` tokens before ``generation.max_new_tokens``: a response of |y| tokens
        gets ``overlong_penalty_factor * min(0, (max_new_tokens - overlong_buffer_len - |y|) /
        overlong_buffer_len)`` added to its reward (-factor for a response cut at the limit). 0 = off.
    overlong_penalty_factor: the largest penalty (reached at ``generation.max_new_tokens`` tokens).
    max_unreadable_reference_frac: for a reward that checks reference answers (``math``: a
        ``... #### x`` or ``\\boxed{x}`` answer, a number or a math expression), the largest share of the
        training data's references it cannot read before the run is refused at start-up (a prompt with
        such a reference always scores 0). Any unreadable one is counted and reported before training;
        1 only reports.
    """

    name: str = knob("exact_match", resume=Resume.REFUSED)
    kwargs: dict = knob(default_factory=dict, resume=Resume.REFUSED)
    format_weight: float = knob(0.0, resume=Resume.REFUSED, ge=0)
    format_kwargs: dict = knob(default_factory=dict, resume=Resume.REFUSED)
    num_workers: int = knob(1, resume=Resume.MAY_CHANGE, ge=1, hint="(1 = one row at a time)")
    overlong_buffer_len: int = knob(0, resume=Resume.REFUSED, ge=0, hint="(0 = off)")
    overlong_penalty_factor: float = knob(1.0, resume=Resume.REFUSED, ge=0)
    max_unreadable_reference_frac: float = knob(0.05, resume=Resume.REFUSED, ge=0, le=1)

    def __post_init__(self) -> None:
        validate(self, "reward")
        if not self.name:
            raise ConfigError("reward.name is empty; name a registered reward (exact_match, digit_match, math, "
                              "format, ...) or your own as 'package.module:function'")


@dataclass
class TrainConfig:
    """The RL loop: P prompts x G samples per step, split into minibatches (one optimizer step each)."""

    num_steps: int = knob(40, resume=Resume.MAY_CHANGE, ge=1)
    prompts_per_step: int = knob(16, resume=Resume.REFUSED, ge=1)
    # Optimizer steps per rollout: the rollout is split into this many minibatches, so the
    # later ones are trained off-policy (ratios really leave 1).
    num_minibatches: int = knob(2, resume=Resume.REFUSED, ge=1)
    # Sequences per forward/backward (gradient accumulation inside a minibatch).
    micro_batch_size: int = knob(16, resume=Resume.MAY_CHANGE, ge=1)
    # Rows are grouped by length into micro-batches (sorted within each minibatch) and every
    # micro-batch is only as wide as its longest row: padding costs no compute. With a token budget a
    # micro-batch holds as many rows as keep rows x width <= budget (micro_batch_size then unused);
    # null: micro_batch_size rows. (verl's use_dynamic_bsz + ppo_max_token_len_per_gpu.)
    max_tokens_per_micro_batch: Optional[int] = knob(None, resume=Resume.MAY_CHANGE, gt=0)
    # The old policy's log-probs: "recompute" (a forward pass of the training model over the batch:
    # the first minibatch's ratios are then exactly 1, whatever the precision), "rollout" (the
    # sampling log-probs, one forward pass saved; they carry the decode's rounding, which in bf16 is
    # larger than GSPO's clip range) or "auto", resolved in one place (config/rules.py:
    # old_logprob_source): rollout only where the two agree to float noise (fp32 on the CPU, measured),
    # recompute everywhere else, with dynamic sampling, and whenever routing replay R2 or asynchronous
    # rollouts need the pass ("rollout" with one of those two is refused).
    old_logprobs: str = knob("auto", resume=Resume.REFUSED, choices=OLD_LOGPROB_SOURCES)
    advantage_estimator: str = knob("grpo", resume=Resume.REFUSED, choices=ADVANTAGE_ESTIMATOR_NAMES)
    # MoE routing replay for the GRPO baseline: off | R2 (old-log-prob pass) | R3 (rollout).
    routing_replay: str = knob("off", resume=Resume.REFUSED, choices=ROUTING_REPLAY_MODES)
    # DAPO dynamic sampling (arXiv 2503.14476 §3.2): drop the groups whose rewards are all equal (zero
    # advantage, no signal) and generate more prompts until the step holds train.prompts_per_step
    # informative groups, decided over every data-parallel rank's rows (the kept rows then move to the
    # ranks they are dealt to, with their routes: rollout/exchange.py).
    dynamic_sampling: bool = knob(False, resume=Resume.REFUSED)
    # The most extra generation rounds a step may run for dynamic sampling (at most 32:
    # DYNAMIC_SAMPLING_ROUNDS_LIMIT); past it the step trains on the informative groups it has, filled
    # up with constant (zero-advantage) groups, and says so. Each extra round is logged.
    dynamic_sampling_max_rounds: int = knob(
        4, resume=Resume.REFUSED, ge=0, le=DYNAMIC_SAMPLING_ROUNDS_LIMIT,
        hint="(every round generates train.prompts_per_step x generation.n_samples_per_prompt more responses within "
             "one step)")
    # Data parallelism: each minibatch's rows are dealt to the DP ranks by token count (equal row counts,
    # Karmarkar-Karp's partition of the lengths; verl's trainer.balance_batch), after generation, so that
    # no rank's long responses hold up the update; false: each rank trains the rows it generated (dynamic
    # sampling still moves the kept rows). Only how the same sums are split: float rounding at most.
    balance_batch: bool = knob(True, resume=Resume.MAY_CHANGE)
    # Overlong filtering (DAPO §3.4): responses cut at generation.max_new_tokens (no stop token) are
    # masked out of the loss: a truncated answer is not evidence that its reasoning was wrong.
    overlong_filtering: bool = knob(False, resume=Resume.REFUSED)
    # Supervised warm start on the task's reference answers before RL (0 = none).
    sft_steps: int = knob(0, resume=Resume.MAY_CHANGE, ge=0)
    sft_lr: float = knob(1e-3, resume=Resume.MAY_CHANGE_AFTER_WARM_START)
    sft_batch_size: int = knob(32, resume=Resume.MAY_CHANGE_AFTER_WARM_START)
    # Non-finite loss / gradients skip the update on every rank; this many in a row stop the run.
    max_consecutive_skips: int = knob(5, resume=Resume.MAY_CHANGE, ge=1)
    output_dir: str = knob("runs/gspo", resume=Resume.MAY_CHANGE)
    # Where the step's scalars go besides metrics.jsonl (rank 0; runtime/trackers/): `tensorboard`
    # (`{output_dir}/tensorboard/`), `wandb` (Weights & Biases), `mlflow`; verl's trainer.logger, TRL's
    # report_to. wandb and mlflow are imported only when named (`pip install wandb` / `mlflow`, or the
    # `trackers` extra); each gets TensorBoard's scalars at the same steps and the job's config once, and a
    # resumed run continues the same wandb / MLflow run (its id is kept in the checkpoint). A tracker that
    # fails (no network, a bad key) is said in one line and off for the rest of the run; training goes on.
    loggers: list[str] = knob(default_factory=lambda: ["tensorboard"], resume=Resume.MAY_CHANGE)
    # TensorBoard's scalars and histograms, when train.loggers names it; false: none, whatever train.loggers
    # says (the older switch, kept for the command lines that use it). metrics.jsonl is always written.
    tensorboard: bool = knob(True, resume=Resume.MAY_CHANGE)
    # The W&B project of the run (Megatron-LM's --wandb-project).
    wandb_project: str = knob("megatron-gspo", resume=Resume.MAY_CHANGE)
    # The W&B run's display name (Megatron-LM's --wandb-exp-name; null: W&B picks one).
    wandb_exp_name: Optional[str] = knob(None, resume=Resume.MAY_CHANGE)
    # Where wandb writes its files, `<dir>/wandb/` (Megatron-LM's --wandb-save-dir; null: train.output_dir).
    # An offline run (WANDB_MODE=offline) stays there for `wandb sync`.
    wandb_save_dir: Optional[str] = knob(None, resume=Resume.MAY_CHANGE)
    # The W&B team or user the run belongs to (null: the API key's default entity).
    wandb_entity: Optional[str] = knob(None, resume=Resume.MAY_CHANGE)
    # The MLflow tracking server or store (null: MLflow's default, $MLFLOW_TRACKING_URI).
    mlflow_tracking_uri: Optional[str] = knob(None, resume=Resume.MAY_CHANGE)
    # The MLflow experiment of the run (created when missing).
    mlflow_experiment: str = knob("megatron-gspo", resume=Resume.MAY_CHANGE)
    # The MLflow run's name (null: MLflow picks one).
    mlflow_run_name: Optional[str] = knob(None, resume=Resume.MAY_CHANGE)
    log_interval: int = knob(1, resume=Resume.MAY_CHANGE, ge=1)
    seed: int = knob(1234, resume=Resume.REFUSED)
    # Deterministic kernels, cuBLAS workspace, NCCL algorithm and megatron's deterministic mode
    # (megatron_gspo/runtime/determinism.py): the same bits from the same inputs on a GPU too (evaluation on
    # or off, a resumed run against an uninterrupted one), at some speed. The CPU path is deterministic
    # without it.
    deterministic: bool = knob(False, resume=Resume.REFUSED)
    # Write every step's rollout rows to {output_dir}/rollouts/step_XXXXXX.jsonl (rank 0): token ids, loss mask,
    # the turns as spans over the ids, tool calls with their arguments, results and errors, the reward.
    dump_rollouts: bool = knob(False, resume=Resume.MAY_CHANGE)

    def __post_init__(self) -> None:
        validate(self, "train")
        unknown = [n for n in self.loggers if n not in TRACKER_NAMES]
        check(not unknown, f"train.loggers={self.loggers!r}: {', '.join(map(repr, unknown))} is not one of "
                           f"{list(TRACKER_NAMES)}")
        check(len(set(self.loggers)) == len(self.loggers), f"train.loggers={self.loggers!r} names a logger twice")
        # R2's routes need the old-log-prob pass (rows kept by dynamic sampling carry their own rollout
        # routes in the record, so R3 and the rollout log-probs work with it)
        check(not (self.old_logprobs == "rollout" and self.routing_replay == "R2"),
              "train.old_logprobs='rollout' skips the old-log-prob pass, where routing replay R2 records its routes; "
              "use train.old_logprobs=recompute (or auto) with train.routing_replay=R2, or R3")

    @property
    def trackers(self) -> list[str]:
        """The loggers this job writes to: train.loggers, less tensorboard when train.tensorboard=false."""
        return [n for n in self.loggers if n != "tensorboard" or self.tensorboard]


@dataclass
class CheckpointConfig:
    """Megatron-LM names: save / save_interval / load. ``resume`` continues from save's latest."""

    save: Optional[str] = knob(None, resume=Resume.MAY_CHANGE)
    save_interval: int = knob(0, resume=Resume.MAY_CHANGE, ge=0)
    load: Optional[str] = knob(None, resume=Resume.MAY_CHANGE)
    resume: bool = knob(False, resume=Resume.MAY_CHANGE)
    keep_last: int = knob(0, resume=Resume.MAY_CHANGE, ge=0)
    # Keys ("section.key") or whole sections whose change since the checkpoint was written a resume
    # accepts although it changes the training trajectory (e.g. [optimizer.lr]). A resume compares
    # the job with the checkpoint's config (checkpoint/config_change.py): keys that only steer
    # logging, saving, evaluation, the layout or speed may change and are logged; any other change
    # is refused by name unless listed here. checkpoint.load (initial weights) compares the model keys
    # its weights are bound to (vocabulary, positions, rotary base, ...) the same way.
    allow_config_change: list[str] = knob(default_factory=list, resume=Resume.MAY_CHANGE)
    # Take checkpoint.save's lock (save.lock) even from a job that may still be running (another host's,
    # within its 10-minute lease): for a person who knows that job is gone (its node failed) and will not
    # wait for its lease to run out. A warning names the holder; two live jobs saving into one root
    # overwrite each other's checkpoints.
    force_unlock: bool = knob(False, resume=Resume.MAY_CHANGE)

    def __post_init__(self) -> None:
        validate(self, "checkpoint")
        check(all(self.allow_config_change),
              f"checkpoint.allow_config_change must be a list of config keys (section.key) or sections, "
              f"got {self.allow_config_change!r}")
        check(not (self.resume and not (self.save or self.load)),
               "checkpoint.resume=true needs checkpoint.save (or checkpoint.load) to find a checkpoint in")


@dataclass
class RolloutCorrectionConfig:
    """Importance sampling or masking between the rollout (behaviour) policy and the training one
    (rollout_correction.py; docs/algorithms.md has each mode's formula and source).

    mode: "off"; importance weights of rho = pi_old / pi_rollout: "tis" (truncated IS: weight min(rho, threshold),
        Yao et al. 2025), "mis" (masked IS: weight rho inside [threshold_low, threshold], 0 outside, as verl's
        rollout_is mask mode / slime), "icepop" (IcePop: per-token masked IS in [icepop_low, icepop_high]); or
        sequence masks (weight 1 or 0 per response): "geo_mask" (SkyRL: the geometric mean of rho per response
        inside [geo_mask_low, geo_mask_high]), "seq_logprob_error" (NeMo-RL: mean_t exp|log rho_t| at most
        seq_logprob_error_threshold), "opsm" (DeepSeek-V3.2's off-policy sequence mask, TRL's
        off_policy_mask_threshold: drop a response with negative advantage whose mean log(pi_rollout / pi_theta)
        exceeds off_policy_mask_threshold; pi_theta is the policy being trained, so it acts even where pi_old is
        the rollout's). With train.old_logprobs=rollout rho is 1 and every mode but opsm is a no-op.
    A key of a mode other than the job's is refused by name, as is level with a mode it does not apply to.
    """

    mode: str = knob("off", resume=Resume.REFUSED, choices=ROLLOUT_CORRECTION_MODES)
    # tis / mis: "token", one rho per response token; "sequence", one per response, the product of its tokens'.
    level: str = knob("token", resume=Resume.REFUSED, choices=ROLLOUT_CORRECTION_LEVELS)
    # Upper threshold C of rho (TIS truncates at it, MIS masks above it); also the bound of the
    # rollout/mismatch_ratio_out_frac metric.
    threshold: float = knob(2.0, resume=Resume.REFUSED, gt=1)
    # MIS lower threshold (rho below it is masked); null = 1 / threshold.
    threshold_low: Optional[float] = knob(None, resume=Resume.REFUSED, ge=0, lt=1)
    # IcePop's band [alpha, beta] of the token ratio (Ring-1T, arXiv 2510.18855: 0.5 / 5).
    icepop_low: float = knob(0.5, resume=Resume.REFUSED, ge=0, lt=1)
    # IcePop's upper end beta (rho above it is masked).
    icepop_high: float = knob(5.0, resume=Resume.REFUSED, gt=1)
    # SkyRL's geometric sequence mask band (its defaults 0.99 / 1.01).
    geo_mask_low: float = knob(0.99, resume=Resume.REFUSED, gt=0, lt=1)
    # Its upper end (a geometric-mean rho above it masks the response).
    geo_mask_high: float = knob(1.01, resume=Resume.REFUSED, gt=1)
    # NeMo-RL's seq_logprob_error_threshold (its example 1.5; the error is >= 1, 1 = identical log-probs).
    seq_logprob_error_threshold: float = knob(1.5, resume=Resume.REFUSED, gt=1)
    # DeepSeek-V3.2's delta (TRL's off_policy_mask_threshold; TRL's example 0.5), in nats per token.
    off_policy_mask_threshold: float = knob(0.5, resume=Resume.REFUSED, gt=0)

    def __post_init__(self) -> None:
        validate(self, "rollout_correction")
        defaults = {f.name: f.default for f in dataclasses.fields(self)}
        for key, modes in ROLLOUT_CORRECTION_KEYS.items():
            value = getattr(self, key)
            check(value == defaults[key] or self.mode in modes,
                  f"rollout_correction.{key}={value} applies to rollout_correction.mode in {list(modes)} only, got "
                  f"mode={self.mode!r}")

    @property
    def bounds(self) -> tuple[float, float]:
        """(low, high) thresholds of rho, low resolved (tis / mis; the mismatch metrics' band)."""
        return (1.0 / self.threshold if self.threshold_low is None else self.threshold_low), self.threshold

    @property
    def mode_bounds(self) -> tuple[float, float]:
        """(low, high) of the job's mode, in its own units (rollout_correction.correction_weights): rho's band
        (tis, mis, icepop), the geometric mean's band (geo_mask), (1, the error threshold) for seq_logprob_error,
        (0, delta) for opsm."""
        return {
            "icepop": (self.icepop_low, self.icepop_high),
            "geo_mask": (self.geo_mask_low, self.geo_mask_high),
            "seq_logprob_error": (1.0, self.seq_logprob_error_threshold),
            "opsm": (0.0, self.off_policy_mask_threshold),
        }.get(self.mode, self.bounds)


# rollout_correction keys read by some modes only: refused with any other mode (RolloutCorrectionConfig)
ROLLOUT_CORRECTION_KEYS = {
    # (accepted with off too, as before the masks existed: a job may keep them while correction is off)
    "level": ("off", "tis", "mis"),
    "threshold_low": ("off", "tis", "mis"),
    "icepop_low": ("icepop",), "icepop_high": ("icepop",),
    "geo_mask_low": ("geo_mask",), "geo_mask_high": ("geo_mask",),
    "seq_logprob_error_threshold": ("seq_logprob_error",),
    "off_policy_mask_threshold": ("opsm",),
}


@dataclass
class EvalConfig:
    """Held-out evaluation during training (evaluation.py): greedy accuracy, pass@k, response length."""

    # Evaluate every this many RL steps and after the last one (0 = never).
    interval: int = knob(0, resume=Resume.MAY_CHANGE, ge=0)
    # Held-out prompts: a .jsonl / .parquet file (read with data.prompt_key / data.answer_key), a
    # builtin:<task> / reasoning_gym:<task> (data.source's own task: its examples past the training epoch;
    # another task: its first ones), or null for a split of data.source: a task's examples just past its
    # training epoch (indices data.task_num_examples, ...), a file's last eval.num_prompts records (which
    # training then never sees). Those that are training prompts too are counted at start-up, and said.
    source: Optional[str] = knob(None, resume=Resume.MAY_CHANGE)
    # The settings of a reasoning_gym:<task> eval.source (that task's reasoning-gym config fields), its
    # own, not data.task_kwargs; null: data.task_kwargs when eval.source is data.source's task, else the
    # task's defaults.
    task_kwargs: Optional[dict] = knob(None, resume=Resume.MAY_CHANGE)
    # Held-out prompts per evaluation (the first ones of the source).
    num_prompts: int = knob(64, resume=Resume.MAY_CHANGE, ge=1)
    # Samples per prompt for pass@k (n of the unbiased estimator, >= eval.k; 0 = greedy only).
    num_samples: int = knob(8, resume=Resume.MAY_CHANGE, ge=0)
    # k of pass@k.
    k: int = knob(4, resume=Resume.MAY_CHANGE, ge=1)
    # Sampling temperature of the pass@k samples (the accuracy is always greedy); >= 0.01.
    temperature: float = knob(1.0, resume=Resume.MAY_CHANGE, gt=0)
    # Seed of the pass@k samples' noise, apart from generation.seed: evaluation never moves the
    # training rollouts' noise.
    seed: int = knob(4242, resume=Resume.MAY_CHANGE, ge=0)

    def __post_init__(self) -> None:
        validate(self, "eval")
        check(self.num_samples == 0 or self.num_samples >= self.k,
              f"eval.num_samples={self.num_samples} must be >= eval.k={self.k} (or 0: greedy only)")
        check(self.num_samples == 0 or self.temperature >= MIN_SAMPLING_TEMPERATURE,
              f"eval.temperature={self.temperature:g} is below {MIN_SAMPLING_TEMPERATURE:g}: the pass@k samples would "
              "all be the greedy response (pass@k = the greedy accuracy, measured already); use a temperature >= "
              f"{MIN_SAMPLING_TEMPERATURE:g} (e.g. 1.0), or eval.num_samples=0 for greedy accuracy only")
        check(self.source is None or self.source != "",
              f"eval.source must be a file path, a builtin:<task> or null, got {self.source!r}")
        check(self.task_kwargs is None or (self.source or "").startswith("reasoning_gym:"),
              f"eval.task_kwargs={self.task_kwargs!r} configures a reasoning_gym:<task> eval.source, but eval.source="
              f"{self.source!r}")
