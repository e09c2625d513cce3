"""A job's data at start-up, before the model is built: the training prompts, the evaluation's prompts, and the
checks that can be made on them before the first step.

* The reasoning-gym examples those checks need (the first ``REFERENCE_SAMPLE`` of the epoch, whose reference
  answers are checked, and the held-out set) are made here (data/example_cache.py): a progress line every few
  seconds, the stop flag read between two examples (``runtime.stop.Cancelled``: the trainer exits 79, nothing to
  save), and a file under ``data.cache_dir`` (default ``<train.output_dir>/data_cache``) that a requeued or
  repeated job reads back instead. It is written once the job's data passed its checks (a refused job writes
  nothing), or when a stop signal cut the making short (what was made: the requeued job continues from there).
  Every rank makes them (each rank builds the same prompts): none waits for another and no collective runs
  meanwhile, so a slow task cannot run a collective into its timeout; the ranks do the same work and reach the
  next collective together. Only the first rank of each node writes the file (atomically: on a shared file
  system, two nodes leave one whole file).
* The checks: reference answers the reward cannot read (rewards.check_reference_answers); a task without
  reference answers (reasoning-gym's ``answer: None``) refused for the supervised warm start and for rewards
  that compare with the reference; a warning when most references are longer than generation.max_new_tokens
  (in the job's tokenizer's tokens); evaluation prompts that are training prompts too (prompts.encode_held_out).
"""

from __future__ import annotations

import logging
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

from megatron_gspo.data.example_cache import ExampleCache, make_examples
from megatron_gspo.data.prompts import (REFERENCE_SAMPLE, HeldOutPrompts, PromptDataset, PromptSampler, encode_held_out,
                                        held_out_split, same_task)
from megatron_gspo.data.reasoning_gym_tasks import ReasoningGymTask
from megatron_gspo.data.rewards import check_reference_answers
from megatron_gspo.data.tokenizer import Tokenizer
from megatron_gspo.errors import DataError, TokenizerError
from megatron_gspo.runtime.stop import Cancelled

log = logging.getLogger("megatron_gspo")

# Rewards that never read the reference answer's text: the task's verifier, the format check.
NO_REFERENCE_REWARDS = ("reasoning_gym", "format")
# Rewards a response earns by giving the whole reference answer (math's needs only its final answer).
WHOLE_REFERENCE_REWARDS = ("exact_match", "digit_match", "reasoning_gym")


@dataclass
class JobData:
    """The training sampler and the evaluation's prompts (None without eval.interval)."""

    sampler: PromptSampler
    held: Optional[HeldOutPrompts]


def cache_dir(cfg) -> str:
    """data.cache_dir, or ``<train.output_dir>/data_cache``."""
    return cfg.data.cache_dir or os.path.join(cfg.train.output_dir, "data_cache")


def build_job_data(cfg, tokenizer: Tokenizer, should_stop: Callable[[], bool] = lambda: False,
                   write_cache: bool = True, main: bool = True) -> JobData:
    """The job's (JobConfig ``cfg``) training sampler and evaluation prompts, checked (module doc).
    ``should_stop``: the process's stop flag; ``write_cache``: this rank writes the example cache; ``main``: this
    rank says the warnings (every rank builds the same data and would say the same)."""
    d, e = cfg.data, cfg.eval
    evaluating = e.interval > 0
    past = evaluating and (e.source is None or same_task(e.source, d.source))  # held out past the training epoch
    train = PromptDataset.from_config(d, holdout=e.num_prompts if past else 0)
    held = None
    if evaluating:
        train, held = held_out_split(d, train, e.source, e.num_prompts, e.task_kwargs)
    wanted = [(train, train.task_indices(REFERENCE_SAMPLE))] + ([(held, held.task_indices())] if held else [])
    made = make_task_examples(wanted, cache_dir(cfg), should_stop, write_cache, main)
    check_training_data(cfg, train, tokenizer, main)
    sampler = PromptSampler(train, tokenizer, d, cfg.train.prompts_per_step)
    out = None
    if held is not None:
        out = encode_held_out(d, train, held, tokenizer, warn=main)
        check_reference_answers(cfg.reward, [(f"{out.source} id {p.id}", p.answer) for p in out.prompts], out.source)
        check_task_answers(cfg, [p.answer for p in out.prompts], out.source, warm_start=False, warn=main)
    for cache, examples in made:  # only now: a job its data refuses writes nothing
        if _keep(cache, examples, write_cache) is None:
            log.info("%s: %d examples kept for the next run", cache.path, len(examples))
    return JobData(sampler, out)


# ----------------------------------------------------------------------------------------------
# reasoning-gym examples made at start-up
# ----------------------------------------------------------------------------------------------


def make_task_examples(wanted: Sequence[tuple[PromptDataset, Sequence[int]]], directory: str,
                       should_stop: Callable[[], bool] = lambda: False, write_cache: bool = True,
                       main: bool = True) -> list[tuple[ExampleCache, dict]]:
    """Make (or read back) the examples ``wanted`` [(dataset, task indices)] of every reasoning-gym task among
    them, one task at a time (other sources need nothing made). Returns [(cache, examples)] of the tasks that
    made new ones, for the caller to write once the job is not refused."""
    tasks: dict[int, tuple[ReasoningGymTask, list[int]]] = {}
    for dataset, indices in wanted:
        if isinstance(dataset.task, ReasoningGymTask):
            tasks.setdefault(id(dataset.task), (dataset.task, []))[1].extend(indices)
    made = [make_for_task(task, indices, directory, should_stop, write_cache, main) for task, indices in tasks.values()]
    return [m for m in made if m is not None]


def make_for_task(task: ReasoningGymTask, indices: Sequence[int], directory: str,
                  should_stop: Callable[[], bool] = lambda: False, write_cache: bool = True,
                  main: bool = True) -> Optional[tuple[ExampleCache, dict]]:
    """``task.made`` holds every example of ``indices``: read from the task's cache file under ``directory``,
    the others made; returns (the cache, every example) when some were made (None: all were read). A stop
    signal: Cancelled, saying how many were made and where they are kept, after they are written (when
    ``write_cache``)."""
    cache = ExampleCache(os.path.join(directory, "reasoning_gym"), task.name, task.identity())
    known = cache.load(warn=main)
    need = list(dict.fromkeys(indices))
    missing = sum(i not in known for i in need)
    if not missing:
        log.info("%s: %d examples read from %s (made by an earlier run)", task.source, len(need), cache.path)
        task.made.update(known)
        return None
    read = f"{len(need) - missing} read from {cache.path}; " if len(need) > missing else ""
    log.info("%s: making %d examples (%sthe check of the reference answers and the held-out set)", task.source,
             missing, read)
    t0 = time.monotonic()
    made = dict(known)
    try:
        make_examples(task.source, task.make, need, made, should_stop)
    except Cancelled as stop:
        done = len(made) - len(known)
        kept = (_keep(cache, made, write_cache) if done else "none to keep") or \
            f"kept in {cache.path}: a requeued job continues from there"
        raise Cancelled(f"{stop.where} ({done} of {missing} made in {stop.elapsed_s:.1f} s, {kept})",
                        elapsed_s=stop.elapsed_s) from None
    task.made.update(made)
    log.info("%s: %d examples made in %.1f s", task.source, missing, time.monotonic() - t0)
    return cache, made


def _keep(cache: ExampleCache, made: dict, write: bool) -> Optional[str]:
    """Write ``made`` to ``cache`` when this rank writes: None when written, else why not (also logged)."""
    if not write:
        return "kept by the node's first rank"
    why = cache.save(made)
    if why is None:
        return None
    log.warning("%s: examples not cached (%s); a requeued job makes them again", cache.path, why)
    return f"not cached: {why}"


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


def check_training_data(cfg, train: PromptDataset, tokenizer: Tokenizer, main: bool = True) -> None:
    """The training data's reference answers (its first REFERENCE_SAMPLE for a task): readable by the reward,
    present where the job needs them, within reach of generation.max_new_tokens (a warning)."""
    refs = train.references()
    check_reference_answers(cfg.reward, refs, train.source)
    check_task_answers(cfg, [a for _, a in refs], train.source, warm_start=cfg.train.sft_steps > 0, warn=main)
    if main:
        warn_unreachable_references(cfg, [a for _, a in refs], tokenizer, train.source)


def check_task_answers(cfg, answers: Sequence, source: str, warm_start: bool, warn: bool = True) -> None:
    """Refuse (DataError) a task whose examples have no reference answer (reasoning-gym's ``answer: None``,
    reasoning_gym_tasks.TaskAnswer.missing) for the supervised warm start (``warm_start``) and for a
    registered reward that compares with the reference; a plug-in reward is warned (it gets ``''``; by this rank
    when ``warn``)."""
    missing = sum(bool(getattr(a, "missing", False)) for a in answers)
    if not missing:
        return
    what = (f"{source}: {missing} of the {len(answers)} examples checked have no reference answer (the task gives "
            "answer None: only its own verifier can score a response)")
    if warm_start:
        raise DataError(f"{what}, but the supervised warm start (train.sft_steps={cfg.train.sft_steps}) trains on "
                        "reference answers; set train.sft_steps=0 and score with reward.name=reasoning_gym")
    name = cfg.reward.name
    if name in NO_REFERENCE_REWARDS or (":" in name and not warn):
        return
    if ":" not in name:  # a registered reward: it compares with the reference
        raise DataError(f"{what}, but reward.name={name} compares a response with the reference answer; use "
                        "reward.name=reasoning_gym (the task's own verifier)")
    log.warning("%s; reward.name=%s gets '' as their reference answer (the task's verifier is answer.verify(text), "
                "its entry answer.entry)", what, name)


def warn_unreachable_references(cfg, answers: Sequence, tokenizer: Tokenizer, source: str) -> None:
    """A warning when most reference answers (``answers``; up to REFERENCE_SAMPLE of them, evenly spread, in the
    job's tokenizer's tokens) are longer than generation.max_new_tokens: no response can give them. For a job
    that learns or is scored on the whole reference (the warm start, WHOLE_REFERENCE_REWARDS) only."""
    if cfg.train.sft_steps <= 0 and cfg.reward.name not in WHOLE_REFERENCE_REWARDS:
        return
    texts = [str(a) for a in answers if a is not None and not getattr(a, "missing", False)]
    sample = texts[:: max(1, len(texts) // REFERENCE_SAMPLE)]
    lengths = []
    for text in sample:
        try:
            lengths.append(len(tokenizer.encode(text)))
        except TokenizerError:  # a character the tokenizer lacks: the warm start / reward names it where it matters
            continue
    limit = cfg.generation.max_new_tokens
    over = sum(n > limit for n in lengths)
    if 2 * over <= len(lengths):
        return
    warm = (f"; the supervised warm start (train.sft_steps={cfg.train.sft_steps}) would teach answers the policy "
            "cannot finish" if cfg.train.sft_steps > 0 else "")
    log.warning("%s: %d of %d reference answers checked are longer than generation.max_new_tokens=%d tokens (%s "
                "tokenizer: median %d, longest %d): no response can give them, so the reward is rarely earned%s; "
                "raise generation.max_new_tokens (and model.max_position_embeddings) or choose easier task settings",
                source, over, len(lengths), limit, type(tokenizer).__name__, statistics.median(lengths), max(lengths),
                warm)
