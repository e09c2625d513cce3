"""Dynamic sampling at DP 2 with the kept rows dealt across ranks, their routes with them (tests/test_global_batch.py).

    torchrun --nproc-per-node 2 global_batch.py --mode R3|ref -- overrides...

One job (a process group each: one torchrun per mode), one step's rollout prepared and its first minibatch
trained (no update applied):
  R3   GRPO with routing replay R3 and the old-log-prob pass (dynamic sampling recomputes): the pass replays
       each row's batch routes; its log-probs against the sampling ones
  ref  GSPO without replay and without an old-log-prob pass: the rows' rollout routes are the reference of
       the routing change of the first (on-policy) minibatch
Every rank prints ``GLOBAL_BATCH {json}``: the mode, the generation rounds, the share of rows that moved
between ranks, its row count, the largest |old - sample| log-prob over response tokens (R3), and the
routing change of the first minibatch (changed / compared (token, k) choices, all ranks; NaN: none compared).
"""

import argparse
import json
import os
import sys

import torch

from megatron_gspo.config import load_job_config
from megatron_gspo.runtime import parallel
from megatron_gspo.runtime.metrics import MetricAccumulator
from megatron_gspo.trainer.loop import Trainer
from megatron_gspo.trainer.optim import setup_optimizer

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
JOB = ["parallel.device=cpu", "train.prompts_per_step=4", "generation.n_samples_per_prompt=4", "generation.max_new_tokens=6",
       "train.micro_batch_size=2", "train.num_minibatches=1", "train.tensorboard=false", "data.shuffle=false",
       "train.dynamic_sampling=true", f"reward.name={HERE}/reward_plugins.py:constant_for_odd_first_operand",
       "generation.stop_token_ids=[3,7,11]"]
MODES = {"R3": ["train.routing_replay=R3", "loss.name=grpo"], "ref": ["train.old_logprobs=rollout"]}


def run(mode: str, extra: list) -> dict:
    cfg = load_job_config(None, JOB + MODES[mode] + extra)
    t = Trainer(cfg)
    try:
        t.optimizer, t.scheduler, t.step = setup_optimizer(t.cfg, t.state, t.ddp, t.checkpoints, t.sampler,
                                                           t.ref_model, t.step)
        record = t.source.collect(0)
        batch = t.prepare(record)
        gap = float((batch.old_logprobs - batch.sample_logprobs).abs()[batch.mask].max())
        t.accumulate_gradients(batch, batch.minibatches[0], MetricAccumulator())
        t.routing.finish_step()
        routing = t.routing.step_metrics()  # NaN if no (token, k) choice was compared
        return {"mode": mode, "rank": t.state.rank, "rounds": record.stats["dynamic_sampling/rounds"],
                "moved_rows_frac": record.stats["rollout/dp_moved_rows_frac"], "rows": batch.num_rows,
                "old_vs_sample_max": gap, "routing_change": routing["routing/routing_change_frac"]}
    finally:
        t.close()
        parallel.destroy()


def main():
    argv = sys.argv[1:]
    split = argv.index("--") if "--" in argv else len(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=list(MODES), required=True)
    a = ap.parse_args(argv[:split])
    print("GLOBAL_BATCH " + json.dumps(run(a.mode, argv[split + 1:])), flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main()
