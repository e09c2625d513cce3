"""vocab_parallel_logprobs under TP=2 equals log_softmax(...).gather(...) on the full vocabulary,
values and gradients, with padded vocabulary columns and a temperature; so does the fused
output-layer version (fused_logprobs.output_layer_logprobs: hidden states and this rank's weight
shard in, several vocabulary chunks, recomputed or kept logits), whose hidden-state gradient summed
over the TP ranks (megatron's mapping all-reduces it) and weight-shard gradient are checked too."""

import sys

import torch
import torch.distributed as dist

from megatron_gspo.model.fused_logprobs import output_layer_logprobs
from megatron_gspo.model.logprobs import vocab_parallel_logprobs


def main():
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)
    V_pad, V, T = 96, 90, 0.8
    full = torch.randn(3, 5, V_pad, generator=g, dtype=torch.float64).float()
    tgt = torch.randint(0, V, (3, 5), generator=g)
    w1, w2 = torch.randn(3, 5, generator=g), torch.randn(3, 5, generator=g)

    ref_x = full.clone().requires_grad_()
    ls = torch.log_softmax(ref_x[..., :V] / T, dim=-1)
    ref_lp = ls.gather(-1, tgt[..., None]).squeeze(-1)
    ref_h = -(ls.exp() * ls).sum(-1)
    ((ref_lp * w1).sum() + (ref_h * w2).sum()).backward()

    shard = V_pad // world
    x = full[..., rank * shard:(rank + 1) * shard].clone().requires_grad_()
    lp, h = vocab_parallel_logprobs(x, tgt, V, tp_group=dist.group.WORLD, temperature=T, chunk_tokens=4)
    ((lp * w1).sum() + (h * w2).sum()).backward()
    errs = {
        "lp": (lp - ref_lp).abs().max().item(),
        "ent": (h - ref_h).abs().max().item(),
        "grad": (x.grad - ref_x.grad[..., rank * shard:(rank + 1) * shard]).abs().max().item(),
    }
    errs.update(fused(rank, world, V_pad, V, T, tgt, w1, w2))
    print(f"rank {rank} {errs}", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if max(errs.values()) < 1e-5 else 3)


def fused(rank, world, V_pad, V, T, tgt, w1, w2):
    g = torch.Generator().manual_seed(1)
    h = 16
    hidden = torch.randn(3, 5, h, generator=g)
    weight = torch.randn(V_pad, h, generator=g) / 2
    ref_h, ref_w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ls = torch.log_softmax((ref_h @ ref_w.t())[..., :V] / T, dim=-1)
    ref_lp = ls.gather(-1, tgt[..., None]).squeeze(-1)
    ref_ent = -(ls.exp() * ls).sum(-1)
    ((ref_lp * w1).sum() + (ref_ent * w2).sum()).backward()
    shard = V_pad // world
    errs = {}
    # 16-row vocabulary chunks (the last shard holds the 6 padded rows); logits kept, then recomputed
    for keep in (1 << 30, 0):
        hid = hidden.clone().requires_grad_()
        w = weight[rank * shard:(rank + 1) * shard].clone().requires_grad_()
        lp, ent = output_layer_logprobs(hid, w, tgt, V, tp_group=dist.group.WORLD, temperature=T,
                                        chunk_bytes=16 * 4 * 15, keep_logits_bytes=keep)
        ((lp * w1).sum() + (ent * w2).sum()).backward()
        g_hidden = hid.grad.clone()
        dist.all_reduce(g_hidden)  # what the output layer's input mapping does in backward
        tag = "kept" if keep else "recomputed"
        errs[f"fused_lp_{tag}"] = (lp - ref_lp).abs().max().item()
        errs[f"fused_ent_{tag}"] = (ent - ref_ent).abs().max().item()
        errs[f"fused_grad_hidden_{tag}"] = (g_hidden - ref_h.grad).abs().max().item()
        errs[f"fused_grad_weight_{tag}"] = (w.grad - ref_w.grad[rank * shard:(rank + 1) * shard]).abs().max().item()
    return errs


if __name__ == "__main__":
    main()
