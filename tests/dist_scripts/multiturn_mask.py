"""A multi-turn job under torchrun whose loss mask is not the assistant turns' spans, and what its global batch moved
(tests/test_multiturn.py).

    torchrun --nproc-per-node N multiturn_mask.py [--plain-mask] --out DIR -- overrides...

run_job.py's job and evidence (metrics, rollouts.dp<r>.jsonl, weights/), with two changes (the first not with
--plain-mask):

* every assistant turn after a row's first starts with a *forced* token: sampled, kept in the row, but off the
  loss mask (as a prefilled tag would be). The turns' roles then no longer say the mask: a rank that rebuilt a
  row's mask from its turns would train on those tokens.
* each rank writes, per step, ``masks_rank<r>.jsonl``: {"step", "held": {slot: mask}, "got": {slot: mask}}, the
  loss masks (over the row's tokens) of the rows it generated and holds before the exchange (the generating
  rank's own), and of the rows it trains after it; and ``bytes_rank<r>.jsonl``: {"step", "received": {what:
  bytes}}, the bytes it received from the other ranks in each of the global batch's collectives of the step.
"""

import json
import os
import sys

import torch

import run_job
from megatron_gspo.rollout import colocated
from megatron_gspo.rollout.multiturn import MultiTurnRollout
from megatron_gspo.runtime import comm

_take = MultiTurnRollout._take


def forced_first_token(self, row, *args, **kwargs):
    ids = _take(self, row, *args, **kwargs)
    turn = row.turns[-1]
    if row.num_turns > 1 and turn["end"] > turn["start"]:
        row.mask[turn["start"]] = 0
    return ids


received: dict = {}


def _rank(group) -> int:
    return torch.distributed.get_rank(group)


def _count(what: str, n: int) -> None:
    if what.startswith("global batch"):
        received[what] = received.get(what, 0) + n


_all_gather, _all_to_all = comm.all_gather, comm.all_to_all_single


def all_gather(t, group=None, *, what):
    parts = _all_gather(t, group, what=what)
    if len(parts) > 1:
        _count(what, sum(p.numel() * p.element_size() for i, p in enumerate(parts) if i != _rank(group)))
    return parts


def all_to_all_single(out, t, group=None, *, what, out_splits=None, in_splits=None):
    got = _all_to_all(out, t, group, what=what, out_splits=out_splits, in_splits=in_splits)
    if comm.world_size(group) > 1:
        splits = out_splits or [out.shape[0] // comm.world_size(group)] * comm.world_size(group)
        row = out.element_size() * (out[0].numel() if out.dim() else 1)
        _count(what, row * (sum(splits) - splits[_rank(group)]))
    return got


_exchange = colocated.exchange
seen: dict = {}


def exchange(pool, where, *args, **kwargs):
    """colocated's exchange, the masks before and after written down."""
    local = _exchange(pool, where, *args, **kwargs)
    n = pool.seq_lengths.tolist()
    seen["held"] = {s: pool.loss_mask[i, :n[i]].long().tolist() for s, i in where.items()}
    m = local.seq_lengths.tolist()
    seen["got"] = {s: local.loss_mask[i, :m[i]].long().tolist() for i, s in enumerate(local.row_ids.tolist())}
    return local


_collect = colocated.ColocatedSource.collect


def collect(self, step):
    received.clear()
    seen.clear()
    rec = _collect(self, step)
    out, r = self.cfg.train.output_dir, self.state.dp_rank
    if self.state.tp_rank == 0:
        with open(os.path.join(out, f"bytes_rank{r}.jsonl"), "a") as f:
            f.write(json.dumps({"step": step + 1, "received": dict(received)}) + "\n")
        with open(os.path.join(out, f"masks_rank{r}.jsonl"), "a") as f:
            f.write(json.dumps({"step": step + 1, **seen}) + "\n")
    return rec


if __name__ == "__main__":
    if "--plain-mask" in sys.argv:
        sys.argv.remove("--plain-mask")
    else:
        MultiTurnRollout._take = forced_first_token
    comm.all_gather, comm.all_to_all_single = all_gather, all_to_all_single
    colocated.exchange = exchange
    colocated.ColocatedSource.collect = collect
    torch.set_num_threads(1)
    sys.argv[0] = run_job.__file__
    run_job.main()
