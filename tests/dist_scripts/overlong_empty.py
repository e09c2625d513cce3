"""Overlong filtering on two data-parallel ranks: whether a minibatch is empty is decided alike on every rank.

    torchrun --nproc-per-node 2 overlong_empty.py --out FILE --truncated-on RANKS [--kept-on RANKS] -- overrides...

Every response of the ranks in --truncated-on ("0", "0,1") counts as truncated, none of those in
--kept-on does (overlong.truncated is replaced on those ranks); the others keep the real decision. One RL step runs with
train.overlong_filtering=true. Rank 0 writes FILE (JSON): whether the weights moved, the largest
difference of any parameter between the two replicas after the step, and the step's metrics.
"""

import argparse
import json
import math

import torch
import torch.distributed as dist

from megatron_gspo.runtime import parallel
from megatron_gspo.rollout import prepare as rollout  # where the batch's truncation flags are computed
from megatron_gspo.config import load_job_config
from megatron_gspo.train import DEMO_CONFIG, Trainer, configure_logging


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--truncated-on", default="")
    p.add_argument("--kept-on", default="")
    p.add_argument("overrides", nargs="*")
    a = p.parse_args()
    cfg = load_job_config(DEMO_CONFIG, a.overrides + ["train.overlong_filtering=true", "train.num_steps=1"])
    configure_logging(cfg)
    trainer = Trainer(cfg)
    rank = trainer.state.rank
    if str(rank) in a.truncated_on.split(","):
        rollout.truncated = lambda stopped, lengths, max_len: torch.ones_like(stopped)
    if str(rank) in a.kept_on.split(","):
        rollout.truncated = lambda stopped, lengths, max_len: torch.zeros_like(stopped)
    before = {n: q.detach().clone() for n, q in trainer.model.named_parameters()}
    history = trainer.run()["history"]
    moved = any(not torch.equal(before[n], q.detach()) for n, q in trainer.model.named_parameters())
    spread = 0.0  # the replicas must stay identical whatever each rank saw
    for n, q in trainer.model.named_parameters():
        other = [torch.empty_like(q.detach()) for _ in range(dist.get_world_size())]
        dist.all_gather(other, q.detach().contiguous())
        spread = max(spread, max(float((o - other[0]).abs().max()) for o in other))
    if rank == 0:
        row = history[0]
        with open(a.out, "w") as f:
            json.dump({"moved": moved, "replica_spread": spread, "finite": all(math.isfinite(v) for v in row.values()),
                       "empty_minibatches": row.get("train/empty_minibatches"), "loss": row["loss/loss"],
                       "num_sequences": row["loss/num_sequences"]}, f)
    trainer.close()
    parallel.destroy()


if __name__ == "__main__":
    main()
