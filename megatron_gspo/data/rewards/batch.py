"""The batch interface: ``score(batch) -> rewards``, and what scoring one row takes.

Every reward is scored through a :class:`BatchReward`: ``score(batch)`` returns one reward per row of
the :class:`RewardBatch`, in row order, and ``close()`` frees what it holds (worker processes, a
model). A reward model or a pool of verifiers implements it directly (``math``: a pool of math-verify
processes); a batch function becomes one through :class:`BatchFunctionReward`; a per-sample function,
the simple case, through per_sample.PerSampleReward, which scores the rows one at a time (``score_one``)
in this process or, where the reward allows and ``reward.num_workers > 1``, in a pool of worker
processes (pool.py). Either way a long scoring honours the job's stop flag (``batch.should_stop``)
within about one sample: ``runtime.stop.Cancelled``, which the trainer turns into an abandoned step.

This module imports no torch and nothing of the package but errors: the pool and its worker processes
use it (a reward returning a tensor is read through ``as_float`` where torch is already loaded).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
import sys
from typing import Any, Callable, Optional, Sequence

from megatron_gspo.errors import clip_repr


def _never() -> bool:
    return False


@dataclasses.dataclass(frozen=True)
class RewardBatch:
    """The rows to score: ``prompts[i]`` (the text the model was conditioned on), ``responses[i]`` (the
    decoded completion, possibly with its end-of-sequence text), ``answers[i]`` (the reference, or None),
    and ``should_stop()``, the job's stop flag, which a long scorer reads between rows (module doc)."""

    prompts: Sequence[str]
    responses: Sequence[str]
    answers: Sequence[Optional[str]]
    should_stop: Callable[[], bool] = _never

    def __post_init__(self) -> None:
        n = len(self.responses)
        if len(self.prompts) != n or len(self.answers) != n:
            raise ValueError(f"reward batch: {len(self.prompts)} prompts, {n} responses and {len(self.answers)} "
                             "answers must be the same number")

    def __len__(self) -> int:
        return len(self.responses)

    def rows(self):
        """(prompt, response, answer) of each row, in order."""
        return zip(self.prompts, self.responses, self.answers)


class BatchReward:
    """A reward scored a batch at a time (module doc). ``score`` returns a sequence (list, tensor, array)
    of one number per row, in row order; a row that failed may be a :class:`SampleFailed` instead."""

    def score(self, batch: RewardBatch) -> Sequence[Any]:
        raise NotImplementedError

    def close(self) -> None:
        """Free what the reward holds (worker processes, a model): called once the job is done with it."""


@dataclasses.dataclass(frozen=True)
class SampleFailed:
    """In place of a row's reward: why the reward failed on it (``raised KeyError: 'x'``), for the
    RewardError that names the row."""

    problem: str


def as_float(value: Any) -> Optional[float]:
    """A Python float for a number-like reward (bool, int, float, numpy scalar, one-element tensor or
    array), None for anything else."""
    torch = sys.modules.get("torch")  # a tensor can only come from a process that imported torch
    if torch is not None and isinstance(value, torch.Tensor):
        return float(value.item()) if value.numel() == 1 and not value.is_complex() else None
    if isinstance(value, numbers.Real):
        return float(value)
    if hasattr(value, "item") and getattr(value, "size", None) == 1:  # numpy 0-d / 1-element arrays
        item = value.item()
        return float(item) if isinstance(item, numbers.Real) else None
    return None


# float32's largest finite value (torch.finfo(torch.float32).max): rewards are float32 tensors, where a larger
# number is inf. A literal, so that the environment workers need not import torch.
FP32_MAX = 3.4028234663852886e38


def reward_number(raw: Any) -> tuple[Optional[float], Optional[str]]:
    """The one rule for a reward value, for reward functions and environments alike: (the value as a float, None),
    or (None, what is wrong with it, to follow "returned"): one number (``as_float``), finite, within float32."""
    value = as_float(raw)
    if value is None:
        return None, f"{type(raw).__name__} {clip_repr(raw, 60)}, not a number"
    if not math.isfinite(value):
        return None, f"{value}, not a finite number"
    if abs(value) > FP32_MAX:
        return None, (f"{value:g}, beyond float32's range (magnitude at most {FP32_MAX:.3g}): the rewards are "
                      "float32, where it would be inf")
    return value, None


def score_one(fn: Callable, settings: dict, prompt: str, response: str, answer: Optional[str]) -> Any:
    """A per-sample reward's value on one row as a float, or SampleFailed saying why not. A SystemExit
    from the function is a failure of the row too (it would otherwise end the trainer with status 0)."""
    try:
        raw = fn(prompt, response, answer, **settings)
    except (Exception, SystemExit) as e:
        return SampleFailed(f"raised {type(e).__name__}: {e}")
    value = as_float(raw)
    if value is None:
        return SampleFailed(f"returned {type(raw).__name__} {clip_repr(raw, 60)}, not a number")
    return value


class BatchFunctionReward(BatchReward):
    """A batch function (``@reward_function(batch=True)``) with its settings bound."""

    def __init__(self, spec, settings: dict) -> None:
        self.fn, self.settings = spec.target, dict(settings)

    def score(self, batch: RewardBatch) -> Sequence[Any]:
        return self.fn(batch, **self.settings)
