"""From prompts to a training batch: generate, score, advantages, old log-probs.

Token grid. Generation returns right-padded rows ``tokens [B, T]`` (prompt from column 0, then
the response, then pad) with ``response_mask [B, T]``. Training forwards ``tokens[:, :-1]`` and
scores ``tokens[:, 1:]``, so every per-token tensor used by the losses lives on the shifted
``[B, T-1]`` grid: ``mask = response_mask[:, 1:]``. The last token of a row is never an input,
which is also why routing recorded during generation (R3) needs no route for it.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.distributed as dist

from megatron_gspo.logprobs import vocab_parallel_logprobs
from megatron_gspo.model import forward_logits

# Called around each micro-batch forward with its index: routing replay/monitor hooks use it.
MicroBatchHook = Optional[Callable[[int], "object"]]


@dataclass
class RolloutBatch:
    """One rank's share of a step's rollouts on the shifted [B, T-1] grid (see module doc)."""

    tokens: torch.Tensor  # [B, T] long
    mask: torch.Tensor  # [B, T-1] bool: response tokens among the targets tokens[:, 1:]
    rewards: torch.Tensor  # [B] fp32
    advantages: torch.Tensor  # [B] fp32
    sample_logprobs: torch.Tensor  # [B, T-1] fp32, from the generator
    old_logprobs: Optional[torch.Tensor] = None  # [B, T-1] fp32, recomputed by the training model
    ref_logprobs: Optional[torch.Tensor] = None  # [B, T-1] fp32, reference policy (KL)
    sample_ids: list = field(default_factory=list)  # "<prompt id>#<sample>" per row, for error reports
    response_texts: list = field(default_factory=list)
    timings: dict = field(default_factory=dict)

    @property
    def num_rows(self) -> int:
        return self.tokens.shape[0]

    def rows(self, idx: slice) -> "RolloutBatch":
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return RolloutBatch(
            tokens=self.tokens[idx], mask=self.mask[idx], rewards=self.rewards[idx],
            advantages=self.advantages[idx], sample_logprobs=self.sample_logprobs[idx],
            old_logprobs=pick(self.old_logprobs), ref_logprobs=pick(self.ref_logprobs),
            sample_ids=self.sample_ids[idx],
        )


def common_length(length: int, multiple_of: int = 1, group=None) -> int:
    """A token-grid width T shared by every rank of ``group`` with (T - 1) % multiple_of == 0.

    With the allgather MoE dispatcher every forward is a collective over the TP x EP ranks and
    needs the same [b, s] on each; under sequence parallel the forward's input ``tokens[:, :-1]``
    is split over TP, so its length must divide by TP.
    """
    T = torch.tensor([length], dtype=torch.long)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(T, op=dist.ReduceOp.MAX, group=group)
    return 1 + math.ceil((int(T.item()) - 1) / multiple_of) * multiple_of


def pad_columns(t: torch.Tensor, width: int, value) -> torch.Tensor:
    """Right-pad [B, T] to [B, width]."""
    return torch.nn.functional.pad(t, (0, width - t.shape[1]), value=value)


def micro_batch_slices(num_rows: int, num_minibatches: int, micro_batch_size: int) -> list[list[slice]]:
    """Rows of each minibatch, split into micro-batches of at most ``micro_batch_size``.

    The old-log-prob pass and the training pass use this one partition: routing replay and the
    routing monitor key their records by the flat index of a micro-batch in it.
    """
    per = num_rows // num_minibatches
    return [[slice(lo, min(lo + micro_batch_size, hi)) for lo in range(k * per, hi, micro_batch_size)]
            for k, hi in ((k, (k + 1) * per) for k in range(num_minibatches))]


@torch.no_grad()
def compute_logprobs(model, tokens: torch.Tensor, micro_batches: list[slice], vocab_size: int, tp_group,
                     temperature: float = 1.0, on_micro_batch: MicroBatchHook = None) -> torch.Tensor:
    """Forward-only per-token log-probs of tokens[:, 1:], one forward per row slice in
    ``micro_batches`` (which cover the rows in order): [B, T-1] fp32.

    ``on_micro_batch(i)`` may return a context manager entered around micro-batch i's forward
    (routing record / monitor capture)."""
    import contextlib

    out = []
    for i, rows in enumerate(micro_batches):
        mb = tokens[rows]
        ctx = on_micro_batch(i) if on_micro_batch is not None else contextlib.nullcontext()
        with ctx:
            logits = forward_logits(model, mb[:, :-1])
        lp, _ = vocab_parallel_logprobs(logits, mb[:, 1:], vocab_size, tp_group, temperature=temperature,
                                        with_entropy=False)
        out.append(lp)
    return torch.cat(out, dim=0)


class Timer:
    """Wall-clock sections of a step: ``with timer("generate"): ...``; ``timer.pop()`` -> dict."""

    def __init__(self) -> None:
        self.times: dict[str, float] = {}

    def __call__(self, name: str):
        import contextlib

        @contextlib.contextmanager
        def section():
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            yield
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

        return section()

    def pop(self) -> dict[str, float]:
        t, self.times = self.times, {}
        return t
