"""The job's reward: ``reward.name`` built once with its settings, plus ``format_weight * format``, each
batch's values checked and returned as a float32 tensor on the trainer's device.

Whatever its shape (registry.py), a reward scores through ``BatchReward.score`` (batch.py); what comes
back must be one finite number per row that float32 can hold (bool and one-element tensors / arrays
count). Anything else (an exception, NaN, inf, 1e300, None, a string, too few rows) stops training with
a :class:`RewardError` naming the reward, the row (or the batch) and the start of its prompt and
response: a reward silently coerced to 0 would teach the policy from a bug. The first bad row in row
order is the one named, however many worker processes scored the batch.
"""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Sequence, Union

import torch

from megatron_gspo.config import RewardConfig
from megatron_gspo.data.rewards.batch import (BatchFunctionReward, BatchReward, RewardBatch, SampleFailed, as_float,
                                              reward_number)
from megatron_gspo.data.rewards.per_sample import PerSampleReward
from megatron_gspo.data.rewards.registry import (RewardSpec, check_signature, registered_rewards, registered_spec,
                                                 resolve_reward, spec_of)
from megatron_gspo.data.rewards.settings import NUM_WORKERS, check_settings
from megatron_gspo.errors import ConfigError, RewardError, clip_repr
from megatron_gspo.runtime.stop import Cancelled


def _number_problem(raw: Any) -> tuple[Optional[float], Optional[str]]:
    """(the reward as a float, None) or (None, what is wrong with it)."""
    if isinstance(raw, SampleFailed):
        return None, raw.problem
    value, problem = reward_number(raw)
    return value, None if problem is None else f"returned {problem}"


class Reward:
    """A reward ready to score batches: ``main`` (a BatchReward) plus ``format_weight`` times the format
    reward with ``format_settings``; ``name`` is how errors name it (``math + 0.1*format``). ``close()``
    frees what ``main`` holds (worker processes)."""

    def __init__(self, main: BatchReward, name: str, format_settings: Optional[dict] = None,
                 format_weight: float = 0.0) -> None:
        self.main, self.name = main, name
        self.format_settings, self.format_weight = dict(format_settings or {}), float(format_weight)

    def score(self, prompts: Sequence[str], responses: Sequence[str], answers: Optional[Sequence] = None, *,
              device: Union[str, torch.device] = "cpu", should_stop: Optional[Callable[[], bool]] = None) -> torch.Tensor:
        """The rewards of the rows, float32 [len(responses)] on ``device``. runtime.stop.Cancelled when
        ``should_stop()`` cut the scoring short; RewardError for a bad value (module doc)."""
        batch = RewardBatch(prompts, responses, [None] * len(responses) if answers is None else answers,
                            *([should_stop] if should_stop is not None else []))
        n = len(batch)
        raw = self._score_main(batch) if n else []
        values = []
        for i in range(n):
            value, problem = _number_problem(raw[i])
            if problem is None and self.format_weight:
                value += self.format_weight * self._format(batch, i)
                value, problem = _number_problem(value)
            if problem is not None:
                raise RewardError(self.name, i, batch.prompts[i], batch.responses[i], problem)
            values.append(value)
        return torch.tensor(values, dtype=torch.float32, device=device)

    def __call__(self, prompt: str, response: str, answer: Optional[str] = None) -> float:
        """The reward of one row, computed as ``score`` computes it but without its checks: what the
        reward raises propagates as it is (for tests and for code that builds on a reward)."""
        if isinstance(self.main, PerSampleReward):
            raw = self.main.fn(prompt, response, answer, **self.main.settings)
        else:
            raw = self.main.score(RewardBatch([prompt], [response], [answer]))[0]
        value = as_float(raw)
        if value is None:
            raise TypeError(f"{self.name} returned {type(raw).__name__} {clip_repr(raw, 60)}, not a number")
        return value + (self.format_weight * self._format(RewardBatch([prompt], [response], [answer]), 0)
                        if self.format_weight else 0.0)

    def _score_main(self, batch: RewardBatch) -> Sequence[Any]:
        n, first = len(batch), (batch.prompts[0], batch.responses[0])
        try:
            raw = self.main.score(batch)
        except (Cancelled, ConfigError, RewardError):
            raise
        except Exception as e:  # a batch reward's own failure: no row to blame
            raise RewardError(self.name, None, *first, f"raised {type(e).__name__}: {e}", batch_size=n) from e
        try:
            got = len(raw)
        except TypeError:
            raise RewardError(self.name, None, *first, f"returned {type(raw).__name__} {clip_repr(raw, 60)}, not "
                              "one reward per row", batch_size=n) from None
        if got != n:
            raise RewardError(self.name, None, *first, f"returned {got} rewards for {n} rows", batch_size=n)
        return raw

    def _format(self, batch: RewardBatch, i: int) -> float:
        from megatron_gspo.data.rewards.format import format_reward

        return format_reward(batch.prompts[i], batch.responses[i], batch.answers[i], **self.format_settings)

    def close(self) -> None:
        close = getattr(self.main, "close", None)  # optional for a reward class
        if close is not None:
            close()


def instantiate(spec: RewardSpec, settings: dict, num_workers: int = 1) -> BatchReward:
    """The BatchReward of ``spec`` with its (checked) settings: a class built once (given ``num_workers`` if
    its constructor takes it), a batch function bound, a per-sample function adapted (per_sample.PerSampleReward)."""
    if spec.kind == "class":
        extra = {NUM_WORKERS: num_workers} if NUM_WORKERS in _constructor_parameters(spec.target) else {}
        return spec.target(**settings, **extra)
    if spec.kind == "batch":
        return BatchFunctionReward(spec, settings)
    return PerSampleReward(spec, settings, num_workers)


def _constructor_parameters(cls: type) -> list[str]:
    try:
        return list(inspect.signature(cls).parameters)
    except (TypeError, ValueError):
        return []


def build_reward(cfg: RewardConfig) -> Reward:
    """The reward a ``reward:`` section describes: ``reward.name`` resolved (registry.py), ``reward.kwargs``
    and ``reward.format_kwargs`` checked by key against what each reward declares (settings.py): a
    ConfigError naming the key at start-up, before any worker process starts."""
    spec = resolve_reward(cfg.name)
    settings = check_settings(spec, cfg.kwargs, "reward.kwargs")
    check_signature(spec, settings)
    format_settings = check_settings(resolve_reward("format"), cfg.format_kwargs, "reward.format_kwargs")
    weight = float(cfg.format_weight)
    name = cfg.name + (f" + {weight:g}*format" if weight else "")
    return Reward(instantiate(spec, settings, cfg.num_workers), name, format_settings, weight)


def function_name(fn: Callable) -> str:
    """How errors name a function handed to compute_rewards: its registered name, else module:qualname."""
    for name in registered_rewards():
        spec = registered_spec(name)
        if spec is not None and spec.target is fn:
            return name
    return f"{getattr(fn, '__module__', '?')}:{getattr(fn, '__qualname__', repr(fn))}"


def compute_rewards(reward: Union[Reward, Callable], prompts: Sequence[str], responses: Sequence[str],
                    answers: Optional[Sequence] = None, *, device: Union[str, torch.device] = "cpu",
                    should_stop: Optional[Callable[[], bool]] = None) -> torch.Tensor:
    """Score every (prompt, response, answer): a float32 tensor of shape [len(responses)] on ``device`` (the
    trainer passes the parallel state's device: rewards meet log-probs there). ``reward``: the job's Reward
    (build_reward), or a per-sample function (scored here, one row at a time). Cancelled when
    ``should_stop()`` cut it short; RewardError naming the reward and the row for a bad value."""
    if not isinstance(reward, Reward):
        name = function_name(reward)
        reward = Reward(PerSampleReward(spec_of(reward, name), {}), name)
    return reward.score(prompts, responses, answers, device=device, should_stop=should_stop)
