"""Load a converted (HF -> Megatron) checkpoint under several TP / EP layouts in one torchrun job
and compare the gathered, un-padded logits with transformers' logits on the same tokens.

Layouts run one after the other in the same processes (megatron's groups are rebuilt per layout;
ranks beyond TP x EP are data-parallel replicas), which keeps the test to one launch.

With --save-dir, under each of --save-layouts (the trainer side of the export test): perturb every
weight (a deterministic function of its value, so TP / DP replicas stay identical), save the model
the way megatron_gspo does (``checkpoint.save_model``: keys unprefixed) plus ``model_config.yaml``
and, for the first layout, once more under a ``model.`` key prefix next to fake optimizer entries
and once with the trainer's ``save_checkpoint`` (save root, iter_ directory, job config in
common.pt); record the perturbed logits.
"""

import argparse
import os
import shutil
import sys

import torch
import torch.distributed as dist

from checkpoints_tools.megatron_to_hf import load_model_config
from megatron_gspo.runtime import parallel
from megatron_gspo.checkpoint import load_model, save_checkpoint, save_model
from megatron_gspo.config import ParallelConfig, to_dict
from megatron_gspo.model.gpt import build_model, forward_logits, unwrap

LAYOUTS = {"tp1": (1, 1), "tp2": (2, 1), "ep2": (1, 2), "tp2ep2": (2, 2)}


def full_logits(model, tokens, st, vocab):
    with torch.no_grad():
        x = forward_logits(model, tokens).detach()
    if st.tp > 1:
        parts = [torch.empty_like(x) for _ in range(st.tp)]
        dist.all_gather(parts, x.contiguous(), group=st.tp_group)
        x = torch.cat(parts, dim=-1)
    return x[..., :vocab]


def save_trainer_checkpoints(model, st, cfg_path, ref, vocab, save_dir, tag, prefixed):
    with torch.no_grad():
        for p in unwrap(model).parameters():
            p.add_(0.05 * torch.sin(37.0 * p + 1.0))
    logits = full_logits(model, ref["tokens"], st, vocab)
    plain = os.path.join(save_dir, f"trainer_{tag}_plain")
    save_model(model, plain)
    if prefixed:
        from megatron.core import dist_checkpointing

        # the trainer's own layout: <root>/iter_0000005 + tracker, the job config in common.pt
        save_checkpoint(os.path.join(save_dir, f"trainer_{tag}_root"), 5, model,
                        extra={"config": {"model": to_dict(load_model_config(cfg_path))}}, is_main=st.is_main)

        path = os.path.join(save_dir, f"trainer_{tag}_prefixed")
        os.makedirs(path, exist_ok=True)
        m = unwrap(model)
        dist_checkpointing.save({"model": m.sharded_state_dict(prefix="model."),
                                 "optimizer": m.sharded_state_dict(prefix="optimizer.state.exp_avg.")}, path)
    if st.rank == 0:
        shutil.copy(cfg_path, os.path.join(plain, "model_config.yaml"))
        torch.save({"tokens": ref["tokens"], "logits": logits}, os.path.join(save_dir, f"trainer_{tag}_logits.pt"))
    dist.barrier()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ckpt", required=True)
    ap.add_argument("--ref", required=True, help="torch file with tokens and HF logits")
    ap.add_argument("--layouts", default="tp1,tp2,ep2,tp2ep2")
    ap.add_argument("--save-dir", default=None)
    ap.add_argument("--save-layouts", default="ep2,tp2ep2", help="the first also saves a model.-prefixed copy")
    a = ap.parse_args()

    cfg_path = os.path.join(a.ckpt, "model_config.yaml")
    cfg = load_model_config(cfg_path)
    ref = torch.load(a.ref)
    failed = False
    for tag in a.layouts.split(","):
        tp, ep = LAYOUTS[tag]
        par = ParallelConfig(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, seed=3)
        st = parallel.initialize(cfg, par)
        model = build_model(cfg, par, st)
        load_model(model, a.ckpt)
        model.eval()
        logits = full_logits(model, ref["tokens"], st, cfg.vocab_size)
        err = (logits - ref["logits"]).abs().max().item()
        print(f"[rank {st.rank}] {tag} (tp={tp} ep={ep} dp={st.dp}) logits vs transformers max abs diff "
              f"{err:.3e} (scale {ref['logits'].abs().max().item():.3f})", flush=True)
        if not err <= 1e-4:
            print(f"PARITY FAILURE {tag}: {err}", flush=True)
            failed = True
        save_layouts = a.save_layouts.split(",")
        if a.save_dir and tag in save_layouts:
            save_trainer_checkpoints(model, st, cfg_path, ref, cfg.vocab_size, a.save_dir, tag,
                                     prefixed=tag == save_layouts[0])
        del model
    parallel.destroy()
    sys.exit(3 if failed else 0)


if __name__ == "__main__":
    main()
