"""One run of the real entry point under torchrun on the CPU, timed: what the multi-rank benchmarks share
(async_rollout.py, layout_step.py, dp_balance.py). Each benchmark builds its job's overrides and reads
what it needs from the returned metrics rows."""

from __future__ import annotations

import json
import os
import resource
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass
from typing import Callable, Optional


@dataclass
class JobRun:
    """A finished run: its wall and CPU seconds (every process of the run, torchrun's included) and its
    metrics.jsonl rows (``timed``: without the first step, whose time holds the warm-up)."""

    wall_s: float
    cpu_s: float
    rows: list[dict]

    @property
    def timed(self) -> list[dict]:
        return self.rows[1:] or self.rows

    def stat(self, key: str, of: Callable = statistics.median) -> Optional[float]:
        """``of`` (median, fmean, ...) of ``key`` over the timed steps; None when no step logged it."""
        vals = [r[key] for r in self.timed if key in r]
        return of(vals) if vals else None


def run_job(overrides: list[str], out_dir: str, *, nproc: int, threads: int, tree: str, label: str,
            pythonpath: bool = True) -> JobRun:
    """``python -m torch.distributed.run --standalone --nproc-per-node nproc -m megatron_gspo.train
    overrides`` in ``tree`` (a checkout: this one, or another commit's for a before/after), one CPU per
    rank's ``threads`` torch threads, no CUDA device; the job writes to ``out_dir``. SystemExit with the
    run's output tails when it fails, naming ``label``."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
           "-m", "megatron_gspo.train", *overrides]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    if pythonpath:  # the tree's package, not the installed one
        env["PYTHONPATH"] = tree
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=tree)
    wall = time.perf_counter() - t0
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if p.returncode != 0:
        raise SystemExit(f"{label} failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(x) for x in f]
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return JobRun(wall, cpu, rows)
