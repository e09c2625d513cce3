"""Shared-prefix ("cascade") decode attention: a prompt's G samples read the prompt's KV once.

In a decode step every row attends over its prompt block (slots 0 .. P-1) and its own generated suffix
(slots P ..). The G rows of one prompt hold the same prompt KV, so the plain step reads G copies of it
per layer (rows x P keys); here the prompt's keys and values are read once per prompt: the queries of
its rows become the rows of one GEMM against the prompt's keys ([cells x heads per group, hn] x [hn, P]
per prompt and KV group), and each row's suffix is attended separately. The two partial softmaxes
are merged exactly with the log-sum-exp rule (FlashInfer's ``merge_state``, the cascade inference of
its docs): each partial is (o, lse) with o = softmax(s) @ v over its keys and lse = log sum exp(s),
both computed max-subtracted; the merged output is (o1 e^(lse1 - m) + o2 e^(lse2 - m)) /
(e^(lse1 - m) + e^(lse2 - m)) with m = max(lse1, lse2), which equals attention over the concatenated
keys up to rounding (tests/test_shared_prefix.py: 1e-6 in fp32).

Masks are additive biases with a large *finite* negative (model/attention.py's module doc): a partial
whose keys are all masked (a dummy row's empty prompt slots) gets a finite lse far below the other
partial's, whose weight then is exp(-huge) = 0, never NaN.

When it pays (``generation.shared_prefix_attention=auto``: ``shared_prefix_pays``, the one place of the
rule). The grid of queries costs a scatter, a gather and the merge per layer and step, and a prompt's
GEMM rows include its finished rows' empty cells; what it saves is reading the prompt's keys and values
G - 1 more times. Measured on the benchmark model's heads (8 query heads, 2 KV groups of 32, fp32, 1 thread;
docs/performance.md "Shared-prefix decode attention"): the break-even is near 3 MiB of the rows' copies of
the prompt keys per layer, whatever the rows and slots (64 rows: 0.82x at 128 slots, 1.15x at 256, 2.2-3.7x
at 512; 16 rows: 0.89x at 512, 1.21x at 1024), where they leave the CPU's caches. So ``auto`` turns it on
when a prompt has two rows in the decode batch and those copies reach ``SHARED_PREFIX_MIN_KEY_BYTES``.
"""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["SHARED_PREFIX_MIN_KEY_BYTES", "attention_partial", "merge_attention_states", "prefix_cells",
           "shared_prefix_attention", "shared_prefix_pays"]

# The rows' copies of the prompt block's keys per layer (bytes) from which ``auto`` shares the prompt's KV in
# decode: below it they stay in the CPU's caches and the plain step is faster (module doc: measured)
SHARED_PREFIX_MIN_KEY_BYTES = 3 << 20


def shared_prefix_pays(setting: str, key_bytes: int, cells: int, graphs: bool = False) -> bool:
    """Whether a call decodes with shared-prefix attention: ``setting`` (generation.shared_prefix_attention:
    on / off / auto); ``key_bytes``: the decode batch's copies of the prompt block's keys per layer (rows x KV
    groups x prompt slots x head size x element size: what the plain step reads); ``cells``: the most rows
    of one prompt in the decode batch. ``on`` shares whenever a prompt has two rows; ``auto`` when it pays
    (module doc); a captured step (``graphs``) never (its shapes cannot follow a call's prompts; the
    config refuses ``on`` with cuda_graphs)."""
    if setting == "off" or graphs or cells < 2:
        return False
    return setting == "on" or key_bytes >= SHARED_PREFIX_MIN_KEY_BYTES


def attention_partial(scores: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One block of keys' share of a softmax attention: scores [..., m, L] (scaled, bias added), v [..., L, hn]
    -> (o [..., m, hn] = softmax(scores) @ v over these L keys, lse [..., m] = logsumexp(scores)), both
    max-subtracted (no exp of a raw score: fp32 overflows past 88)."""
    mx = scores.amax(dim=-1, keepdim=True)
    p = torch.exp(scores - mx)
    s = p.sum(dim=-1, keepdim=True)
    o = torch.matmul(p, v).div_(s)
    return o, mx.add_(s.log_()).squeeze(-1)


# torch's CPU flash attention returning (output, logsumexp) (None where this torch has none: the GEMMs then)
_CPU_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _block_partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: Optional[torch.Tensor],
                   scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``attention_partial`` of q [B, H, m, hn] over k / v [B, H, L, hn] with an additive bias [B, 1, 1, L] (or None):
    (o [B, H, m, hn], lse [B, H, m]). On the CPU torch's flash attention kernel, which returns the log-sum-exp
    too (its online softmax is max-subtracted), 1.6x faster than the GEMMs at a prompt's 8 rows x 4 heads per
    group over 512 keys; elsewhere the GEMMs (no fused kernel here returns the lse on every device)."""
    if q.device.type == "cpu" and _CPU_FLASH is not None and q.dtype in (torch.float32, torch.float64, torch.bfloat16):
        mask = None if bias is None else bias.expand(q.shape[0], 1, q.shape[2], k.shape[2])
        o, lse = _CPU_FLASH(q, k, v, 0.0, False, attn_mask=mask, scale=scale)
        return o, lse.to(o.dtype)
    s = torch.matmul(q, k.transpose(-1, -2)).mul_(scale)
    return attention_partial(s if bias is None else s.add_(bias), v)


def merge_attention_states(o1: torch.Tensor, lse1: torch.Tensor, o2: torch.Tensor,
                           lse2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Two partial attentions over disjoint key sets merged into the attention over their union (FlashInfer's
    merge_state): o1/o2 [..., hn], lse1/lse2 [...] -> (o [..., hn], lse [...])."""
    m = torch.maximum(lse1, lse2)
    w1, w2 = torch.exp(lse1 - m), torch.exp(lse2 - m)
    total = w1 + w2
    o = (o1 * (w1 / total).unsqueeze(-1)) + (o2 * (w2 / total).unsqueeze(-1))
    return o, m + torch.log(total)


def prefix_cells(prefix_row: torch.Tensor) -> torch.Tensor:
    """prefix_row [n] (each row's prefix row) -> cell [n]: the row's rank among the rows of its prefix row
    (0, 1, ... in row order), its place in the prefix row's block of queries. On the device, no sync."""
    n = prefix_row.numel()
    order = torch.argsort(prefix_row, stable=True)
    sorted_rows = prefix_row[order]
    idx = torch.arange(n, device=prefix_row.device)
    # the first index of each run of equal prefix rows, carried forward by a cumulative max
    starts = torch.where(torch.cat([sorted_rows.new_ones(1, dtype=torch.bool), sorted_rows[1:] != sorted_rows[:-1]]),
                         idx, torch.zeros_like(idx))
    rank = idx - torch.cummax(starts, dim=0).values
    return torch.empty_like(rank).scatter_(0, order, rank)


def shared_prefix_attention(q: torch.Tensor, prefix_k: torch.Tensor, prefix_v: torch.Tensor, suffix_k: torch.Tensor,
                            suffix_v: torch.Tensor, prefix_row: torch.Tensor, cell: torch.Tensor, cells: int, *,
                            scale: float, prefix_bias: Optional[torch.Tensor] = None,
                            suffix_bias: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One decode query per row attending over its prefix row's KV and its own suffix KV (module doc).

    q [n, np, hn] (heads group-major: megatron's QKV layout; np a multiple of ng: GQA); prefix_k / prefix_v
    [Bp, ng, Lp, hn]; suffix_k / suffix_v [n, ng, Ls, hn]; prefix_row [n] long (row r's prefix row);
    cell [n] long in [0, cells), distinct among the rows of one prefix row (``prefix_cells``); prefix_bias
    [Bp, Lp] and suffix_bias [n, Ls] additive (finite large negative = masked; None = none).
    Returns [n, np, hn]: softmax(scale q [prefix_k[prefix_row[r]]; suffix_k[r]]^T + bias) [prefix_v; suffix_v]."""
    n, np_, hn = q.shape
    Bp, ng, Lp = prefix_k.shape[0], prefix_k.shape[1], prefix_k.shape[2]
    hg = np_ // ng
    at = prefix_row * cells + cell  # each row's place in the grid of its prefix row's queries
    # the prefix: each prefix row's cells x heads-per-group queries in one GEMM per KV group
    grid = q.new_zeros(Bp * cells, np_, hn).index_copy_(0, at, q)
    grid = grid.view(Bp, cells, ng, hg, hn).transpose(1, 2).reshape(Bp, ng, cells * hg, hn)
    o_pre, lse_pre = _block_partial(grid, prefix_k, prefix_v, None if prefix_bias is None else prefix_bias[:, None, None, :],
                                    scale)  # [Bp, ng, cells*hg, hn], [Bp, ng, cells*hg]
    o_pre = o_pre.view(Bp, ng, cells, hg, hn).transpose(1, 2).reshape(Bp * cells, np_, hn)
    lse_pre = lse_pre.view(Bp, ng, cells, hg).transpose(1, 2).reshape(Bp * cells, np_)
    o_pre, lse_pre = o_pre.index_select(0, at), lse_pre.index_select(0, at)  # [n, np, hn], [n, np]
    # the suffix: each row's own keys
    s_suf = torch.matmul(q.view(n, ng, hg, hn), suffix_k.transpose(-1, -2)).mul_(scale)  # [n, ng, hg, Ls]
    if suffix_bias is not None:
        s_suf = s_suf.add_(suffix_bias[:, None, None, :])
    o_suf, lse_suf = attention_partial(s_suf, suffix_v)
    o, _ = merge_attention_states(o_pre, lse_pre, o_suf.reshape(n, np_, hn), lse_suf.reshape(n, np_))
    return o
