"""Responses cut at generation.max_new_tokens: DAPO's overlong reward shaping and overlong filtering.

A response that reached the token limit without a stop token is *truncated*: its reward judges an
unfinished answer. DAPO (arXiv 2503.14476 §3.4) offers two remedies, both here:

  * overlong filtering (train.overlong_filtering): truncated responses are masked out of the loss
    (``loss_mask``), so they neither count in the normalizer nor push the policy either way;
  * soft overlong punishment (reward.overlong_buffer_len / overlong_penalty_factor): a length penalty
    over the last L_cache tokens before L_max, added to the task reward (``overlong_penalty``).
"""

from __future__ import annotations

import torch

from megatron_gspo.runtime import comm


def overlong_penalty(lengths: torch.Tensor, max_len: int, buffer_len: int, factor: float = 1.0) -> torch.Tensor:
    """DAPO eq. 13: R_length(y) = 0 if |y| <= L_max - L_cache, (L_max - L_cache - |y|) / L_cache in the
    buffer, -1 past L_max; times ``factor``.

    lengths: [B] response tokens |y| (stop token included); max_len: L_max (generation.max_new_tokens);
    buffer_len: L_cache (0 = no penalty). Returns [B] fp32 (<= 0) on lengths' device."""
    if buffer_len <= 0:
        return torch.zeros(lengths.shape, dtype=torch.float32, device=lengths.device)
    over = lengths.float() - (max_len - buffer_len)  # tokens into the buffer
    return -factor * (over / buffer_len).clamp(min=0.0, max=1.0)


def truncated(stopped: torch.Tensor, lengths: torch.Tensor, max_len: int) -> torch.Tensor:
    """[B] bool: the response hit ``max_len`` tokens without ending on a stop token.

    stopped: [B] bool from the generator; lengths: [B] response tokens."""
    return ~stopped & (lengths >= max_len)


def loss_mask(mask: torch.Tensor, truncated_rows: torch.Tensor) -> torch.Tensor:
    """[B, T] bool: the response mask with truncated rows removed (overlong filtering)."""
    return mask & ~truncated_rows[:, None]


def empty_minibatch(batch, mini: list[int], device: torch.device) -> bool:
    """Overlong filtering masked every response of minibatch ``mini`` (flat micro-batch indices into
    ``batch``, a rollout.prepare.TrainBatch) out of the loss on every DP rank (each rank holds its share
    of the minibatch; the vote, a collective, makes every rank skip alike)."""
    local = all(bool(batch.truncated[batch.micro[i]].all()) for i in mini)
    return comm.all_ranks(local, device, what="overlong filtering: empty minibatch vote")
