"""train.loggers: tensorboard, {train.output_dir}/tensorboard/ (scalars and histograms)."""

from __future__ import annotations

import os
from typing import Mapping

import torch

from megatron_gspo.runtime.trackers.base import Tracker
from megatron_gspo.runtime.writable import describe_os_error


class TensorBoardTracker(Tracker):
    name = "tensorboard"

    def __init__(self, output_dir: str) -> None:
        self.dir = os.path.join(output_dir, "tensorboard")
        self.writer = None

    def start(self, first_step: int) -> None:
        from torch.utils.tensorboard import SummaryWriter

        # a resumed run's events from its first step on (an earlier attempt's, past the checkpoint) are hidden
        self.writer = SummaryWriter(self.dir, purge_step=first_step)

    def log(self, step: int, scalars: Mapping[str, float], histograms: Mapping[str, torch.Tensor]) -> None:
        for k, v in histograms.items():
            self.writer.add_histogram(k, v, step)
        for k, x in scalars.items():
            self.writer.add_scalar(k, x, step)
        self.writer.flush()

    def close(self) -> None:
        if self.writer is not None:
            writer, self.writer = self.writer, None
            writer.close()

    def failure(self, e: Exception) -> str:
        return describe_os_error(e, self.dir) if isinstance(e, OSError) else super().failure(e)

