"""Weight sync across layout pairs in one torchrun world split into trainer and rollout ranks.

    torchrun --nproc-per-node N weight_sync.py --out DIR --rollout-ranks R --pair "T_OVERRIDES|R_OVERRIDES" ...

For each pair (comma-separated overrides of the trainer's and the rollout ranks' side), in one launch:
both sides build the tiny model in their own layout, the rollout ranks from the job's seed and the
trainer from another seed (the "trained" weights: every tensor differs before the sync); the trainer
streams its weights (tiny buckets: many of them, and tensors larger than a bucket) and each side saves
its weights with dist_checkpointing (global keys) to DIR/<pair>/trainer and DIR/<pair>/rollout.
Prints SYNCED <pair> <rank> <bytes> <buckets> per rank.

``--te SIDES`` (once per pair, in order; tests/te/, where Transformer Engine imports): the sides named
("trainer", "rollout", "both" or "none") build the Transformer Engine spec construct-only on the CPU
(model.build_model(construct_only=True)) instead of the local spec.
"""

import argparse
import dataclasses
import os
import time

from megatron_gspo.runtime import parallel
from megatron_gspo.rollout.layout import ROLLOUT, rollout_parallel_config
from megatron_gspo.rollout.side import join
from megatron_gspo.rollout.weight_sync import WeightReceiver, WeightSender
from megatron_gspo.checkpoint import save_model
from megatron_gspo.config import load_job_config
from megatron_gspo.model.init_weights import init_weights
from megatron_gspo.model.gpt import build_model

TRAINED_SEED = 777


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--rollout-ranks", type=int, required=True)
    ap.add_argument("--pair", action="append", required=True)
    ap.add_argument("--bucket-mb", type=float, default=0.01)
    ap.add_argument("--te", action="append", default=[], choices=("none", "trainer", "rollout", "both"))
    a = ap.parse_args()
    te_sides = a.te + ["none"] * (len(a.pair) - len(a.te))
    base = ["rollout.mode=async", f"rollout.world_size={a.rollout_ranks}", "rollout.max_staleness=0",
            f"rollout.weight_sync_bucket_mb={a.bucket_mb}"]
    side = None
    for i, pair in enumerate(a.pair):
        t_over, r_over = (x.split(",") if x else [] for x in pair.split("|"))
        shared = [o for o in t_over if o.startswith("model.")]
        cfg = load_job_config(None, base + t_over + [f"rollout.{o}" for o in r_over])
        if side is None:
            side = join(cfg)
        par = rollout_parallel_config(cfg) if side.role == ROLLOUT else cfg.parallel
        st = parallel.initialize(cfg.model, par, side=side)
        if side.control is None:
            side.open_bridge(st.device)
        te = te_sides[i] in ("both", side.role)
        model_cfg = dataclasses.replace(cfg.model, transformer_impl="transformer_engine") if te else cfg.model
        model = build_model(model_cfg, par, st, construct_only=te)
        bucket = int(cfg.rollout.weight_sync_bucket_mb * 2**20)
        if side.role == ROLLOUT:
            end = WeightReceiver(model, st, side.sync_pg, bucket)
            deadline = time.time() + 300
            while side.control.pushed_version() < i:
                assert time.time() < deadline, "no push announced"
                time.sleep(0.01)
            stats = end.receive()
        else:
            init_weights(model, TRAINED_SEED, st, init_method_std=cfg.model.init_method_std,
                         num_layers=cfg.model.num_layers)
            end = WeightSender(model, st, side.sync_pg, bucket)
            if side.on_bridge:
                side.control.announce_push(i)
            stats, err = end.push(i)
            assert err is None, err
        assert stats.version == i
        save_model(model, os.path.join(a.out, str(i), side.role))
        print(f"SYNCED {i} {side.role} {side.global_rank} {stats.bytes} {stats.buckets} {len(end.plan.units)} "
              f"{shared}", flush=True)
    side.close()
    parallel.destroy()


if __name__ == "__main__":
    main()
