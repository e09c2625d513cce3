"""The one interface every run tracker offers (``Tracker``), and ``Trackers``: the set a job writes to, which
keeps training going when one of them fails."""

from __future__ import annotations

import contextlib
import logging
from typing import Mapping, Optional, Sequence

import torch

log = logging.getLogger("megatron_gspo")


class Tracker:
    """One place the step's metrics go besides metrics.jsonl (train.loggers). Rank 0 only; the methods run in
    this order: ``start`` once (at the first row, so a job refused at start-up creates no run), ``log`` once
    per step, ``close`` at the end of the run (or when the tracker failed)."""

    name = ""  # its name in train.loggers

    def start(self, first_step: int) -> None:
        """Open (or continue) the run; ``first_step``: the first step this process logs."""

    def log(self, step: int, scalars: Mapping[str, float], histograms: Mapping[str, torch.Tensor]) -> None:
        """The step's finite scalars (what TensorBoard gets) and its non-empty histograms (1-D tensors)."""
        raise NotImplementedError

    def run(self) -> Optional[dict]:
        """What a resumed job needs to continue this run (its id), kept in the checkpoint; None: nothing."""
        return None

    def close(self) -> None:
        """Flush and end the run (a resumed job continues it); the tracker holds nothing after it."""

    def failure(self, e: Exception) -> str:
        """``e`` in a few words (the line that says the tracker is off)."""
        first = str(e).strip().splitlines()
        return f"{type(e).__name__}: {first[0]}" if first else type(e).__name__


class Trackers:
    """The trackers of a job. One that raises (no network, a bad key, a full disk, a bug in the library) is
    said in one line and dropped for the rest of the run: the metrics are a log, training goes on, and a
    tracker that failed is not tried again every step. What each started run needs to be continued stays
    readable (``runs``) after it is dropped, so a resume still continues it."""

    def __init__(self, trackers: Sequence[Tracker]) -> None:
        self.live = list(trackers)
        self.started: dict[str, dict] = {}  # name -> its run() once started

    def start(self, first_step: int) -> None:
        for t in list(self.live):
            if self._call(t, "at start-up", t.start, first_step):
                self._record(t)

    def log(self, step: int, scalars: Mapping[str, float], histograms: Mapping[str, torch.Tensor]) -> None:
        for t in list(self.live):
            self._call(t, f"at step {step}", t.log, step, scalars, histograms)

    def runs(self) -> dict[str, dict]:
        """{name: run} of every tracker that started a run (the checkpoint keeps it: logger_runs.json)."""
        return dict(self.started)

    def close(self) -> None:
        for t in list(self.live):
            self._call(t, "at the end of the run", t.close)
        self.live = []

    def _record(self, t: Tracker) -> None:
        run = t.run()
        if run is not None:
            self.started[t.name] = run

    def _call(self, t: Tracker, when: str, fn, *args) -> bool:
        try:
            fn(*args)
            return True
        except Exception as e:  # noqa: BLE001 (any failure of a tracker: it is a log, never the run's end)
            self.live.remove(t)
            log.warning("train.loggers: %s failed %s and is off for the rest of the run (training, metrics.jsonl "
                        "and the other loggers go on): %s", t.name, when, t.failure(e))
            if fn != t.close:
                with contextlib.suppress(Exception):
                    t.close()
            return False
