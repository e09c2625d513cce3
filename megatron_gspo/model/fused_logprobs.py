"""Per-token log-probs (and entropy) straight from the final hidden states: the output layer fused in.

``vocab_parallel_logprobs`` (logprobs.py) starts from logits, so the [tokens, V/tp] logits exist in
full: for a 2B-class model at micro-batch 64 x 576 tokens they are 11 GB in bf16, and their
gradient as much again (enough to run an 80 GB H100 out of memory). Here the output layer's
GEMM runs inside the log-prob function, one vocabulary chunk at a time:

    forward   for each chunk c of this rank's vocabulary rows W_c [v_c, h]:
                  x_c = (hidden @ W_c^T) / T          [N, v_c], the logits' dtype, math in fp32
                  online logsumexp over chunks: running max m, sum exp(x - m), the target logit and
                  (for the entropy) sum exp(x - m) (x - m), rescaled when m grows
              then, under TP, one max and one sum all-reduce (comm.py) over the vocabulary shards
    backward  for each chunk, x_c is recomputed (or, below a small size, kept from the forward),
              g_c = dL/dx_c (the same formulas as logprobs.py), and
                  dL/dhidden += g_c @ W_c             accumulated in fp32
                  dL/dW_c     = g_c^T @ hidden        one GEMM over all N tokens, written in place

so no tensor of N x V exists: peak extra memory is a few [N, v_c] chunks (64 MiB of fp32 each by
default) plus [N, h] and the weight's gradient. The weight gradient of a chunk is one GEMM over
every token, as in the unfused layer (no accumulation over token chunks, hence no rounding of
partial sums in bf16); the hidden-state gradient sums the chunks' contributions in fp32.

Numerics are those of the logits path: the chunk logits are the output layer's (same GEMM, same
dtype: bf16 logits in a bf16 model, exactly what the generator samples from), then fp32 math. The
only difference is the order of the fp32 sums over the vocabulary (online, per chunk): values and
gradients equal ``vocab_parallel_logprobs`` on full logits to fp32 rounding (tests/test_logprobs.py).

Recompute or keep: when every chunk of the forward together holds at most ``keep_logits_bytes``
(default 256 MiB, e.g. 8k tokens of an 8192-entry vocabulary in fp32), the forward keeps its chunk
logits for the backward instead of recomputing them; the recompute costs one more output-layer GEMM
per micro-batch, and below that size memory is not what limits a step. Both give the same numbers.

Tensor and sequence parallelism: the hidden states arrive as the output layer would see them after
its own input handling (model.forward_logprobs makes the layer return them): the full sequence on
every TP rank (all-gathered under sequence parallelism, reduce-scattered in backward by megatron's
mapping; copied, with an all-reduced gradient, without it). ``weight`` is this rank's vocabulary
shard [V/tp, h] holding global ids [rank V/tp, (rank+1) V/tp); padded vocabulary rows (ids >=
vocab_size) never enter the softmax and get zero gradient.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from megatron_gspo.runtime import comm

# Defaults: the fp32 working chunk, and the size below which the forward keeps its chunk logits.
CHUNK_BYTES = 64 << 20
KEEP_LOGITS_BYTES = 256 << 20
_NEG = -1e30  # finite "minus infinity": exp(_NEG - m) is exactly 0 and never NaN


def vocab_chunk(num_tokens: int, v_local: int, chunk_bytes: int = CHUNK_BYTES) -> int:
    """Vocabulary rows per chunk so that one fp32 [num_tokens, chunk] block takes ``chunk_bytes``
    (at least 16 rows, a multiple of 16 when the vocabulary is cut)."""
    v = max(16, chunk_bytes // (4 * max(1, num_tokens)))
    return v_local if v >= v_local else v // 16 * 16


def _all_reduce(t: torch.Tensor, op: str, group) -> torch.Tensor:
    if group is None:
        return t
    return comm.all_reduce(t, op, group, what="fused output-layer log-probs (TP)")


class _OutputLayerLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, target, v_start, vocab_size, group, vc, inv_temp, with_entropy, keep):
        ctx.set_materialize_grads(False)
        n = hidden.shape[0]
        v_real = max(0, min(weight.shape[0], vocab_size - v_start))  # this shard's real (unpadded) rows
        f32 = dict(dtype=torch.float32, device=hidden.device)
        m = torch.full((n,), _NEG, **f32)
        s = torch.zeros(n, **f32)  # sum exp(x - m)
        a = torch.zeros(n, **f32) if with_entropy else None  # sum exp(x - m) (x - m)
        tl = torch.zeros(n, **f32)  # target logit (0 on ranks that do not hold the target)
        local_t = target - v_start
        kept = []
        for v0 in range(0, v_real, vc):
            v1 = min(v_real, v0 + vc)
            y = F.linear(hidden, weight[v0:v1])  # [n, v1 - v0]: the output layer's logits, its dtype
            if keep:
                kept.append(y)
            # our own fp32 working copy (the GEMM output itself when it is fp32 and not kept)
            x = y.to(torch.float32, copy=True) if keep else y.float()
            if inv_temp != 1.0:
                x.mul_(inv_temp)
            in_chunk = (local_t >= v0) & (local_t < v1)
            tl += torch.where(in_chunk, x.gather(1, (local_t - v0).clamp(0, v1 - v0 - 1)[:, None]).squeeze(1), 0.0)
            m_new = torch.maximum(m, x.max(dim=-1).values)
            scale = torch.exp(m - m_new)
            x.sub_(m_new[:, None])
            if with_entropy:
                e = torch.exp(x)
                a = scale * (a + (m - m_new) * s) + torch.bmm(e.unsqueeze(1), x.unsqueeze(2)).view(-1)
                s = s * scale + e.sum(-1)
            else:
                s = s * scale + x.exp_().sum(-1)
            m = m_new
        if group is not None:
            m_g = _all_reduce(m.clone(), "max", group)
            f = torch.exp(m - m_g)
            parts = [s * f, tl] + ([f * (a + (m - m_g) * s)] if with_entropy else [])
            sums = _all_reduce(torch.stack(parts), "sum", group)
            m, s, tl = m_g, sums[0], sums[1]
            a = sums[2] if with_entropy else None
        log_s = torch.log(s)
        log_z = m + log_s
        logp = tl - log_z
        ent = log_s - a / s if with_entropy else torch.zeros_like(logp)
        ctx.save_for_backward(hidden, weight, target, log_z, ent)
        ctx.kept = kept
        ctx.args = (v_start, v_real, vc, inv_temp)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, target, log_z, ent = ctx.saved_tensors
        v_start, v_real, vc, inv_temp = ctx.args
        kept, ctx.kept = ctx.kept, None
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dtype = hidden.dtype
        fp32 = dtype == torch.float32
        # (``*_like`` factories: the backward's tensors follow the inputs' device)
        g_hidden = torch.zeros_like(hidden, dtype=torch.float32) if need_h else None
        # padded rows (ids >= vocab_size) stay zero
        g_weight = (torch.zeros_like if v_real < weight.shape[0] else torch.empty_like)(weight) if need_w else None
        local_t = target - v_start
        for i, v0 in enumerate(range(0, v_real, vc)):
            v1 = min(v_real, v0 + vc)
            w_c = weight[v0:v1]
            y = kept[i] if kept else F.linear(hidden, w_c)
            # in place on our own fp32 copy: log p, then p, then the gradient (logprobs.py's formulas)
            log_p = y.to(torch.float32, copy=True) if kept else y.float()  # a recomputed chunk is ours
            if inv_temp != 1.0:
                log_p.mul_(inv_temp)
            log_p.sub_(log_z[:, None])
            if g_ent is not None:  # dH/dx = -p (log p + H)
                p = torch.exp(log_p)
                g = log_p.add_(ent[:, None]).mul_(p).mul_(-g_ent[:, None])
            else:
                p = log_p.exp_()
                g = None
            if g_logp is not None:  # dlogp/dx = onehot(y) - p
                g = p.mul_(-g_logp[:, None]) if g is None else g.sub_(p.mul_(g_logp[:, None]))
                in_chunk = (local_t >= v0) & (local_t < v1)
                # += g_logp at the target column of the rows whose target is in this chunk (no host sync;
                # one entry per row, so the scatter is deterministic)
                g.scatter_add_(1, (local_t - v0).clamp(0, v1 - v0 - 1)[:, None],
                               torch.where(in_chunk, g_logp, 0.0)[:, None])
            elif g is None:
                g = p.zero_()
            if inv_temp != 1.0:
                g.mul_(inv_temp)
            g = g if fp32 else g.to(dtype)
            if need_h:
                if fp32:
                    g_hidden.addmm_(g, w_c)
                else:
                    g_hidden += torch.mm(g, w_c)
            if need_w:
                torch.mm(g.t(), hidden, out=g_weight[v0:v1])
            if kept:
                kept[i] = None
        return (None if g_hidden is None else g_hidden.to(dtype), g_weight,
                None, None, None, None, None, None, None, None)


def output_layer_logprobs(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    target: torch.Tensor,
    vocab_size: int,
    tp_group=None,
    temperature: float = 1.0,
    with_entropy: bool = True,
    chunk_bytes: int = CHUNK_BYTES,
    keep_logits_bytes: int = KEEP_LOGITS_BYTES,
) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """Log-prob of each target token and each position's entropy, from the final hidden states.

    Args:
        hidden: [..., h] final hidden states (after the final norm), the full sequence on every TP rank.
        weight: [V_padded / tp, h] this TP rank's output-layer (or tied embedding) weight shard.
        target: [...] token ids (global vocabulary), the leading shape of ``hidden``.
        vocab_size: the real vocabulary size; padded rows are excluded from the softmax.
        tp_group: tensor-parallel group (None: ``weight`` holds the whole vocabulary).
        temperature: logits are divided by it first.
        chunk_bytes: size of one fp32 [tokens, vocabulary chunk] block.
        keep_logits_bytes: keep the forward's chunk logits for the backward when all of them fit in
            this many bytes (else recompute; 0: always recompute).
    Returns:
        (logp [...] fp32, entropy [...] fp32 or None), differentiable w.r.t. hidden and weight.
    """
    if hidden.shape[:-1] != target.shape:
        raise ValueError(f"hidden {tuple(hidden.shape)} and target {tuple(target.shape)} disagree on the leading shape")
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"output-layer weight {tuple(weight.shape)} does not match hidden size {hidden.shape[-1]}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0 for log-probs, got {temperature}")
    lead = target.shape
    h = hidden.reshape(-1, hidden.shape[-1])
    if tp_group is not None and comm.world_size(tp_group) == 1:
        tp_group = None
    v_local = weight.shape[0]
    v_start = comm.rank(tp_group) * v_local if tp_group is not None else 0
    n = h.shape[0]
    vc = vocab_chunk(n, v_local, chunk_bytes)
    keep = n * v_local * weight.element_size() <= keep_logits_bytes and torch.is_grad_enabled() \
        and (hidden.requires_grad or weight.requires_grad)
    logp, ent = _OutputLayerLogProbs.apply(h, weight, target.reshape(-1).long(), v_start, vocab_size, tp_group, vc,
                                           1.0 / temperature, with_entropy, keep)
    return logp.view(lead), (ent.view(lead) if with_entropy else None)
