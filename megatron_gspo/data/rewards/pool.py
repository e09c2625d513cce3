"""A pool of worker processes scoring a per-sample reward in parallel (``reward.num_workers > 1``).

For CPU-bound verifiers in Python (a plug-in that runs code, parses, searches): the GIL keeps threads
from helping, so each worker is a process of its own (``python -m megatron_gspo.data.rewards.worker``,
not a fork of a trainer that holds a model and process groups) that loads the reward by its
``reward.name`` and takes one row at a time: a free worker gets the next row, so a slow row holds one
worker only. The rewards come back in row order, the same numbers whatever the number of workers (each
row is scored alone by the same function).

The workers are started on the first batch and kept; they ignore the stop signals (the trainer decides
when to stop) and exit when the pool closes their input, or when the trainer is gone. The stop flag is
read every 0.1 s while rows are out: when it is set the workers are killed at once (a row in progress
is abandoned, which no reward's state can mind: each row is scored alone) and ScoringStopped raised;
the next batch starts new ones. A worker that dies on a row fails that row (the RewardError names it).
"""

from __future__ import annotations

import atexit
import collections
import os
import subprocess
import sys
from multiprocessing.connection import Connection, wait
from typing import Optional

from megatron_gspo.data.rewards.batch import RewardBatch, SampleFailed, ScoringStopped
from megatron_gspo.errors import ConfigError

POLL_S = 0.1  # how often the stop flag is read while rows are out


class _Worker:
    """One worker process and its two pipes (rows in, rewards out); ``row``: the row it is scoring."""

    def __init__(self, name: str, settings: dict) -> None:
        task_r, task_w = os.pipe()
        result_r, result_w = os.pipe()
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # N workers: no thread pools each
        self.proc = subprocess.Popen([sys.executable, "-m", "megatron_gspo.data.rewards.worker", str(task_r),
                                      str(result_w)], pass_fds=(task_r, result_w), stdin=subprocess.DEVNULL,
                                     env=env, start_new_session=True)
        os.close(task_r)
        os.close(result_w)
        self.tasks, self.results = Connection(task_w, readable=False), Connection(result_r, writable=False)
        self.ready, self.row = False, None
        self.tasks.send(("init", name, settings, list(sys.path)))

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()
        self.tasks.close()
        self.results.close()

    def close(self, timeout_s: float = 5.0) -> None:
        self.tasks.close()  # end of input: the worker exits
        try:
            self.proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.results.close()


class RewardPool:
    """``size`` worker processes scoring the per-sample reward ``name`` (a registered name or a plug-in's
    import path) with ``settings``: ``score(batch)`` -> one float or SampleFailed per row, in row order;
    ``close()`` ends the workers (also done at exit)."""

    def __init__(self, name: str, settings: dict, size: int) -> None:
        self.name, self.settings, self.size = name, dict(settings), int(size)
        self.workers: list[_Worker] = []
        self._atexit = False

    def _start(self) -> None:
        while len(self.workers) < self.size:
            self.workers.append(_Worker(self.name, self.settings))
        if not self._atexit:
            atexit.register(self.close)
            self._atexit = True

    def score(self, batch: RewardBatch) -> list:
        self._start()
        rows, out = list(batch.rows()), [None] * len(batch)
        todo = collections.deque(range(len(rows)))
        while todo or any(w.row is not None for w in self.workers):
            for w in self.workers:
                if w.ready and w.row is None and todo:
                    w.row = todo.popleft()
                    try:
                        w.tasks.send(("score", w.row, *rows[w.row]))
                    except OSError:  # it died since its last answer (BrokenPipeError)
                        self._lost(w, out, batch)
            if batch.should_stop():
                self.kill()
                raise ScoringStopped()
            waiting = {w.results: w for w in self.workers if w.row is not None or not w.ready}
            for conn in wait(list(waiting), timeout=POLL_S):
                self._receive(waiting[conn], out, batch)
        return out

    def _receive(self, w: _Worker, out: list, batch: RewardBatch) -> None:
        try:
            msg = w.results.recv()
        except (EOFError, OSError):
            self._lost(w, out, batch)
            return
        if msg[0] == "ready":
            w.ready = True
        elif msg[0] == "failed":
            self.kill()
            raise ConfigError(f"reward {self.name!r} (reward.name): loading it in a reward worker process "
                              f"(reward.num_workers={self.size}) failed: {msg[1]}")
        else:  # ("scored", row, float or SampleFailed)
            out[msg[1]], w.row = msg[2], None

    def _lost(self, w: _Worker, out: list, batch: RewardBatch) -> None:
        """A worker died (its pipe closed): its row fails, a new worker takes its place."""
        status = w.proc.wait()
        if batch.should_stop():  # a stop signal that reached the worker too
            self.kill()
            raise ScoringStopped()
        if w.row is None:
            self.kill()
            raise RuntimeError(f"a reward worker process for {self.name!r} exited with status {status} before "
                               "it took a row")
        out[w.row] = SampleFailed(f"its reward worker process exited with status {status} while scoring it")
        w.kill()
        self.workers[self.workers.index(w)] = _Worker(self.name, self.settings)

    def kill(self) -> None:
        """End every worker now (a stop: the rows in progress are abandoned); the next batch starts new ones."""
        workers, self.workers = self.workers, []
        for w in workers:
            w.kill()

    def close(self) -> None:
        workers, self.workers = self.workers, []
        for w in workers:
            w.close()

    @property
    def pids(self) -> list[Optional[int]]:
        return [w.proc.pid for w in self.workers]
