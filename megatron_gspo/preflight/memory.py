"""Peak memory of one RL step of a Qwen3-30B-A3B-shaped model cut to a few layers at full width,
beside the estimate for the same job (megatron_gspo/model/memory_estimate.py, which
launch/memory_estimate.py writes into the recipes), so the 30B recipes' estimates are
checked against a measurement.

Measured: on a GPU ``torch.cuda.max_memory_allocated`` over the step (tensors only: the estimate's
fixed CUDA/NCCL runtime allowance is reported apart); on a CPU the rise of the process's resident
set high-water mark (VmHWM) over the step, model build included. With two cuts (1 and 2 layers) the
difference is the per-layer figure, and 48 layers extrapolate as

    peak(48) ~= peak(1) + 47 x (peak(2) - peak(1))

i.e. the per-layer cost x 48 plus what does not grow with depth (embedding, output layer, logits).
"""

from __future__ import annotations

import gc
import os

import torch

from megatron_gspo.model.memory_estimate import estimate_memory
from megatron_gspo.preflight.context import Context
from megatron_gspo.preflight.runner import Skip
from megatron_gspo.runtime.sysinfo import current_rss, peak_rss, reset_peak_rss

GIB = 2**30
MEMORY_MODEL = "qwen3-30b-a3b"
FULL_LAYERS = 48
def _cut(ctx: Context, layers: int):
    return ctx.job(f"memory_{layers}l", model={"preset": MEMORY_MODEL, "num_layers": layers})


def measure_step_peak(ctx: Context, cfg) -> tuple[float, str]:
    """Peak bytes of building the model and one RL step of ``cfg`` on this device, and the method."""
    from megatron_gspo.preflight.training import run_steps

    gc.collect()
    if ctx.cuda:
        torch.cuda.empty_cache()
        base = torch.cuda.memory_allocated(ctx.device)
        torch.cuda.reset_peak_memory_stats(ctx.device)
        run_steps(cfg)
        torch.cuda.synchronize(ctx.device)
        return torch.cuda.max_memory_allocated(ctx.device) - base, "torch.cuda.max_memory_allocated"
    base = current_rss()
    if not reset_peak_rss():
        raise Skip("cannot reset the RSS high-water mark (/proc/self/clear_refs): no CPU peak")
    run_steps(cfg)
    return peak_rss() - base, "VmHWM rise over the step (RSS; the allocator may keep freed memory)"


def check_memory(ctx: Context):
    world = int(os.environ.get("WORLD_SIZE", 1))
    cuts = [1] if ctx.quick else [1, 2]
    estimates = {n: estimate_memory(_cut(ctx, n), world) for n in cuts}
    if not ctx.cuda:
        if ctx.quick:
            raise Skip(f"quick: one full-width layer of {MEMORY_MODEL} needs ~{estimates[1]['total'] - estimates[1]['runtime']:.0f} GiB "
                       "on the CPU (weights, fp32 grads, Adam)")
        avail = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_AVPHYS_PAGES") / GIB
        need = max(e["total"] - e["runtime"] for e in estimates.values())
        if need > 0.8 * avail:
            raise Skip(f"needs ~{need:.0f} GiB, {avail:.0f} GiB of memory available")
    data = {"model": MEMORY_MODEL, "world_size": world, "cuts": {}}
    for n in cuts:
        peak, method = measure_step_peak(ctx, _cut(ctx, n))
        e = estimates[n]
        data["cuts"][n] = {"measured_gib": peak / GIB, "estimate_gib": e["total"],
                           "estimate_without_runtime_gib": e["total"] - e["runtime"], "estimate": e}
        data["method"] = method
    one = data["cuts"][1]
    value = (f"{MEMORY_MODEL} cut to 1 layer: measured {one['measured_gib']:.2f} GiB, estimate "
             f"{one['estimate_without_runtime_gib']:.2f} GiB (+{estimates[1]['runtime']:.1f} runtime = "
             f"{one['estimate_gib']:.2f})")
    if len(cuts) == 2:
        per_layer = data["cuts"][2]["measured_gib"] - one["measured_gib"]
        full = one["measured_gib"] + (FULL_LAYERS - 1) * per_layer
        data.update(per_layer_gib=per_layer, extrapolated_48_layers_gib=full)
        value += f"; per layer {per_layer:.2f} GiB -> {FULL_LAYERS} layers on one device ~{full:.1f} GiB"
    return value + f" [{data['method'].split(' (')[0]}]", data
