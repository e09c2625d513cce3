"""A per-sample reward function as a :class:`~megatron_gspo.data.rewards.batch.BatchReward`: the simple case
of the batch interface.

:class:`PerSampleReward` scores the rows one at a time in this process, reading the stop flag before each,
or, where the reward allows (``RewardSpec.parallel``) and ``reward.num_workers > 1``, in a pool of worker
processes (pool.py). Each row's value is ``batch.score_one``'s in either place, so the rewards are the same,
in row order. The imports go one way: batch.py (the interface) <- pool.py (the workers) <- this module.
"""

from __future__ import annotations

from megatron_gspo.data.rewards.batch import BatchReward, RewardBatch, ScoringStopped, score_one
from megatron_gspo.data.rewards.pool import RewardPool


class PerSampleReward(BatchReward):
    """A per-sample function as a BatchReward: in this process, one row at a time, reading the stop flag
    before each; or in a pool of ``num_workers`` processes (pool.RewardPool) when ``num_workers > 1`` and
    the reward allows it (``spec.parallel``). The rewards are the same, in row order, either way."""

    def __init__(self, spec, settings: dict, num_workers: int = 1) -> None:
        self.fn, self.settings = spec.target, dict(settings)
        # the pool starts its workers on its first batch (RewardPool._start): building it costs nothing
        self.pool = RewardPool(spec.name, self.settings, num_workers) if num_workers > 1 and spec.parallel else None

    def score(self, batch: RewardBatch) -> list:
        if self.pool is not None:
            return self.pool.score(batch)
        out = []
        for prompt, response, answer in batch.rows():
            if batch.should_stop():
                raise ScoringStopped()
            out.append(score_one(self.fn, self.settings, prompt, response, answer))
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
