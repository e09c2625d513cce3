"""Batch-shaped reward plug-ins used by tests: a batch function and a class (a stand-in for a reward
model: built once with its settings, it scores whole batches and is closed at the end)."""

from dataclasses import dataclass

from megatron_gspo.data.rewards import BatchReward, reward_function, setting


@dataclass
class ScaleSettings:
    scale: float = setting(1.0, gt=0)


@reward_function(batch=True, settings=ScaleSettings)
def scaled_lengths(batch, *, scale: float = 1.0):
    """``scale * len(response)`` per row, computed for the whole batch at once."""
    return [scale * len(r) for r in batch.responses]


@reward_function(batch=True)
def one_short(batch):
    """A broken batch reward: one reward fewer than rows."""
    return [0.0] * (len(batch) - 1)


class LengthModel(BatchReward):
    """Scores a batch as a reward model would (one call per batch); records its calls and its close."""

    instances: list = []

    def __init__(self, *, offset: float = 0.0, num_workers: int = 1) -> None:
        self.offset, self.num_workers, self.calls, self.closed = offset, num_workers, 0, False
        LengthModel.instances.append(self)

    def score(self, batch):
        self.calls += 1
        return [self.offset + len(r) for r in batch.responses]

    def close(self) -> None:
        self.closed = True
