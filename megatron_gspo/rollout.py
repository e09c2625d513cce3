"""From prompts to a training batch: generate, score, advantages, old log-probs.

Global rows. A step's rollout is P prompts x G samples = R rows in prompt-major order (global row
g = prompt g // G, sample g % G), split into ``num_minibatches`` consecutive minibatches of R / M rows
(one optimizer step each). Data parallelism never changes which rows a minibatch holds: DP rank r
holds the r-th contiguous share of every minibatch (``local_rows``). Sampling noise is keyed by the
global row (sampling.py) and advantages are computed over the gathered rewards of all rows, so the
rollout, the minibatches and hence every update are the same under any DP / TP / EP layout.

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

from megatron_gspo import comm
from megatron_gspo.logprobs import vocab_parallel_logprobs
from megatron_gspo.model import forward_logits, input_padding_mask

# Called around each micro-batch forward with its index: routing replay/monitor hooks use it.
MicroBatchHook = Optional[Callable[[int], "object"]]


@dataclass
class RolloutBatch:
    """One rank's share of a step's rollouts on the shifted [B, T-1] grid (see module doc)."""

    tokens: torch.Tensor  # [B, T] long
    mask: torch.Tensor  # [B, T-1] bool: response tokens among the targets tokens[:, 1:]
    seq_lengths: torch.Tensor  # [B] long: prompt + response tokens (the rest of the row is padding)
    row_ids: torch.Tensor  # [B] long: global row index (prompt x G + sample) of each local row
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

    def input_padding_mask(self) -> torch.Tensor:
        """[B, T-1] bool: True where the forward's input ``tokens[:, :-1]`` holds no real token."""
        return input_padding_mask(self.seq_lengths, self.tokens.shape[1] - 1)

    def rows(self, idx: slice) -> "RolloutBatch":
        pick = lambda t: None if t is None else t[idx]  # noqa: E731
        return RolloutBatch(
            tokens=self.tokens[idx], mask=self.mask[idx], seq_lengths=self.seq_lengths[idx],
            row_ids=self.row_ids[idx], rewards=self.rewards[idx],
            advantages=self.advantages[idx], sample_logprobs=self.sample_logprobs[idx],
            old_logprobs=pick(self.old_logprobs), ref_logprobs=pick(self.ref_logprobs),
            sample_ids=self.sample_ids[idx],
        )


def common_length(length: int, multiple_of: int, device: torch.device, group=None) -> int:
    """A token-grid width T shared by every rank of ``group`` with (T - 1) % multiple_of == 0.

    With the allgather MoE dispatcher every forward is a collective over the TP x EP ranks and
    needs the same [b, s] on each; under sequence parallel the forward's input ``tokens[:, :-1]``
    is split over TP, so its length must divide by TP.
    """
    T = comm.max_int(length, device, group, what="common token-grid width")
    return 1 + math.ceil((T - 1) / multiple_of) * multiple_of


def local_rows(num_rows: int, num_minibatches: int, dp_size: int, dp_rank: int) -> list[int]:
    """Global row indices held by DP rank ``dp_rank``: its contiguous share of every minibatch.

    Minibatch k is rows [k R/M, (k+1) R/M) whatever the DP size, so an update never depends on how
    many ranks share it."""
    per_mini, share = num_rows // num_minibatches, num_rows // (num_minibatches * dp_size)
    if share * num_minibatches * dp_size != num_rows:
        raise ValueError(f"{num_rows} rollout rows cannot be split into {num_minibatches} minibatches x "
                         f"{dp_size} data-parallel ranks")
    return [k * per_mini + dp_rank * share + i for k in range(num_minibatches) for i in range(share)]


def global_advantages(rewards: torch.Tensor, row_ids: torch.Tensor, num_rows: int, group_size: int,
                      estimator, dp_size: int, num_minibatches: int, dp_group) -> torch.Tensor:
    """Advantages of this rank's rows [B] computed over every rank's rewards.

    rewards, row_ids: [B] on the compute device (this rank's rows). The rewards of all R rows are
    gathered over the DP group (a group of G samples may be spread over ranks) and the estimator
    runs on [R] in global row order, so every rank computes the same numbers."""
    parts = comm.all_gather(rewards.float(), dp_group, what="advantages: rewards of every data-parallel rank")
    full = torch.empty(num_rows, dtype=torch.float32, device=rewards.device)
    for r, part in enumerate(parts):
        ids = torch.tensor(local_rows(num_rows, num_minibatches, dp_size, r), device=rewards.device)
        full[ids] = part
    return estimator(full, group_size)[row_ids]


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
                     temperature: float = 1.0, on_micro_batch: MicroBatchHook = None,
                     padding_mask: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Forward-only per-token log-probs of tokens[:, 1:], one forward per row slice in
    ``micro_batches`` (which cover the rows in order): [B, T-1] fp32. padding_mask [B, T-1]: see
    model.forward_logits.

    ``on_micro_batch(i)`` may return a context manager entered around micro-batch i's forward
    (routing record / monitor capture)."""
    import contextlib

    out = []
    for i, rows in enumerate(micro_batches):
        mb = tokens[rows]
        ctx = on_micro_batch(i) if on_micro_batch is not None else contextlib.nullcontext()
        with ctx:
            logits = forward_logits(model, mb[:, :-1], padding_mask=None if padding_mask is None else padding_mask[rows])
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
