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
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch

from megatron_gspo.errors import MemoryBudgetError

# torch >= 2.5 names it torch.OutOfMemoryError (the same class as torch.cuda.OutOfMemoryError)
TorchOOM = getattr(torch, "OutOfMemoryError", torch.cuda.OutOfMemoryError)

# what each phase's memory grows with, as (knob, how to change it)
_KNOBS = {
    "generation": [("generation.max_new_tokens", "lower it"), ("train.prompts_per_step", "fewer rows per rank"),
                   ("generation.n_samples_per_prompt", "fewer rows per rank")],
    "training": [("train.micro_batch_size", "lower it"), ("train.max_tokens_per_micro_batch", "a token budget per micro-batch"),
                 ("model.recompute_granularity", "full: recompute activations")],
}
_PHASES = {
    "generation": ("generation", "generation"),
    "old_logprobs": ("old-log-prob / reference pass", "training"),
    "training": ("training forward/backward", "training"),
    "sft": ("SFT warm start", "training"),
}


def _get(cfg, dotted: str):
    section, key = dotted.split(".")
    return getattr(getattr(cfg, section), key)


def _fmt(v) -> str:
    return "null" if v is None else str(v)


def _estimate(cfg, world_size: int) -> str:
    from megatron_gspo.memory_estimate import estimate_memory

    try:
        r = estimate_memory(cfg, world_size)
    except Exception as e:  # an estimate that cannot be made must not hide the out-of-memory error
        return f"no estimate for this config ({type(e).__name__}: {e})"
    return (f"estimate for this config: {r['total']:.1f} GiB per GPU of {r['budget']:.1f} (training activations "
            f"{r['train_act']:.1f} GiB, generation {r['generation']:.1f} GiB; python launch/memory_estimate.py <config>)")


def describe(phase: str, cfg, world_size: int, device, shapes: str, error: BaseException) -> str:
    """The MemoryBudgetError message (see the module docstring)."""
    title, group = _PHASES[phase]
    first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    knobs = ", ".join(f"{k}={_fmt(_get(cfg, k))} ({how})" for k, how in _KNOBS[group])
    return (f"out of memory in the {title} ({shapes}) on {device}: {first} -- {_estimate(cfg, world_size)} -- "
            f"knobs: {knobs}; see docs/troubleshooting.md#out-of-memory")


@contextlib.contextmanager
def explain_oom(phase: str, cfg, state, shapes: str = "") -> Iterator[None]:
    """Re-raise a torch out-of-memory error in the block as MemoryBudgetError (see the module doc).

    phase: "generation" | "old_logprobs" | "training" | "sft"; cfg: the JobConfig; state: the
    ParallelState (device, world size); shapes: what the block runs, for the message."""
    try:
        yield
    except TorchOOM as e:
        raise MemoryBudgetError(describe(phase, cfg, state.world_size, state.device, shapes, e)) from e
