"""A per-sample reward function as a :class:`~megatron_gspo.data.rewards.batch.BatchReward`: the simple case
of the batch interface.

:class:`PerSampleReward` scores the rows one at a time in this process, reading the stop flag before each,
or, where the reward allows (``RewardSpec.parallel``) and ``reward.num_workers > 1``, in the job's worker
pool (runtime/workers.py, with worker.py's handler): a free worker takes the next row, so a slow row holds
one worker only. Each row's value is ``batch.score_one``'s in either place, so the rewards are the same, in
row order. A stop kills the workers at once (a row in progress is abandoned, which no reward's state can
mind: each row is scored alone) and raises runtime.stop.Cancelled; a worker that dies on a row fails that row (the
RewardError names it) and the next row starts another.
"""

from __future__ import annotations

from megatron_gspo.data.rewards.batch import BatchReward, RewardBatch, SampleFailed, score_one
from megatron_gspo.errors import ConfigError
from megatron_gspo.runtime.stop import Cancelled
from megatron_gspo.runtime.workers import HandlerLoadError, Request, WorkerPool

HANDLER = "megatron_gspo.data.rewards.worker:reward_handler"


class PerSampleReward(BatchReward):
    """A per-sample function as a BatchReward: in this process, one row at a time, reading the stop flag
    before each; or in a pool of ``num_workers`` processes when ``num_workers > 1`` and the reward allows it
    (``spec.parallel``). The rewards are the same, in row order, either way."""

    def __init__(self, spec, settings: dict, num_workers: int = 1) -> None:
        self.fn, self.settings, self.name, self.num_workers = spec.target, dict(settings), spec.name, num_workers
        # the pool starts its workers on its first batch: building it costs nothing
        self.pool = (WorkerPool(num_workers, HANDLER, {"name": spec.name, "settings": self.settings}, name="reward")
                     if num_workers > 1 and spec.parallel else None)

    def score(self, batch: RewardBatch) -> list:
        if self.pool is not None:
            return self._score_in_workers(batch)
        out = []
        for prompt, response, answer in batch.rows():
            if batch.should_stop():
                raise Cancelled("while scoring")
            out.append(score_one(self.fn, self.settings, prompt, response, answer))
        return out

    def _score_in_workers(self, batch: RewardBatch) -> list:
        try:
            replies = self.pool.run([Request(tuple(row)) for row in batch.rows()], None, batch.should_stop)
        except HandlerLoadError as e:
            raise ConfigError(f"reward {self.name!r} (reward.name): loading it in a reward worker process "
                              f"(reward.num_workers={self.num_workers}) failed: {e}") from None
        out = []
        for rep in replies:
            if rep.exit_status is not None:
                out.append(SampleFailed(f"its reward worker process exited with status {rep.exit_status} while "
                                        "scoring it"))
            elif rep.error is not None:  # score_one catches the reward's errors: this is the worker's
                out.append(SampleFailed(f"its reward worker failed: {rep.error}"))
            else:
                out.append(rep.value)
        return out

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()
