"""Per-token log-probabilities and entropy from vocab-parallel logits, in bounded memory.

Every policy loss starts here. The logits of one TP rank hold a slice of the vocabulary
[..., V/tp]; the softmax normalizer is assembled with three small all-reduces per chunk (max,
sum of exp, target logit), so the full vocabulary is never gathered. Tokens are processed in
chunks and the backward recomputes each chunk's softmax instead of saving it, so no fp32
[tokens, vocab] tensor ever exists: peak extra memory is one chunk, O(chunk_tokens x V/tp).

    logp_t  = x_t[y_t] - logsumexp(x_t)
    H_t     = logsumexp(x_t) - sum_v p_v x_v
    dlogp/dx = onehot(y) - p
    dH/dx    = -p * (x - logsumexp(x) + H)
"""

from __future__ import annotations

from typing import Optional

import torch

from megatron_gspo.runtime import comm

# Finite stand-in for -inf on padded vocabulary columns: exp() gives exactly 0 and, unlike -inf,
# 0 * x stays 0 (no NaN) in the entropy sum.
_PAD_LOGIT = -1e30


def _all_reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    if group is None:
        return t
    return comm.all_reduce(t, op, group, what="vocab-parallel log-probs (TP)")


def _chunk_fp32(x: torch.Tensor, v_start: int, vocab_size: int, inv_temp: float,
                out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """One chunk of logits in fp32, divided by the temperature, padded columns masked: a copy (in
    ``out`` when given, an fp32 buffer of x's shape), so masking never touches the model's logits."""
    x = x.to(torch.float32, copy=True) if out is None else out.copy_(x)
    if inv_temp != 1.0:
        x.mul_(inv_temp)
    if v_start + x.shape[-1] > vocab_size:  # this shard holds padded vocabulary columns
        x[:, max(0, vocab_size - v_start):] = _PAD_LOGIT
    return x


def _chunk_stats(x: torch.Tensor, tgt: torch.Tensor, group, with_entropy: bool):
    """x [n, Vl] fp32 (from _chunk_fp32; consumed: overwritten in place), tgt [n] ids local to
    this shard (may be out of range). Returns (logZ, target logit, entropy or None), each [n] and
    identical on every TP rank."""
    v_local = x.shape[-1]
    m = _all_reduce(x.max(dim=-1).values, "max", group)
    in_shard = (tgt >= 0) & (tgt < v_local)
    tl = torch.where(in_shard, x.gather(1, tgt.clamp(0, v_local - 1)[:, None]).squeeze(1), torch.zeros_like(m))
    x.sub_(m[:, None])  # x - m, in place: the chunk is our own fp32 copy
    # one all-reduce for the sums: sum exp, target logit (and sum exp * (x - m) for the entropy)
    if with_entropy:
        e = torch.exp(x)
        sum_ex = torch.bmm(e.unsqueeze(1), x.unsqueeze(2)).view(-1)  # sum_v e_v (x_v - m), no [n, V] temporary
        sums = torch.stack([e.sum(-1), tl, sum_ex], dim=0)
    else:
        sums = torch.stack([x.exp_().sum(-1), tl], dim=0)
    sums = _all_reduce(sums, "sum", group)
    sum_e, tl = sums[0], sums[1]
    log_z = m + torch.log(sum_e)
    entropy = torch.log(sum_e) - sums[2] / sum_e if with_entropy else None
    return log_z, tl, entropy


class _VocabParallelLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, v_start, vocab_size, group, chunk, inv_temp, with_entropy):
        # unused outputs (entropy when the loss ignores it) arrive as None: skip their math
        ctx.set_materialize_grads(False)
        n = logits.shape[0]
        logp = torch.empty(n, dtype=torch.float32, device=logits.device)
        # without entropy the second output stays zeros (never returned to the caller)
        ent = (torch.empty if with_entropy else torch.zeros)(n, dtype=torch.float32, device=logits.device)
        log_z = torch.empty(n, dtype=torch.float32, device=logits.device)
        for s in range(0, n, chunk):
            sl = slice(s, min(n, s + chunk))
            x = _chunk_fp32(logits[sl], v_start, vocab_size, inv_temp)
            lz, tl, h = _chunk_stats(x, target[sl] - v_start, group, with_entropy)
            logp[sl], log_z[sl] = tl - lz, lz
            if with_entropy:
                ent[sl] = h
        ctx.save_for_backward(logits, target, log_z, ent)
        ctx.v_start, ctx.vocab_size, ctx.chunk, ctx.inv_temp = v_start, vocab_size, chunk, inv_temp
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, target, log_z, ent = ctx.saved_tensors
        n, v_local = logits.shape
        grad = torch.empty_like(logits)
        # fp32 logits: the chunk's working copy is the gradient's own slice (no extra copy at the end)
        in_grad = grad.dtype == torch.float32
        for s in range(0, n, ctx.chunk):
            sl = slice(s, min(n, s + ctx.chunk))
            # in place on the chunk's own fp32 copy: log p, then p, then the gradient
            log_p = _chunk_fp32(logits[sl], ctx.v_start, ctx.vocab_size, ctx.inv_temp,
                                out=grad[sl] if in_grad else None).sub_(log_z[sl, None])
            if g_ent is not None:  # dH/dx = -p * (log p + H)
                p = torch.exp(log_p)
                g = log_p.add_(ent[sl, None]).mul_(p).mul_(-g_ent[sl, None])
            else:
                p = log_p.exp_()
                g = None
            if g_logp is not None:  # dlogp/dx = onehot(y) - p
                g = p.mul_(-g_logp[sl, None]) if g is None else g.sub_(p.mul_(g_logp[sl, None]))
                local_t = target[sl] - ctx.v_start
                rows = torch.nonzero((local_t >= 0) & (local_t < v_local)).squeeze(1)
                g[rows, local_t[rows]] += g_logp[sl][rows]
            elif g is None:
                g = p.zero_()
            if ctx.inv_temp != 1.0:
                g.mul_(ctx.inv_temp)
            if not in_grad:
                grad[sl] = g
        return grad, None, None, None, None, None, None, None


def vocab_parallel_logprobs(
    logits: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    tp_group=None,
    temperature: float = 1.0,
    chunk_tokens: Optional[int] = None,
    with_entropy: bool = True,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of each target token and the entropy of each position's distribution.

    Args:
        logits: [..., V_padded / tp] this TP rank's contiguous vocab shard (any float dtype;
            math in fp32). Rank r holds ids [r * V_local, (r + 1) * V_local).
        target: [...] token ids (global vocabulary), same leading shape as logits.
        vocab_size: the real vocabulary size; padded columns are excluded from the softmax.
        tp_group: tensor-parallel process group (None: the logits hold the full vocabulary).
        temperature: logits are divided by it first (sampling temperature of the rollout).
        chunk_tokens: tokens per chunk; bounds the fp32 temporaries to chunk_tokens x V/tp.
            Default: as many as fit in 64 MiB of fp32 per temporary.
    Returns:
        (logp [...] fp32, entropy [...] fp32 or None). Both differentiable w.r.t. logits.
    """
    if logits.shape[:-1] != target.shape:
        raise ValueError(f"logits {tuple(logits.shape)} and target {tuple(target.shape)} disagree on the leading shape")
    lead = target.shape
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    x = logits.reshape(-1, logits.shape[-1])
    if chunk_tokens is None:
        chunk_tokens = (64 << 20) // (4 * x.shape[-1])
    tp_rank = comm.rank(tp_group) if tp_group is not None and comm.world_size(tp_group) > 1 else 0
    v_start = tp_rank * x.shape[-1]
    logp, ent = _VocabParallelLogProbs.apply(
        x, target.reshape(-1).long(), v_start, vocab_size, tp_group, max(1, chunk_tokens), 1.0 / temperature,
        with_entropy,
    )
    return logp.view(lead), (ent.view(lead) if with_entropy else None)
