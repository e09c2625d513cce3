"""Run one Trainer job inside the test process (for tests that read the metrics it logs)."""

import contextlib
import json
import os
from typing import Callable, Iterator


def run_job_rows(cfg) -> list[dict]:
    """Run a Trainer on ``cfg`` in this process (closed and torn down afterwards) and return the
    rows of its metrics.jsonl."""
    from megatron_gspo.runtime import parallel
    from megatron_gspo.trainer.loop import Trainer

    t = Trainer(cfg)
    try:
        t.run()
    finally:
        t.close()
        parallel.destroy()
    with open(os.path.join(cfg.train.output_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


@contextlib.contextmanager
def built_trainers(base: list, out_dir) -> Iterator[Callable[[list], object]]:
    """``build(overrides)`` -> a Trainer of ``base + overrides`` (no YAML) with its optimizer set up,
    writing under out_dir/<n>; every trainer built is closed and the process group torn down on exit."""
    from megatron_gspo.runtime import parallel
    from megatron_gspo.config import load_job_config
    from megatron_gspo.trainer.loop import Trainer
    from megatron_gspo.trainer.optim import setup_optimizer

    made = []

    def build(overrides: list):
        made.append(t := Trainer(load_job_config(None, list(base) + [f"train.output_dir={out_dir}/{len(made)}"] + overrides)))
        t.optimizer, t.scheduler, t.step = setup_optimizer(  # the RL optimizer (and a resume's state)
            t.cfg, t.state, t.ddp, t.checkpoints, t.sampler, t.ref_model, t.step)
        return t

    try:
        yield build
    finally:
        for t in made:
            t.close()
        parallel.destroy()


def stop_when_ready(cmd: list, env: dict, log_path, ready: Callable[[], bool], startup_s: float = 240,
                    wait_s: float = 60) -> tuple:
    """Start ``cmd`` (a job) with its output in ``log_path``; once ``ready()`` (the phase under test has begun),
    SIGTERM it and wait up to ``wait_s``: (exit code or None, seconds from the signal to the job's
    "preempted by signal" line or None, seconds from the signal to its exit). The job is killed on the way out."""
    import signal
    import subprocess
    import time

    with open(log_path, "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True)
        try:
            deadline = time.time() + startup_s
            while not ready():
                assert p.poll() is None and time.time() < deadline, open(log_path).read()[-3000:]
                time.sleep(0.1)
            sent = time.time()
            p.send_signal(signal.SIGTERM)
            said = None  # when the stop line came
            while p.poll() is None and time.time() < sent + wait_s:
                if said is None and "preempted by signal" in open(log_path).read():
                    said = time.time() - sent
                time.sleep(0.05)
            return p.poll(), said, time.time() - sent
        finally:
            if p.poll() is None:
                p.kill()
