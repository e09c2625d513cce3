"""From prompts to a training batch: generate, score, advantages, old log-probs.

Token grid. Generation returns right-padded rows ``tokens [B, T]`` (prompt from column 0, then
the response, then pad) with ``response_mask [B, T]``. Training forwards ``tokens[:, :-1]`` and
scores ``tokens[:, 1:]``, so every per-token tensor used by the losses lives on the shifted
``[B, T-1]`` grid: ``mask = response_mask[:, 1:]``. The last token of a row is never an input,
which is also why routing recorded during generation (R3) needs no route for it.
"""

from __future__ import annotations

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


def pad_to_common_length(tokens: torch.Tensor, mask: torch.Tensor, logprobs: torch.Tensor,
                         pad_id: int, group=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-pad [B, T] tensors to the longest T over ``group``.

    With the allgather MoE dispatcher every forward is a collective over the TP x EP ranks and
    needs the same [b, s] on each; padding the whole rollout once keeps all micro-batches equal.
    """
    T = torch.tensor([tokens.shape[1]], dtype=torch.long)
    if group is not None and dist.is_initialized() and dist.get_world_size(group) > 1:
        dist.all_reduce(T, op=dist.ReduceOp.MAX, group=group)
    extra = int(T.item()) - tokens.shape[1]
    if extra == 0:
        return tokens, mask, logprobs
    pad = lambda t, v: torch.nn.functional.pad(t, (0, extra), value=v)  # noqa: E731
    return pad(tokens, pad_id), pad(mask, False), pad(logprobs, 0.0)


@torch.no_grad()
def compute_logprobs(model, tokens: torch.Tensor, micro_batch_size: int, vocab_size: int, tp_group,
                     temperature: float = 1.0, on_micro_batch: MicroBatchHook = None) -> torch.Tensor:
    """Forward-only per-token log-probs of tokens[:, 1:] in micro-batches: [B, T-1] fp32.

    ``on_micro_batch(i)`` may return a context manager entered around micro-batch i's forward
    (routing record / monitor capture)."""
    import contextlib

    out = []
    for i, s in enumerate(range(0, tokens.shape[0], micro_batch_size)):
        mb = tokens[s:s + micro_batch_size]
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
