"""Drawing tokens: temperature, top-k / top-p, and sampling noise that does not depend on the layout.

Counter-based noise
    A rollout must be the same whatever TP / EP / DP layout generates it, or no run can be compared
    with another layout's (and a layout bug hides in sampling noise). A generator seeded per rank
    cannot give that: which rank draws a sample, and how many rows it draws before it, change with
    the layout. So the noise of a draw is a pure function of integers that name it:

        U[row] = hash(seed, row key, position) / 2**53        (uniform in (0, 1), float64)

    ``seed`` is the call's seed (the trainer mixes ``generation.seed`` with the step), the row key is
    the sample's global index (prompt index x n_samples_per_prompt + sample index) and ``position``
    the response token's index. The hash is Chris Wellons' lowbias32 integer mixer, applied word by
    word (64-bit keys as two words); every operation is an int64 torch op kept below 2**63, so CPU
    and CUDA give identical bits. Under vocab-parallel TP every rank holds the full last-position
    logits (megatron gathers them for inference), so every rank draws the same token from the same
    number.

Work per draw (b rows, vocabulary V)
    one fp32 copy of the logits (scaled in place by the temperature), one logsumexp reduction for the
    recorded log-prob, the softmax of the (filtered) draw distribution, its float64 cumulative sum and
    a binary search per row; no [b, V] log-softmax is materialised (tests/test_sampling.py checks the
    drawn tokens against a reference that does materialise it, draw for draw).

Drawing
    Inverse-CDF sampling: the token is the first ``v`` whose cumulative probability (float64 cumsum)
    exceeds ``U * total``. One number per row, not one per vocabulary entry: the noise costs O(b)
    hashing instead of O(b x V) (an exponential race over the vocabulary, the Gumbel-max trick, needs
    V numbers per draw: 15 % of a decode step at vocabulary 8192). Scaling by the row's own total
    makes the draw exact whatever the rounding of the sum, and a token of probability 0 (filtered by
    top-k / top-p / ``allowed``) has an empty interval: it is never drawn.
"""

from __future__ import annotations

from typing import Optional

import torch

_M32 = 0xFFFFFFFF


def _mul32(x, c: int):
    """(x * c) mod 2**32 for x in [0, 2**32) (int or int64 tensor), c < 2**32, without int64 overflow:
    c is split in 16-bit halves so no intermediate exceeds 2**49 (signed overflow is undefined)."""
    lo, hi = c & 0xFFFF, c >> 16
    return (x * lo + (((x * hi) & 0xFFFF) << 16)) & _M32


def mix32(x):
    """lowbias32: a 32-bit integer hash with near-ideal avalanche (ints or int64 tensors in [0, 2**32))."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x7FEB352D)
    x = x ^ (x >> 15)
    x = _mul32(x, 0x846CA68B)
    return x ^ (x >> 16)


def _absorb(h, key):
    """Fold a non-negative 64-bit key (int or int64 tensor) into the 32-bit state h."""
    h = mix32(h ^ (key & _M32))
    return mix32(h ^ ((key >> 32) & _M32))


def counter_uniform(seed: int, rows: torch.Tensor, position) -> torch.Tensor:
    """Uniform noise in (0, 1), [len(rows)] float64 on ``rows``' device.

    seed: a non-negative int; rows: [b] int64 row keys (non-negative); position: a non-negative int, or
    [b] int64 non-negative positions, one per row (rows at different response positions: a refilled
    decode batch). Entry i depends on (seed, rows[i], position of row i) only, never on the other rows or
    the batch size; a tensor of positions gives the bits of the int, row by row."""
    if isinstance(position, torch.Tensor):
        if seed < 0:
            raise ValueError(f"counter_uniform: seed must be >= 0, got {seed}")
        h = mix32(_absorb(mix32(0x5EED), seed) ^ (position.long() & _M32))  # [b]
    else:
        if seed < 0 or position < 0:
            raise ValueError(f"counter_uniform: seed and position must be >= 0, got {seed}, {position}")
        h = torch.full_like(rows, mix32(_absorb(mix32(0x5EED), seed) ^ (position & _M32)), dtype=torch.long)
    hi = _absorb(h, rows.long())  # [b] 32 random bits
    lo = mix32(hi ^ 0x9E3779B9)  # 32 more
    # 27 + 26 bits = a 53-bit integer, exact in float64; centred, so never 0 or 1
    bits = ((hi >> 5) << 26) | (lo >> 6)
    return (bits.to(torch.float64) + 0.5) * (1.0 / (1 << 53))


def filter_top_k_top_p(x: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """Mask (to -inf) the tokens outside the top-k / nucleus of x [b, V] (temperature-scaled)."""
    v = x.shape[-1]
    if 0 < top_k < v:
        kth = torch.topk(x, top_k, dim=-1).values[:, -1:]
        x = x.masked_fill(x < kth, float("-inf"))
    if top_p < 1.0:
        sorted_x, idx = torch.sort(x, dim=-1, descending=True)
        probs = torch.softmax(sorted_x, dim=-1)
        # drop a token when the tokens ranked before it already reach top_p (the first always stays)
        drop_sorted = (torch.cumsum(probs, dim=-1) - probs) >= top_p
        drop = torch.zeros_like(drop_sorted).scatter_(-1, idx, drop_sorted)
        x = x.masked_fill(drop, float("-inf"))
    return x


def sample_tokens(logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0,
                  uniform: Optional[torch.Tensor] = None,
                  allowed: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row from full-vocabulary logits [b, V] (padded columns removed).

    temperature 0 is greedy (argmax). ``uniform``: [b] noise in (0, 1) (``counter_uniform``); None
    draws it from torch's global generator. ``allowed``: [V] (or per row [b, V]) bool, the tokens the draw
    may pick (e.g. no stop token before generation.min_new_tokens). Returns (tokens [b] long, log-probs [b] fp32):
    log-softmax(logits / T) of the drawn token, *unrestricted* (top-k / top-p / ``allowed`` restrict
    the draw only; temperature 1 when greedy), i.e. what the trainer recomputes at that temperature."""
    x = logits.float()
    if temperature != 0:
        # a copy of bf16 logits is ours to scale in place; fp32 logits are the caller's
        x = x / temperature if x is logits else x.div_(temperature)
    # the drawn token's log-prob, x[tok] - logsumexp(x): one reduction over the vocabulary instead
    # of a materialized [b, V] log-softmax (and closer to float64: 1e-6 vs 3e-5 at vocabulary 151936)
    lse = torch.logsumexp(x, dim=-1)
    if temperature == 0:
        tok = (x if allowed is None else x.masked_fill(~allowed, float("-inf"))).argmax(dim=-1)
    else:
        xf = x if allowed is None else x.masked_fill(~allowed, float("-inf"))
        probs = torch.softmax(filter_top_k_top_p(xf, top_k, top_p), dim=-1)
        b, v = probs.shape
        if uniform is not None and uniform.shape != (b,):
            raise ValueError(f"sample_tokens: noise of shape {tuple(uniform.shape)} for logits {tuple(probs.shape)} "
                             f"(one number per row)")
        u = torch.rand(b, dtype=torch.float64, device=probs.device) if uniform is None else uniform.double()
        # [b, V] float64 in vocabulary order: no token's interval lost to rounding. Kept as is on purpose:
        # any other summation order (blocks, a fixed-point sum) moves interval boundaries by float64
        # rounding and can change the drawn token for the same noise.
        cdf = probs.double().cumsum(dim=-1)
        # first v with cdf[v] > u * total (right=True): a zero-probability token's interval is empty
        tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True).squeeze(1).clamp_(max=v - 1)
    return tok, x.gather(-1, tok[:, None]).squeeze(-1) - lse
