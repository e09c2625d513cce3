"""All-reduce and all-to-all bandwidth on the expert-parallel group: the two collectives of an MoE
step (gradient reduction, token dispatch). NCCL on GPUs, gloo on CPUs; the backend is reported.

The group comes from parallel.initialize with EP = the world size (or the user's
parallel.expert_model_parallel_size) on the 30B model's 128 experts; nothing is built on it."""

from __future__ import annotations

import time

import torch

from megatron_gspo.runtime import comm
from megatron_gspo.preflight.context import Context
from megatron_gspo.preflight.runner import Skip

SIZE_QUICK, SIZE_FULL = 4 << 20, 256 << 20  # bytes per rank
ITERS_QUICK, ITERS_FULL = 3, 10


def _ep_state(ctx: Context):
    from megatron_gspo.runtime import parallel

    if comm.world_size() < 2:
        raise Skip("single process (run under torchrun for the collectives)")
    cfg = ctx.job("collectives", model={"preset": "qwen3-30b-a3b"})
    par = cfg.parallel
    if par.expert_model_parallel_size == 1:
        par.expert_model_parallel_size = comm.world_size()
    return parallel.initialize(cfg.model, par)


def _bench(ctx: Context, fn, size: int) -> dict:
    """Seconds per call, the slowest rank's (a collective is as fast as its slowest member)."""
    iters = ITERS_QUICK if ctx.quick else ITERS_FULL
    fn()  # warm-up: connection set-up, NCCL communicator creation
    comm.barrier()
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    if ctx.cuda:
        torch.cuda.synchronize(ctx.device)
    dt = torch.tensor([(time.perf_counter() - t0) / iters], device=ctx.device)
    return {"seconds": float(comm.all_reduce(dt, "max", what="preflight collective timing").item()),
            "bytes": size, "iters": iters}


def _report(r: dict, n: int, bus_factor: float, backend: str) -> tuple[str, dict]:
    # bus bandwidth as nccl-tests defines it: what each link carries, comparable across sizes
    r.update(ranks=n, backend=backend, algbw_gbps=r["bytes"] / r["seconds"] / 1e9)
    r["busbw_gbps"] = r["algbw_gbps"] * bus_factor
    return (f"{r['busbw_gbps']:.3g} GB/s bus ({r['algbw_gbps']:.3g} GB/s alg), {r['bytes'] >> 20} MiB on "
            f"{n} ranks, {backend}"), r


def check_all_reduce(ctx: Context):
    state = _ep_state(ctx)
    group, n = state.pg.ep, comm.world_size(state.pg.ep)
    size = SIZE_QUICK if ctx.quick else SIZE_FULL
    t = torch.ones(size // 4, dtype=torch.float32, device=state.device)
    r = _bench(ctx, lambda: comm.all_reduce(t, "sum", group, what="preflight all-reduce"), size)
    return _report(r, n, 2 * (n - 1) / n, comm.backend_name(group))


def check_all_to_all(ctx: Context):
    state = _ep_state(ctx)
    group, n = state.pg.ep, comm.world_size(state.pg.ep)
    size = SIZE_QUICK if ctx.quick else SIZE_FULL
    numel = size // 4 // n * n  # equal chunks, one per rank
    t = torch.ones(numel, dtype=torch.float32, device=state.device)
    out = torch.empty_like(t)
    r = _bench(ctx, lambda: comm.all_to_all_single(out, t, group, what="preflight all-to-all"), numel * 4)
    return _report(r, n, (n - 1) / n, comm.backend_name(group))
