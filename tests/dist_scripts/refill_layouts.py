"""A refilled decode batch (generation.max_batch_rows) over sharded weights against one rank: run under torchrun.

    torchrun --nproc-per-node 2 refill_layouts.py --dir D --layouts ep2,tp2

Phase 1 (reference): one rank per layout (pure data parallel), the tiny model from one seed, saved, and the
ragged prompts' rows generated with every row in one decode batch (max_batch_rows=0: the rows of all prompts,
sampled with stop tokens that end rows apart, compaction on), the R3 routes recorded (lean_layouts.py's).

Phase 2, per layout: the model rebuilt for it and loaded, each rank generating its share with
``generation.max_batch_rows=3``, eager and with the graph-ready step (graph_standin.StandInGraph: buckets of at
most 3 rows). Under EP the two data-parallel ranks hold 4 and 6 rows, so their queues differ and the lockstep
group steps until both have no row left. On every rank: the tokens, lengths and stop flags equal the reference
rows', the log-probs within 2e-5 (``compare`` of lean_layouts.py), the routes too; no decode step fed more than 3
rows, and every rank of the lockstep group ran the same number of forwards.

Prints "REFILL OK <layout> <eager|graph-ready> rank <r>"; exits non-zero on a mismatch.
"""

import argparse
import dataclasses
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # lean_layouts.py beside this one

import lean_layouts as ll  # noqa: E402
from graph_standin import StandInGraph  # noqa: E402

from megatron_gspo.checkpoint import load_model, save_model  # noqa: E402
from megatron_gspo.config import model_config_from_preset  # noqa: E402
from megatron_gspo.runtime import parallel  # noqa: E402

LAYOUTS = {"ep2": (1, 2, 1), "tp2": (2, 1, 2), "etp2": (1, 1, 2)}
ROWS = 3  # generation.max_batch_rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", required=True)
    ap.add_argument("--layouts", required=True, help=f"comma-separated, of {sorted(LAYOUTS)}")
    a = ap.parse_args()
    cfg = model_config_from_preset("tiny", moe_aux_loss_coeff=0.0, vocab_size=ll.VOCAB)
    ckpt = os.path.join(a.dir, "weights")
    model, st = ll.build(cfg, 1, 1, 1)
    save_model(model, ckpt)
    ps = ll.prompts("ragged")
    free, _ = ll.run(model, st, ps, ll.gen_configs([])["sampled"], range(5))
    stops = torch.bincount(free.tokens[free.response_mask], minlength=ll.VOCAB).topk(2).indices.tolist()
    gcfg = ll.gen_configs(stops)["sampled"]
    ref = ll.run(model, st, ps, gcfg, range(5))
    lengths = ref[0].response_lengths
    if not lengths.min() < lengths.max():
        ll.fail(f"the reference's rows all end together ({lengths.tolist()})")
    refill = dataclasses.replace(gcfg, max_batch_rows=ROWS)
    for tag in a.layouts.split(","):
        model, st = ll.build(cfg, *LAYOUTS[tag])
        load_model(model, ckpt)
        rows = ll.my_rows(st)
        for graphs in (False, True):
            case = f"{tag} {'graph-ready' if graphs else 'eager'}"
            got = ll.run(model, st, ps, refill, rows, graphs=graphs)
            diff = ll.compare(case, got, ref, rows, gcfg.n_samples_per_prompt)
            out = got[0]
            if graphs and not (StandInGraph.captures and set(StandInGraph.captures) <= {1, 2, ROWS}):
                ll.fail(f"{case}: captured buckets {StandInGraph.captures}, not within 1, 2, {ROWS}")
            n = torch.tensor([out.num_forwards, -out.num_forwards])
            dist.all_reduce(n, op=dist.ReduceOp.MAX, group=st.lockstep_group)
            if n[0].item() != -n[1].item():
                ll.fail(f"{case}: ranks ran {n[0].item()} and {-n[1].item()} forwards (lockstep broken)")
            if out.decode_row_steps > ROWS * (out.num_forwards - 1):
                ll.fail(f"{case}: {out.decode_row_steps} row-steps in {out.num_forwards - 1} decode steps of {ROWS} rows")
            print(f"[rank {st.rank}] {case}: rows {len(rows) * 2}, forwards {out.num_forwards}, fill "
                  f"{out.decode_live_row_steps / out.decode_row_steps:.3f}, log-prob max abs diff {diff:.2e}",
                  flush=True)
            print(f"REFILL OK {case} rank {st.rank}", flush=True)
    parallel.destroy()


if __name__ == "__main__":
    main()
