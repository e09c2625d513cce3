"""vocab_parallel_logprobs under TP=2 equals log_softmax(...).gather(...) on the full vocabulary,
values and gradients, with padded vocabulary columns and a temperature."""

import sys

import torch
import torch.distributed as dist

from megatron_gspo.logprobs import vocab_parallel_logprobs


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
    print(f"rank {rank} {errs}", flush=True)
    dist.destroy_process_group()
    sys.exit(0 if max(errs.values()) < 1e-5 else 3)


if __name__ == "__main__":
    main()
