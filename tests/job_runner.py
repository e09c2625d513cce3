"""Run one Trainer job inside the test process (for tests that read the metrics it logs)."""

import json
import os


def run_job_rows(cfg) -> list[dict]:
    """Run a Trainer on ``cfg`` in this process (closed and torn down afterwards) and return the
    rows of its metrics.jsonl."""
    from megatron_gspo import parallel
    from megatron_gspo.trainer import Trainer

    t = Trainer(cfg)
    try:
        t.run()
    finally:
        t.close()
        parallel.destroy()
    with open(os.path.join(cfg.train.output_dir, "metrics.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]
