"""Which global rows a rank holds, and the token-grid helpers both rollout sources, the rollout ranks,
the batch preparation and the SFT warm start share.

Global rows. A step's rollout is P prompts x G samples = R rows in prompt-major order (global row
g = prompt g // G, sample g % G), split into ``num_minibatches`` consecutive minibatches of R / M rows
(one optimizer step each). Data parallelism never changes which rows a minibatch holds: DP rank r
holds the r-th contiguous share of every minibatch (``local_rows``).
"""

from __future__ import annotations

import math

import torch

from megatron_gspo.runtime import comm


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
