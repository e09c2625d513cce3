"""The rules that span sections of a job, in one place: small named functions over the JobConfig, run in
order (``RULES``) by ``JobConfig.__post_init__``, so a job that cannot work is refused by key before
anything is built (TRL-style). A single field's type and range are declared with the field
(config/fields.py); a rule within one section stays with that section's ``__post_init__``. The loss
section's check against its loss's spec (config/losses.py) is the first rule here instead: the sections stay
plain data.

Also here, because they are pure functions of the job:

* ``LEAN_DECODE_LIMITS``: what the lean decoder (generation/lean_decoder.py) cannot run, once: the rows
  with a config key are refused here for ``generation.decode_impl=lean``; lean_decode_unsupported checks
  the rows with a TransformerConfig attribute against a built model (``lean_decode_limit``), plus what
  only the built modules show;
* ``old_logprob_source``: where the old policy's log-probs come from (``train.old_logprobs`` resolved for
  a device). The refusals of old-log-prob combinations are ``TrainConfig``'s (dynamic sampling, R2) and
  ``old_logprobs_under_async`` below.

The checks that need the data-parallel size run later (``JobConfig.check_data_parallel``).
"""

from __future__ import annotations

import difflib
from dataclasses import dataclass, fields
from typing import Any, Callable, Optional

from megatron_gspo.config.checks import check
from megatron_gspo.config.loss_spec import TOKEN, numerics_of
from megatron_gspo.config.losses import check_loss_config, loss_spec, losses_where
from megatron_gspo.config.model import resolve_precision
from megatron_gspo.config.sections import MIN_SAMPLING_TEMPERATURE
from megatron_gspo.errors import ConfigError


def row_token_budget(job) -> int:
    """Tokens a row may hold: its prompt and one response, or with an environment the whole conversation after the
    prompt (env.max_response_tokens: every turn and observation). Less one, the KV slots a generation of the job
    needs at most (a multi-turn row's last turn runs over its whole conversation, its KV kept from turn to turn:
    the generator's reservation, the memory estimate's sequence)."""
    return job.data.max_prompt_length + (env_response_budget(job) if job.env.enabled else job.generation.max_new_tokens)


def _response_budget_names(job) -> str:
    return "data.max_prompt_length + " + ("env.max_response_tokens" if job.env.enabled else "generation.max_new_tokens")


# ----------------------------------------------------------------------------------------------
# The step's batch and objective
# ----------------------------------------------------------------------------------------------


def loss_takes_its_settings(job) -> None:
    """The loss section against its loss's spec, by key (config/losses.py): the name names a loss, every key given
    is one it reads, every value within its precision-free bounds. First: the LossConfig is plain data."""
    check_loss_config(job.loss)


def minibatches_divide_the_rollout(job) -> None:
    t, g = job.train, job.generation
    rollout = t.prompts_per_step * g.n_samples_per_prompt
    check(rollout % t.num_minibatches == 0,
          f"train.prompts_per_step x generation.n_samples_per_prompt = {rollout} responses is not "
          f"divisible by train.num_minibatches={t.num_minibatches}")


def routing_replay_needs_token_ratios(job) -> None:
    # routing noise enters each token's ratio; GSPO's sequence ratio averages it out (the loss's spec says which)
    t = job.train
    if t.routing_replay != "off":
        check(loss_spec(job.loss.name).ratio == TOKEN,
              f"train.routing_replay={t.routing_replay!r} is for the losses with per-token ratios "
              f"({', '.join(losses_where(lambda s: s.ratio == TOKEN))}); loss.name={job.loss.name!r} uses GSPO's "
              "sequence ratio (GSPO needs no routing replay). Set train.routing_replay=off")


def loss_fits_the_precision(job) -> None:
    """The loss's settings in the training precision (config/loss_spec.py: what would overflow there), by key."""
    check_loss_config(job.loss, numerics_of(job.model.precision))


def warm_start_needs_answers(job) -> None:
    # the warm start learns the reference answers (a built-in task always has them); refused here rather
    # than with a traceback at its first batch
    t = job.train
    check(not (t.sft_steps > 0 and job.data.answer_key is None
               and not job.data.source.startswith(("builtin:", "reasoning_gym:"))),
          f"train.sft_steps={t.sft_steps} (supervised warm start) needs reference answers, but "
          "data.answer_key is null; set train.sft_steps=0 for data without answers")


def task_verifier_needs_a_task_source(job) -> None:
    # reward.name=reasoning_gym scores with the verifier each reasoning-gym example carries: refused here,
    # before any data is made, for prompts that have none
    if job.reward.name != "reasoning_gym":
        return
    for key, source in (("data.source", job.data.source), ("eval.source", job.eval.source)):
        check(source is None or source.startswith("reasoning_gym:"),
              f"reward.name=reasoning_gym scores a response with its reasoning-gym task's own verifier: it needs "
              f"{key}=reasoning_gym:<task> (e.g. reasoning_gym:chain_sum), got {key}={source!r}; for other data "
              "use a reward that compares with the reference answer (exact_match, math, ...)")


def no_pipeline_parallelism(job) -> None:
    # The RL loop has no pipeline schedule (forward_backward_func) yet: refuse PP up front.
    pp = job.parallel.pipeline_model_parallel_size
    check(pp == 1, f"parallel.pipeline_model_parallel_size={pp}: the RL trainer supports PP=1 only (use TP/EP/DP; "
                   "model building and checkpoints support PP)")


def prompt_and_response_fit_the_positions(job) -> None:
    need = row_token_budget(job)
    check(need <= job.model.max_position_embeddings,
          f"{_response_budget_names(job)} = {need} exceeds "
          f"model.max_position_embeddings={job.model.max_position_embeddings}")


def overlong_buffer_within_the_response(job) -> None:
    g = job.generation
    check(job.reward.overlong_buffer_len <= g.max_new_tokens,
          f"reward.overlong_buffer_len={job.reward.overlong_buffer_len} exceeds generation.max_new_tokens="
          f"{g.max_new_tokens}: the penalty stretch is the last tokens before that limit")


def dynamic_sampling_needs_groups(job) -> None:
    check(not (job.train.dynamic_sampling and job.generation.n_samples_per_prompt < 2),
          "train.dynamic_sampling=true needs generation.n_samples_per_prompt >= 2: a group of one response "
          "always has equal rewards and would always be dropped")


def groups_of_two_or_more(job) -> None:
    # every estimator is group-relative (advantages.py: dr_grpo and mean_only subtract the group mean too): a
    # group of one has advantage 0 whatever its reward, and no loss trains on that
    n = job.generation.n_samples_per_prompt
    check(n >= 2,
          f"generation.n_samples_per_prompt must be >= 2 for group-relative advantages, got {n}: with "
          f"train.advantage_estimator={job.train.advantage_estimator} a group of one response has advantage "
          "r - mean(r) = 0 whatever its reward, so nothing would train")


# ----------------------------------------------------------------------------------------------
# Sampling that would make every group's samples the same response (zero advantage)
# ----------------------------------------------------------------------------------------------


def no_greedy_groups(job) -> None:
    # greedy decoding gives every sample of a prompt the same response: every group's rewards are equal and
    # its advantages 0 (evaluation refuses eval.temperature=0 with pass@k likewise)
    g = job.generation
    check(not (g.temperature == 0 and g.n_samples_per_prompt > 1),
          f"generation.temperature=0 (greedy) with generation.n_samples_per_prompt={g.n_samples_per_prompt}: "
          "every sample of a prompt would be the same response, so every group has equal rewards and zero "
          "advantage and nothing trains; use a temperature > 0 (e.g. 1.0)")


def temperature_floor(job) -> None:
    # the same in all but name, and the loss's log-probs are log-softmax(logits / T): any change of a logit
    # (one optimizer step) moves them 1/T times as much, so the ratios and the KL explode
    g = job.generation
    check(not 0 < g.temperature < MIN_SAMPLING_TEMPERATURE,
          f"generation.temperature={g.temperature:g} is below {MIN_SAMPLING_TEMPERATURE:g}: sampling at it is "
          "greedy in all but name (the samples of a prompt are the same response: zero advantage), and the "
          f"loss's log-probs, log-softmax(logits / T), move {1 / g.temperature:.3g} times as much as the logits, "
          "so one update makes log-ratios and loss/approx_kl explode; use a temperature >= "
          f"{MIN_SAMPLING_TEMPERATURE:g} (e.g. 1.0)")


def top_k_not_greedy(job) -> None:
    g = job.generation
    check(not (g.top_k == 1 and g.n_samples_per_prompt > 1),
          f"generation.top_k=1 with generation.n_samples_per_prompt={g.n_samples_per_prompt}: only the most "
          "likely token can be drawn (greedy decoding), so every sample of a prompt would be the same response, "
          "every group has equal rewards and zero advantage and nothing trains; use top_k=0 (off) or >= 2")


def top_p_not_greedy(job) -> None:
    g = job.generation
    check(not (g.top_p <= 1 / job.model.vocab_size and g.n_samples_per_prompt > 1),
          f"generation.top_p={g.top_p:g} <= 1 / model.vocab_size: the most likely token alone always reaches it "
          "(greedy decoding), so every sample of a prompt would be the same response and every group has zero "
          "advantage; use a larger top_p (1 = off)")


def overlong_filtering_keeps_some_rows(job) -> None:
    # overlong filtering masks out responses that reach max_new_tokens without a stop token; these settings
    # make every response one of them, and then no step ever trains anything
    t, g = job.train, job.generation
    check(not (t.overlong_filtering and g.ignore_eos),
          "train.overlong_filtering=true with generation.ignore_eos=true: every response runs to "
          "generation.max_new_tokens without a stop token, so overlong filtering would mask every response "
          "out of the loss and nothing would train; turn one of them off")
    check(not (t.overlong_filtering and g.min_new_tokens >= g.max_new_tokens),
          f"train.overlong_filtering=true with generation.min_new_tokens={g.min_new_tokens} >= "
          f"generation.max_new_tokens={g.max_new_tokens}: no response can end with a stop token, so overlong "
          "filtering would mask every response out of the loss; lower generation.min_new_tokens")


# ----------------------------------------------------------------------------------------------
# Devices and the decoder
# ----------------------------------------------------------------------------------------------


def transformer_engine_not_on_the_cpu(job) -> None:
    """parallel.device=cpu with a choice only Transformer Engine on a GPU can run: refused here, by key, rather
    than when the model is built on every rank (model.resolve_impl says the same there). TE-spec models are
    built on the CPU only construct-only, by tests (model.build_model), never by a job."""
    if job.parallel.device != "cpu":
        return
    m = job.model
    # (te_grouped experts and the fused router are refused for the local spec when the model is built, with
    # their own messages, on any device)
    for key, bad in (("model.transformer_impl", m.transformer_impl == "transformer_engine"),
                     ("model.fp8", m.fp8 is not None)):
        check(not bad, f"{key}={getattr(m, key.split('.')[1])!r} needs Transformer Engine's CUDA kernels, but "
                       "parallel.device='cpu': Transformer Engine does not run on the CPU; use parallel.device=auto "
                       "or cuda on a GPU machine, or the local spec on the CPU (model.transformer_impl=local or auto)")


@dataclass(frozen=True)
class LeanLimit:
    """One thing the lean decoder cannot run: ``supported(value)`` is false for it.

    reason: in words, for the messages ("{value}" is filled in with the model's value);
    config_key: the job key that shows it ("section.key"), read through ``config_attr`` of that section
        (a resolved property: parallel.etp, parallel.sp) when given; None when no job key does;
    model_attr: the TransformerConfig attribute that shows it on a built model, or None."""

    reason: str
    config_key: Optional[str]
    model_attr: Optional[str]
    supported: Callable[[Any], bool]
    config_attr: Optional[str] = None


def _one(v) -> bool:
    return (v or 1) == 1


def _off(v) -> bool:
    return not v


# TP, EP and expert-TP are decoded over the sharded weights (the decode step's own collectives: a
# decoder does not split the sequence, so sequence parallelism is simply not used while decoding);
# pipeline and context parallelism are not: a decode step would have to cross stages / split its
# one token
LEAN_DECODE_LIMITS: tuple[LeanLimit, ...] = (
    LeanLimit("pipeline parallelism", "parallel.pipeline_model_parallel_size", "pipeline_model_parallel_size", _one),
    LeanLimit("context parallelism", None, "context_parallel_size", _one),
    LeanLimit("interleaved RoPE", None, "rotary_interleaved", _off),
    LeanLimit("multi-latent attention", None, "multi_latent_attention", _off),
    LeanLimit("gated attention", None, "attention_output_gate", _off),
    LeanLimit("post-layernorm residual", None, "apply_residual_connection_post_layernorm", _off),
    LeanLimit("fp32 residual connection", None, "fp32_residual_connection", _off),
    LeanLimit("FP8", "model.fp8", "fp8", lambda v: v is None),
    LeanLimit("sliding-window attention", None, "window_size", lambda v: v is None),
    LeanLimit("softmax offsets", None, "softmax_type", lambda v: v in (None, "vanilla")),
    LeanLimit("query-key layer scaling", None, "apply_query_key_layer_scaling", _off),
    LeanLimit("Transformer Engine's fused router top-k", "model.moe_router_fusion", "moe_router_fusion", _off),
    LeanLimit("normalization {value}", None, "normalization", lambda v: v in (None, "RMSNorm")),
)


def lean_decode_limit(model_config) -> Optional[str]:
    """The first LEAN_DECODE_LIMITS row a built model's TransformerConfig breaks, in words; None if none (an
    attribute this megatron-core lacks is taken as its plain setting)."""
    for row in LEAN_DECODE_LIMITS:
        if row.model_attr is not None:
            value = getattr(model_config, row.model_attr, None)
            if not row.supported(value):
                return row.reason.format(value=value)
    return None


# The most tokens one MoE dispatch of the lean decoder gathers over the expert group (a prefill over rows x
# prompt tokens on each of the group's ranks goes through in chunks of this many gathered tokens): bounds the
# gathered activations, the expert pairs and the fp32 partial outputs of a dispatch, whatever the batch.
LEAN_MOE_GATHER_TOKENS = 16384


def lean_decode_config_limit(job) -> Optional[tuple[LeanLimit, Any]]:
    """The first LEAN_DECODE_LIMITS row with a config key that ``job`` breaks, with the job's value; None
    when the config alone shows nothing the lean decoder cannot run."""
    for row in LEAN_DECODE_LIMITS:
        if row.config_key is None:
            continue
        section, _, key = row.config_key.partition(".")
        value = getattr(getattr(job, section), row.config_attr or key)
        if not row.supported(value):
            return row, value
    return None


def _shown(v) -> str:
    return ("true" if v else "false") if isinstance(v, bool) else repr(v) if isinstance(v, str) else str(v)


def lean_decode_runs_here(job) -> None:
    """generation.decode_impl=lean runs under TP / EP / expert-TP on one pipeline stage, on the local or the
    Transformer Engine spec's weights (generation.lean_decoder.lean_decode_unsupported); what the config alone
    shows is refused here, by key, rather than on every rank after the model is built."""
    refill = job.generation.max_batch_rows > 0  # continuous batching runs on the lean decoder only
    if job.generation.decode_impl != "lean" and not refill:
        return
    broken = lean_decode_config_limit(job)
    if broken is not None and job.generation.decode_impl != "lean":
        row, value = broken
        raise ConfigError(f"generation.max_batch_rows={job.generation.max_batch_rows} needs the lean decoder, which "
                          f"does not run {row.reason} ({row.config_key}={_shown(value)}); use max_batch_rows=0")
    if broken is not None:
        row, value = broken
        if row.config_key.endswith("_size"):
            raise ConfigError(f"generation.decode_impl=lean runs on one pipeline stage only, got {row.config_key}="
                              f"{value}; use generation.decode_impl=auto (lean where it can run, megatron's "
                              "forward elsewhere) or megatron")
        raise ConfigError(f"generation.decode_impl=lean does not support {row.reason} ({row.config_key}="
                          f"{_shown(value)}); use generation.decode_impl=auto or megatron")


# ----------------------------------------------------------------------------------------------
# Resume, micro-batching, asynchronous rollouts
# ----------------------------------------------------------------------------------------------


def allow_config_change_names_keys(job) -> None:
    """checkpoint.allow_config_change names sections or section.key of this job (a typo would silently accept
    nothing)."""
    sections = [f.name for f in fields(job)]
    for entry in job.checkpoint.allow_config_change:
        section, _, key = entry.partition(".")
        if section not in sections:
            raise ConfigError(f"checkpoint.allow_config_change: {entry!r} names no config section; sections: "
                              f"{sections}")
        if key:
            names = [f.name for f in fields(getattr(job, section))]
            if key not in names:
                close = difflib.get_close_matches(key, names, n=3)
                raise ConfigError(f"checkpoint.allow_config_change: unknown config key {entry}"
                                  + (f"; did you mean {[f'{section}.{c}' for c in close]}?" if close else ""))


def token_budget_holds_a_row(job) -> None:
    # (the ranks of a lockstep group over DP ranks, EP or expert-TP, agree one plan: rollout.agreed_length_profile)
    budget, need = job.train.max_tokens_per_micro_batch, row_token_budget(job)
    if budget is not None:
        check(budget >= need, f"train.max_tokens_per_micro_batch={budget} cannot hold one row of up to "
                              f"{_response_budget_names(job)} = {need} tokens")


def old_logprobs_under_async(job) -> None:
    check(not (job.rollout.is_async and job.train.old_logprobs == "rollout"),
          "train.old_logprobs=rollout with rollout.mode=async: the rollout ranks' log-probs are the behaviour "
          "policy's (up to rollout.max_staleness versions old) and they record no routes for the routing "
          "metrics; the trainer recomputes the old policy's: use train.old_logprobs=auto or recompute")


def async_staleness_needs_correction(job) -> None:
    r = job.rollout
    # the importance-weighting modes; a sequence mask drops responses but weighs the rest 1, not pi_old / pi_rollout
    weighting = ("tis", "mis", "icepop")
    check(not r.is_async or r.max_staleness == 0 or job.rollout_correction.mode in weighting,
          f"rollout.max_staleness={r.max_staleness} trains on rollouts of older weights: the loss needs the "
          "behaviour-to-old importance weight (decoupled objective); set rollout_correction.mode=tis, mis or icepop "
          "(or rollout.max_staleness=0)")


def async_without_r3(job) -> None:
    check(not (job.rollout.is_async and job.train.routing_replay == "R3"),
          "train.routing_replay=R3 with rollout.mode=async: R3 replays routes recorded while generating, on the "
          "rollout ranks; use routing_replay=R2 (recorded by the trainer's old-log-prob pass) or off")


def async_without_dynamic_sampling(job) -> None:
    check(not (job.rollout.is_async and job.train.dynamic_sampling),
          "train.dynamic_sampling=true with rollout.mode=async is not supported: the extra generation rounds "
          "would run on the rollout ranks mid-step; use rollout.mode=colocated")


def async_without_refill(job) -> None:
    check(not (job.rollout.is_async and job.generation.max_batch_rows),
          f"generation.max_batch_rows={job.generation.max_batch_rows} with rollout.mode=async is not supported: a "
          "weight update between decode steps is filed by decode step, and refilled rows are at different steps; "
          "use generation.max_batch_rows=0")


def multiturn_without_refill(job) -> None:
    check(not (job.env.enabled and job.generation.max_batch_rows),
          f"generation.max_batch_rows={job.generation.max_batch_rows} with env.name: a multi-turn row keeps its KV "
          "cache rows from turn to turn, and a refilled batch hands a finished row's cache rows to a waiting row; "
          "use generation.max_batch_rows=0")


def vllm_engine_limits(job) -> None:
    """What rollout.engine=vllm does not run (yet), refused by key before anything is built."""
    if job.rollout.engine != "vllm":
        return
    t = job.train
    if t.routing_replay == "R3":
        check(job.parallel.device != "cpu",
              "train.routing_replay=R3 with rollout.engine=vllm on the CPU: R3 replays the routes vLLM returns "
              "(enable_return_routed_experts), which needs its V2 model runner, and on a CPU that needs triton-cpu "
              "(not on PyPI); use train.routing_replay=R2 or off, or rollout.engine=megatron")
        # vLLM keeps the routes on the first rank of its TP group only (aux_output_connector/worker.py: the other
        # ranks' schedulers get no routes and assert), and under torchrun every rank runs its own scheduler
        check(job.parallel.tensor_model_parallel_size == 1,
              f"train.routing_replay=R3 with rollout.engine=vllm at parallel.tensor_model_parallel_size="
              f"{job.parallel.tensor_model_parallel_size}: vLLM returns the routes on the first rank of its TP group "
              "only, and each rank of the job's engine runs its own scheduler; use tensor_model_parallel_size=1 "
              "(expert / data parallel run), train.routing_replay=R2, or rollout.engine=megatron")
    check(t.old_logprobs != "rollout",
          "train.old_logprobs=rollout with rollout.engine=vllm: the engine's log-probs are the behaviour policy's "
          "under other numerics; the trainer recomputes the old policy's (train.old_logprobs=auto or recompute)")
    level = job.rollout.vllm.sleep_level
    check(not level or job.parallel.device != "cpu",
          f"rollout.vllm.sleep_level={level} on the CPU: vLLM's sleep mode needs a GPU (its CuMem allocator); use "
          "rollout.vllm.sleep_level=0 or null")
    check(not level or not job.rollout.is_async,
          f"rollout.vllm.sleep_level={level} with rollout.mode=async: the rollout ranks' engines never make room for "
          "training (those ranks do not train); use rollout.vllm.sleep_level=0 or null")
    # TP / EP / DP layouts run: one engine per trainer TP group (rollout.mode=async: per rollout TP group), each
    # DP replica its own rows (rollout/vllm_engine.py engine_layout_args)


# ----------------------------------------------------------------------------------------------
# Multi-turn rollouts (env.*)
# ----------------------------------------------------------------------------------------------


def env_response_budget(job) -> int:
    """Tokens after the prompt a multi-turn row may hold: env.max_response_tokens, or what the model's positions
    leave after data.max_prompt_length."""
    e = job.env
    return e.max_response_tokens if e.max_response_tokens is not None else (
        job.model.max_position_embeddings - job.data.max_prompt_length)


def eval_rows_per_rank(num_prompts: int, num_samples: int, dp: int) -> int:
    """The most rows one evaluation pass generates on a DP rank (trainer/evaluation.py shards each pass over the
    DP ranks): the largest share of the sampled pass's num_prompts x num_samples rows (the greedy pass has one
    per prompt), rounded up; ranks that step together batch to it. What sizes the generator the evaluation
    shares with the rollouts, and the memory estimate's count of it."""
    return -(-num_prompts * max(1, num_samples) // dp)


def env_budget_fits(job) -> None:
    if not job.env.enabled:
        return
    budget, g = env_response_budget(job), job.generation
    check(budget >= g.max_new_tokens,
          f"env.max_response_tokens={budget} is below generation.max_new_tokens={g.max_new_tokens}: a row's budget "
          "must hold at least one whole turn")
    check(not g.ignore_eos, "generation.ignore_eos=true with env.name: a turn ends at a stop token, without one "
                            "every row would end after its first turn, cut at generation.max_new_tokens")
    check(not (job.env.tool_format == "qwen3" and not job.data.apply_chat_template),
          "env.tool_format=qwen3 is the chat template's format (Qwen3's template shows the tools and reads "
          "<tool_call> blocks); without data.apply_chat_template (the built-in tokenizer has no template) the model is "
          "never shown it: use env.tool_format=plain (or auto)")


# In this order (the first broken rule is the one reported).
RULES: tuple[Callable[[Any], None], ...] = (
    loss_takes_its_settings, minibatches_divide_the_rollout, routing_replay_needs_token_ratios, loss_fits_the_precision,
    warm_start_needs_answers, task_verifier_needs_a_task_source,
    no_pipeline_parallelism, prompt_and_response_fit_the_positions, overlong_buffer_within_the_response,
    dynamic_sampling_needs_groups, groups_of_two_or_more, no_greedy_groups, temperature_floor, top_k_not_greedy,
    top_p_not_greedy, overlong_filtering_keeps_some_rows, transformer_engine_not_on_the_cpu, lean_decode_runs_here,
    allow_config_change_names_keys, token_budget_holds_a_row, old_logprobs_under_async,
    async_staleness_needs_correction, async_without_r3, async_without_dynamic_sampling, async_without_refill,
    multiturn_without_refill,
    vllm_engine_limits,
    env_budget_fits,
)


def check_job(job) -> None:
    """Run every rule of RULES on the JobConfig ``job``."""
    for rule in RULES:
        rule(job)


# ----------------------------------------------------------------------------------------------
# The old policy's log-probs
# ----------------------------------------------------------------------------------------------

# Largest |sequence ratio - 1| the first (on-policy) minibatch may show: 30x inside GSPO's 3e-4 clip
# range. "auto" takes the rollout's log-probs only where rollout and training agree to within it.
ON_POLICY_RATIO_TOLERANCE = 1e-5


def old_logprob_source(cfg, device) -> tuple[bool, str]:
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
    if cfg.rollout.engine == "vllm":
        return True, "auto: rollout.engine=vllm samples under other numerics than the training forward's"
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
