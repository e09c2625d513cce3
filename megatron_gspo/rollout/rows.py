"""Which global rows a rank holds, and the token-grid helpers both rollout sources, the rollout ranks,
the batch preparation and the SFT warm start share.

Global rows. A step's rollout is P prompts x G samples = R rows in prompt-major order (global row
g = prompt g // G, sample g % G), split into ``num_minibatches`` consecutive minibatches of R / M rows
(one optimizer step each). Data parallelism never changes which rows a minibatch holds. Which DP rank
holds which of them:

  * generation: DP rank r generates the r-th contiguous share of every minibatch (``local_rows``);
  * training: each minibatch's rows are dealt to the DP ranks by token count (``deal_rows``: equal row
    counts, Karmarkar-Karp's partition of the lengths), because the minibatch's optimizer step waits
    for the rank with the most tokens; the scored rows move there (rollout/exchange.py).
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

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


def generating_rank(row: int, num_rows: int, num_minibatches: int, dp_size: int) -> int:
    """The DP rank whose ``local_rows`` hold global row ``row``."""
    per, share = num_rows // num_minibatches, num_rows // (num_minibatches * dp_size)
    return (row % per) // share


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


def karmarkar_karp(weights: Sequence[int], parts: int, equal_size: bool = True) -> list[list[int]]:
    """Karmarkar-Karp's largest differencing method, ``parts``-way: the indices of ``weights`` (e.g. rows'
    token counts) in ``parts`` sets whose sums differ as little as the heuristic manages.

    Each seed is a partial solution of ``parts`` sets; the two seeds whose largest and smallest sums differ
    most are merged, the heaviest set of one with the lightest of the other, until one is left (the
    difference method keeps the big items apart). equal_size: the seeds are consecutive runs of
    ``parts`` items of the sorted weights, one item per set, so every set ends with len / parts items
    (len must divide by parts); else each item alone. Deterministic: ties are broken by index. Returns
    the sets, each ascending, ordered by their smallest index. (verl's get_seqlen_balanced_partitions
    uses the same method, with equal_size for its data-parallel batch.)"""
    n = len(weights)
    if parts < 1 or (equal_size and n % parts):
        raise ValueError(f"karmarkar_karp: {n} items cannot be split into {parts} equal sets")
    order = sorted(range(n), key=lambda i: (weights[i], i))
    seeds = ([order[j:j + parts] for j in range(0, n, parts)] if equal_size else [[i] for i in order])

    def state(sets: list[tuple[int, list[int]]]) -> list[tuple[int, list[int]]]:
        return sorted(sets, key=lambda s: (-s[0], s[1][0] if s[1] else n))  # heaviest first

    heap = []
    for seq, items in enumerate(seeds):
        sets = state([(weights[i], [i]) for i in items] + [(0, [])] * (parts - len(items)))
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), seq, sets))
    seq = len(seeds)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        sets = state([(a[i][0] + b[-1 - i][0], a[i][1] + b[-1 - i][1]) for i in range(parts)])
        heapq.heappush(heap, (-(sets[0][0] - sets[-1][0]), seq, sets))
        seq += 1
    final = [sorted(items) for _, items in heap[0][2]] if heap else [[] for _ in range(parts)]
    return sorted(final, key=lambda items: items[0] if items else n)


def deal_rows(seq_lengths: Sequence[int], num_minibatches: int, dp_size: int, balance: bool = True) -> list[list[int]]:
    """Which global rows each DP rank trains: per rank, its share of every minibatch (minibatch by
    minibatch, each share ascending), the same count R / (M x DP) everywhere.

    seq_lengths: [R] tokens of every row of the step (prompt + response). balance: each minibatch is
    split by ``karmarkar_karp`` on the lengths (equal sizes), where that lowers the minibatch's largest
    share of tokens below the contiguous split's (``local_rows``); otherwise, and with balance False,
    the contiguous split, which is where the rows were generated (nothing moves)."""
    R = len(seq_lengths)
    rows = [local_rows(R, num_minibatches, dp_size, r) for r in range(dp_size)]
    if not balance or dp_size == 1:
        return rows
    per, share = R // num_minibatches, R // (num_minibatches * dp_size)
    out: list[list[int]] = [[] for _ in range(dp_size)]
    for k in range(num_minibatches):
        contiguous = [rank_rows[k * share:(k + 1) * share] for rank_rows in rows]
        sets = [[k * per + i for i in s] for s in karmarkar_karp(seq_lengths[k * per:(k + 1) * per], dp_size)]
        heaviest = lambda split: max(sum(seq_lengths[i] for i in s) for s in split)  # noqa: E731
        chosen = sets if heaviest(sets) < heaviest(contiguous) else contiguous
        for r in range(dp_size):
            out[r] += chosen[r]
    return out


def token_imbalance(seq_lengths: Sequence[int], deal: list[list[int]], num_minibatches: int) -> float:
    """How much longer than a perfect split the step's updates run under ``deal`` (per rank, its rows,
    minibatch by minibatch, equal shares): the sum over minibatches of the largest rank's tokens over
    the sum of the mean rank's tokens (1.0: balanced). Each minibatch's optimizer step waits for its
    heaviest rank, so this is the time of the updates over the balanced ideal."""
    share = len(deal[0]) // num_minibatches
    heaviest = mean = 0.0
    for k in range(num_minibatches):
        tokens = [sum(seq_lengths[i] for i in rows[k * share:(k + 1) * share]) for rows in deal]
        heaviest, mean = heaviest + max(tokens), mean + sum(tokens) / len(tokens)
    return heaviest / mean if mean > 0 else 1.0
