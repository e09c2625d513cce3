"""An out-of-memory error that says what to change, instead of a CUDA allocator trace.

``torch.OutOfMemoryError`` raised inside a phase of the RL step (generation, the log-prob passes,
the training forward/backward, the SFT warm start) is re-raised as ``errors.MemoryBudgetError``
naming the phase, the shapes it was running, the config knobs that set those shapes (with their
current values) and the per-GPU estimate of the config (memory_estimate.py), e.g.::

    out of memory in the training forward/backward (micro-batch of 64 rows x 576 tokens) on cuda:0:
    CUDA out of memory. Tried to allocate 9.35 GiB ... -- estimate for this config: 83.1 GiB per GPU of
    79.6 (training activations 61.2 GiB, generation 4.7 GiB; python launch/memory_estimate.py <config>)
    -- knobs: train.micro_batch_size=64 (lower it), train.max_tokens_per_micro_batch=null (a token budget ...

It is a user error (exit status 2, one line from the entry point): the fix is a config change.

Out of memory is not only ``torch.OutOfMemoryError`` (the CUDA caching allocator's): on the CPU the
allocator raises a RuntimeError (``DefaultCPUAllocator: can't allocate memory``), Python a
MemoryError, the kernel ENOMEM; ``is_out_of_memory`` knows them all and every phase re-raises each
of them the same way. The model build and the optimizer's states are phases too ("model",
"optimizer"), and ``check_model_fits`` refuses, before the build, a job whose weights, gradients and
optimizer states alone (the estimate's static part) exceed what one rank has: the GPU's memory, or
on the CPU the machine's memory, its memory cgroup's limit (a job scheduler's or a container's:
crossing it ends in the kernel's OOM killer, a SIGKILL no code can report) and the process's
rlimits, whichever is lowest.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import os
import re
from typing import Iterator, Optional

import torch

from megatron_gspo.errors import MemoryBudgetError

# torch >= 2.5 names it torch.OutOfMemoryError (the same class as torch.cuda.OutOfMemoryError)
TorchOOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

# what an allocation failure that is not a TorchOOM says: c10's CPU allocator ("DefaultCPUAllocator:
# can't allocate memory: you tried to allocate ..."), a CUDA API call ("CUDA error: out of memory"),
# errno ENOMEM's text ("Cannot allocate memory")
_ALLOCATION_FAILED = re.compile(r"can't allocate memory|cannot allocate memory|out of memory", re.IGNORECASE)


def is_out_of_memory(error: BaseException) -> bool:
    """Whether ``error`` is an allocation failure: torch's OutOfMemoryError, Python's MemoryError, an
    ENOMEM OSError, or a RuntimeError from an allocator (never a MemoryBudgetError: it explains one)."""
    if isinstance(error, MemoryBudgetError):
        return False
    if isinstance(error, (TorchOOM, MemoryError)):
        return True
    if isinstance(error, OSError):
        return error.errno == errno.ENOMEM
    return isinstance(error, RuntimeError) and _ALLOCATION_FAILED.search(str(error)) is not None

# what each phase's memory grows with, as (knob, how to change it)
_KNOBS = {
    "generation": [("generation.max_new_tokens", "lower it"), ("train.prompts_per_step", "fewer rows per rank"),
                   ("generation.n_samples_per_prompt", "fewer rows per rank")],
    "training": [("train.micro_batch_size", "lower it"), ("train.max_tokens_per_micro_batch", "a token budget per micro-batch"),
                 ("model.recompute_granularity", "full: recompute activations")],
    # weights, fp32 main grads, Adam's states (and a reference copy for the KL): the model's size over
    # the ranks that shard it
    "model": [("model.preset", "a smaller model"), ("parallel.expert_model_parallel_size", "experts over more ranks"),
              ("parallel.tensor_model_parallel_size", "layers over more ranks"),
              ("parallel.use_distributed_optimizer", "Adam's states over the data-parallel ranks, on GPUs"),
              ("loss.kl_coef", "> 0 keeps a second copy of the weights")],
}
_PHASES = {
    "generation": ("generation", "generation"),
    "old_logprobs": ("old-log-prob / reference pass", "training"),
    "training": ("training forward/backward", "training"),
    "sft": ("SFT warm start", "training"),
    "model": ("model build", "model"),
    "optimizer": ("optimizer step", "model"),
}


def _get(cfg, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _fmt(v) -> str:
    return "null" if v is None else str(v)


def _on_cpu(device) -> bool:
    return str(device).split(":")[0] == "cpu"


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def local_ranks(cfg) -> int:
    """Ranks of this job that share this machine's memory (torchrun's LOCAL_WORLD_SIZE). With
    asynchronous rollouts some of them generate only and hold far less: counted as this rank alone,
    so that the check refuses only what cannot fit."""
    return 1 if cfg.rollout.is_async else max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))


def host_budget(ranks: int = 1) -> tuple[int, str]:
    """(bytes one rank may use, what sets it): the lowest of the machine's limits (sysinfo.memory_limits),
    those the machine's processes share divided among ``ranks``."""
    from megatron_gspo.runtime.sysinfo import memory_limits

    share = [(v if per_process else v // ranks, what + ("" if per_process or ranks == 1 else f", shared by {ranks} ranks"))
             for v, what, per_process in memory_limits()]
    return min(share)


def _cpu_estimate(cfg, world_size: int):
    """estimate_memory for a job on the CPU: the optimizer is never distributed there, and the
    process's imports (its resident set now) stand for the CUDA runtime's fixed overhead."""
    from megatron_gspo.model.memory_estimate import GIB, estimate_memory
    from megatron_gspo.runtime.sysinfo import current_rss

    par = dataclasses.replace(cfg.parallel, use_distributed_optimizer=False)
    return estimate_memory(dataclasses.replace(cfg, parallel=par), world_size, runtime_overhead_gib=current_rss() / GIB,
                           fragmentation=0.0)


def _static(r: dict) -> float:
    """GiB held from the build on, whatever the batch: weights, main grads, optimizer states, reference copy."""
    return r["weights"] + r["grads"] + r["optimizer"] + r["ref_model"] + r["fp8_cache"]


def _estimate(cfg, world_size: int, device=None) -> str:
    from megatron_gspo.model.memory_estimate import GIB, estimate_memory

    try:
        r = _cpu_estimate(cfg, world_size) if _on_cpu(device) else estimate_memory(cfg, world_size)
    except Exception as e:  # an estimate that cannot be made must not hide the out-of-memory error
        return f"no estimate for this config ({type(e).__name__}: {e})"
    if _on_cpu(device):
        budget, source = host_budget(local_ranks(cfg))
        return (f"estimate for this config: {r['total']:.1f} GiB per rank (weights, grads and optimizer states "
                f"{_static(r):.1f} GiB, training activations {r['train_act']:.1f} GiB, generation "
                f"{r['generation']:.1f} GiB; python launch/memory_estimate.py <config>) of the {budget / GIB:.1f} GiB "
                f"this process may use ({source})")
    return (f"estimate for this config: {r['total']:.1f} GiB per GPU of {r['budget']:.1f} (training activations "
            f"{r['train_act']:.1f} GiB, generation {r['generation']:.1f} GiB; python launch/memory_estimate.py <config>)")


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    if not text:
        return type(error).__name__
    # c10's allocator prefixes its own source line: "[enforce fail at alloc_cpu.cpp:127] err == 0. "
    return re.sub(r"^\[enforce fail at [^\]]*\] err == 0\.\s*", "", text.splitlines()[0])


def describe(phase: str, cfg, world_size: int, device, shapes: str, error: BaseException | str) -> str:
    """The MemoryBudgetError message (see the module docstring); ``error``: what failed, or in words
    what cannot fit (check_model_fits)."""
    title, group = _PHASES[phase]
    first = error if isinstance(error, str) else _first_line(error)
    knobs = ", ".join(f"{k}={_fmt(_get(cfg, k))} ({how})" for k, how in _KNOBS[group])
    return (f"out of memory in the {title} ({shapes}) on {device}: {first} -- {_estimate(cfg, world_size, device)} -- "
            f"knobs: {knobs}; see docs/troubleshooting.md#out-of-memory")


@contextlib.contextmanager
def explain_oom(phase: str, cfg, state, shapes: str = "") -> Iterator[None]:
    """Re-raise an allocation failure in the block (is_out_of_memory: torch's, the CPU allocator's,
    Python's, the kernel's) as MemoryBudgetError (see the module doc).

    phase: "generation" | "old_logprobs" | "training" | "sft" | "model" | "optimizer"; cfg: the
    JobConfig; state: the ParallelState (device, world size); shapes: what the block runs, for the message."""
    try:
        yield
    except (TorchOOM, MemoryError, RuntimeError, OSError) as e:
        if not is_out_of_memory(e):
            raise
        raise MemoryBudgetError(describe(phase, cfg, state.world_size, state.device, shapes, e)) from e


def model_shapes(cfg) -> str:
    """The model in a few words, for the "model" and "optimizer" phases' messages."""
    m = cfg.model
    return f"{m.preset or 'custom'}: {m.num_parameters() / 1e9:.3g}B parameters, {m.precision}"


def check_model_fits(cfg, state, device_bytes: Optional[int] = None) -> None:
    """Refuse (MemoryBudgetError) a job whose static memory, the weights, fp32 main grads, optimizer
    states and reference copy of one rank (memory_estimate.py), cannot fit what that rank has, before
    anything is built: on the CPU the machine's memory (its cgroup's and rlimits included, shared by
    the job's ranks on the machine); on a GPU the device's memory (``device_bytes``: given, or asked
    of the device). Only where it clearly cannot fit: activations and generation, which depend on the
    batch, are left to the phases themselves (explain_oom)."""
    from megatron_gspo.model.memory_estimate import GIB, estimate_memory
    from megatron_gspo.runtime.sysinfo import current_rss

    cpu = _on_cpu(state.device)
    try:
        r = _cpu_estimate(cfg, state.world_size) if cpu else estimate_memory(cfg, state.world_size)
    except Exception:  # no estimate for this layout: nothing to check against
        return
    need = _static(r) * GIB + (current_rss() if cpu else 0)
    if cpu:
        budget, source = host_budget(local_ranks(cfg))
    else:
        budget = device_bytes if device_bytes is not None else torch.cuda.get_device_properties(state.device).total_memory
        source = f"the memory of {state.device}"
    if need <= budget:
        return
    ref = f", reference model {r['ref_model']:.1f}" if r["ref_model"] else ""
    why = (f"its weights, grads and optimizer states alone need {_gib(_static(r) * GIB)} per rank (weights "
           f"{r['weights']:.1f}, grads {r['grads']:.1f}, optimizer {r['optimizer']:.1f}{ref} GiB), more than the "
           f"{_gib(budget - (current_rss() if cpu else 0))} {'left to this process' if cpu else 'of ' + source}")
    raise MemoryBudgetError(describe("model", cfg, state.world_size, state.device, model_shapes(cfg), why))
