"""DP=2 half of tests/test_metrics_dp.py: two gloo processes, each holding half of a global batch.

    python tests/dist_scripts/metrics_dp.py --out result.pt

Each rank splits its half into two micro-batches, computes every loss in CONFIGS with the global
normalizer (all-reduced ``batch_normalizer``), accumulates the metrics with MetricAccumulator,
reduces them over the group, and all-reduces (SUM) the gradient of a parameter shared by all
rows. Rank 0 saves the results; the test compares them with one process on the whole batch.
The batch and the configs live here so both sides build exactly the same thing.
"""

from __future__ import annotations

import argparse
import os
from datetime import timedelta

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


from megatron_gspo.algorithms.losses import LossConfig, batch_normalizer, compute_policy_loss
from megatron_gspo.runtime.metrics import Metric, MetricAccumulator, reduce_metrics

WORLD = 2
B, T, F = 8, 16, 3

CONFIGS = [
    LossConfig(name="gspo"),
    LossConfig(name="gspo_token", kl_coef=0.05),
    LossConfig(name="grpo"),
    LossConfig(name="grpo", loss_agg_mode="seq-mean-token-mean", entropy_coef=0.01),
    LossConfig(name="grpo", loss_agg_mode="seq-mean-token-sum-norm", loss_agg_norm_constant=T,
               dual_clip_c=1.02, kl_coef=0.05, clip_ratio_low=0.005, clip_ratio_high=0.01),
    # GSPO's successors: token units (cispo token-mean), sequence units, LUSPO's length weights
    LossConfig(name="sapo", kl_coef=0.05),
    LossConfig(name="cispo", entropy_coef=0.01),
    LossConfig(name="cispo", loss_agg_mode="seq-mean-token-mean", clip_ratio_low=0.001, clip_ratio_high=0.001),
    LossConfig(name="gmpo", kl_coef=0.05, clip_ratio_low=0.002, clip_ratio_high=0.002),
    LossConfig(name="luspo", kl_coef=0.05, entropy_coef=0.01),
]


def make_batch(seed: int = 0) -> dict[str, torch.Tensor]:
    """A global batch whose log-probs depend on a shared parameter theta (like model weights)."""
    g = torch.Generator().manual_seed(seed)
    # Uneven lengths: rows 0-3 (rank 0) are short, rows 4-7 (rank 1) long, row 2 is empty, so
    # per-rank means differ from global means and a wrong normalizer shows.
    lengths = torch.tensor([3, 5, 0, 2, 12, 16, 9, 14])
    starts = torch.tensor([1, 0, 0, 4, 2, 0, 3, 1])
    pos = torch.arange(T)[None]
    mask = (pos >= starts[:, None]) & (pos < (starts + lengths)[:, None])
    base = torch.randn(B, T, generator=g) * 0.3 - 2.0
    feat = torch.randn(B, T, F, generator=g)
    theta = torch.randn(F, generator=g) * 1e-3
    old = base + feat @ theta - 3e-4 * torch.randn(B, 1, generator=g) - 2e-3 * torch.randn(B, T, generator=g)
    return dict(
        mask=mask, base=base, feat=feat, theta=theta, old=old,
        ref=base + 0.05 * torch.randn(B, T, generator=g),
        entropy=torch.rand(B, T, generator=g),
        adv=torch.randn(B, generator=g),
    )


def loss_on_rows(cfg: LossConfig, batch: dict, rows: slice, theta: torch.Tensor, normalizer=None):
    logp = batch["base"][rows] + batch["feat"][rows] @ theta
    return compute_policy_loss(
        cfg, logp, batch["old"][rows], batch["adv"][rows], batch["mask"][rows],
        ref_logp=batch["ref"][rows], entropy=batch["entropy"][rows], global_batch_normalizer=normalizer,
    )


def rank_micro_batches(rank: int) -> list[slice]:
    """Rank r holds rows [r*B/2, (r+1)*B/2), split into two uneven micro-batches."""
    lo = rank * B // WORLD
    return [slice(lo, lo + 1), slice(lo + 1, lo + B // WORLD)]


def _worker(rank: int, store_file: str, out: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=WORLD,
                            timeout=timedelta(seconds=60))
    group = dist.group.WORLD
    batch = make_batch()
    micro = rank_micro_batches(rank)
    results = []
    for cfg in CONFIGS:
        norm = sum(batch_normalizer(cfg, batch["mask"][mb]) for mb in micro)
        dist.all_reduce(norm, group=group)
        theta = batch["theta"].clone().requires_grad_()
        acc = MetricAccumulator()
        loss_sum = torch.zeros(())
        for mb in micro:
            loss, metrics = loss_on_rows(cfg, batch, mb, theta, normalizer=norm)
            loss.backward()
            loss_sum += loss.detach()
            acc.add(metrics)
        grad = theta.grad.clone()
        dist.all_reduce(grad, group=group)
        dist.all_reduce(loss_sum, group=group)

        # What one gets without a global normalizer: local means, gradients averaged over ranks.
        theta_n = batch["theta"].clone().requires_grad_()
        rows = slice(micro[0].start, micro[-1].stop)
        naive_loss, _ = loss_on_rows(cfg, batch, rows, theta_n)
        naive_loss.backward()
        naive = theta_n.grad.clone()
        dist.all_reduce(naive, group=group)
        results.append(dict(metrics=acc.reduce(group), grad=grad, loss=loss_sum, naive_grad=naive / WORLD))

    # Misuse is reported, not silently summed: different names on the ranks, and group=None.
    errors = {}
    try:
        reduce_metrics({("a" if rank == 0 else "b"): Metric.mean(torch.ones(2))}, group)
    except ValueError as e:
        errors["mismatch"] = str(e)
    try:
        reduce_metrics({"a": Metric.mean(torch.ones(2))})
    except ValueError as e:
        errors["no_group"] = str(e)
    if rank == 0:
        torch.save(dict(results=results, errors=errors, world=dist.get_world_size(group)), out)
    dist.barrier(group)
    dist.destroy_process_group()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    args = p.parse_args()
    # a FileStore beside the output: no TCP port to race for
    store_file = os.path.abspath(args.out) + ".store"
    if os.path.exists(store_file):
        os.remove(store_file)
    mp.spawn(_worker, args=(store_file, args.out), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
