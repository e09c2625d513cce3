"""A lean incremental forward for generation, on the GPTModel's own modules and weights.

Why: a decode step of megatron-core's ``GPTModel`` with its ``StaticInferenceContext`` does work
that a one-token step does not need. Its KV cache stores keys *before* RoPE, so every step
re-applies RoPE to every cached key of every layer (O(sequence) per step, growing with the
response); the cache is sequence-first, so each step's attention reads strided K/V; and every layer
goes through the inference context's bookkeeping, the bias-dropout-add closures and the
[s, b] <-> [b, s] layout copies of the output layer. On the benchmark model (4 layers, hidden 256)
this overhead was about half of a decode step on CPU (docs/performance.md).

``LeanDecoder`` runs the same computation with the same parameters: the embedding, each layer's
own norm modules (``input_layernorm``, ``q_layernorm``/``k_layernorm``, ``pre_mlp_layernorm``,
``final_layernorm``) and its whole MLP/MoE module (router, dispatcher and experts untouched, so
routing is megatron's and router hooks such as the R3 recorder see the same [s, b, h] input), with the attention projections, RoPE and a KV cache of *roped* keys
([b, groups, slots, head dim], batch-first, contiguous per row) done here; only the last
position's logits are computed. Logits equal the megatron path's to float rounding
(tests/test_decode.py: per step, prefill and decode, left-padded prompts, compaction).

It covers the layouts generation uses on one rank of model parallelism: TP = PP = CP = EP = 1,
RoPE, the local spec's core attention (megatron's DotProductAttention or our SDPAttention; the
lean step computes attention itself, so Transformer Engine's is not silently replaced), no MLA /
gated attention, no sequence parallelism.
Anything else is refused by ``lean_decode_unsupported`` with the reason, and ``generate`` keeps
megatron's path (``generation.decode_impl=auto``) or raises (``decode_impl=lean``).
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from megatron.core.transformer.dot_product_attention import DotProductAttention

__all__ = ["LeanDecoder", "lean_decode_unsupported"]


def lean_decode_unsupported(m) -> Optional[str]:
    """Why the lean path cannot run this (unwrapped) GPTModel, or None when it can."""
    cfg = m.config
    checks = [
        (cfg.tensor_model_parallel_size != 1, "tensor parallelism"),
        (cfg.pipeline_model_parallel_size != 1, "pipeline parallelism"),
        (cfg.context_parallel_size != 1, "context parallelism"),
        (cfg.expert_model_parallel_size != 1 or (cfg.expert_tensor_parallel_size or 1) != 1, "expert parallelism"),
        (cfg.sequence_parallel, "sequence parallelism"),
        (getattr(m, "position_embedding_type", None) != "rope", "position embedding is not RoPE"),
        (cfg.rotary_interleaved, "interleaved RoPE"),
        (getattr(cfg, "multi_latent_attention", False), "multi-latent attention"),
        (getattr(cfg, "attention_output_gate", False), "gated attention"),
        (cfg.apply_residual_connection_post_layernorm, "post-layernorm residual"),
        (getattr(cfg, "fp32_residual_connection", False), "fp32 residual connection"),
        (getattr(cfg, "fp8", None) is not None, "FP8"),
        (getattr(cfg, "window_size", None) is not None, "sliding-window attention"),
        (getattr(cfg, "softmax_type", "vanilla") != "vanilla", "softmax offsets"),
        (cfg.apply_query_key_layer_scaling, "query-key layer scaling"),
    ]
    for bad, why in checks:
        if bad:
            return why
    rope = m.rotary_pos_emb
    if getattr(rope, "seq_len_interpolation_factor", None) is not None or type(rope).__name__ != "RotaryEmbedding":
        return "RoPE scaling"
    for layer in m.decoder.layers:
        att = layer.self_attention
        if type(att).__name__ != "SelfAttention":
            return f"attention module {type(att).__name__}"
        if not isinstance(att.core_attention, DotProductAttention):  # e.g. Transformer Engine's: its kernels, its numerics
            return f"core attention {type(att.core_attention).__name__}"
        if hasattr(layer, "cross_attention") and type(layer.cross_attention).__name__ != "IdentityOp":
            return "cross attention"
    return None


class LeanDecoder:
    """Prefill and decode steps over a GPTModel with a KV cache of roped keys (see the module doc).

    Args:
        m: the unwrapped GPTModel (eval mode, no grad: the caller's context).
        batch: rows of the cache; max_slots: KV slots per row (prompt block + new tokens - 1).
        max_position: the largest position id any row will use (sizes the RoPE table).
    """

    def __init__(self, m, batch: int, max_slots: int, max_position: int) -> None:
        reason = lean_decode_unsupported(m)
        if reason is not None:
            raise ValueError(f"generation.decode_impl=lean does not support {reason}")
        self.m = m
        cfg = m.config
        self.layers = list(m.decoder.layers)
        att = self.layers[0].self_attention
        self.hn = att.hidden_size_per_attention_head
        self.np = att.num_attention_heads_per_partition
        self.ng = att.num_query_groups_per_partition
        self.scale = getattr(att.core_attention, "softmax_scale", None) or self.hn ** -0.5
        p = next(m.parameters())
        # the RoPE table of megatron's own RotaryEmbedding (same frequencies, same cos/sin values)
        freqs = m.rotary_pos_emb.get_freqs_non_repeated(max_position + 1)  # [positions, rot/2]
        emb = torch.cat([freqs, freqs], dim=-1)  # non-interleaved layout, as megatron's get_emb
        self.cos = torch.cos(emb).to(device=p.device, dtype=p.dtype)  # [positions, rot]
        self.sin = torch.sin(emb).to(device=p.device, dtype=p.dtype)
        self.k = [torch.zeros(batch, self.ng, max_slots, self.hn, dtype=p.dtype, device=p.device) for _ in self.layers]
        self.v = [torch.zeros_like(k) for k in self.k]
        self.shared = m.share_embeddings_and_output_weights
        self.cfg = cfg

    def _rope(self, t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """t [b, heads, s, hn], cos/sin [b, 1, s, rot] -> t with RoPE on the first rot dims."""
        rot = cos.shape[-1]
        x, rest = t[..., :rot], t[..., rot:]
        x1, x2 = x.chunk(2, dim=-1)
        out = x * cos + torch.cat((-x2, x1), dim=-1) * sin
        return out if rest.numel() == 0 else torch.cat((out, rest), dim=-1)

    def _attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        """q [b, np, s, hn], k/v [b, ng, L, hn], bias [b, 1, s, L] additive -> [b, np, s, hn].

        A decode step (s = 1) is two batched GEMMs per group: the query heads of a group become the
        rows of one [np/ng, hn] x [hn, L] product against the group's keys, so GQA needs no K/V copy.
        CPU flash attention pays its tiling set-up per (row, head) for a single query (measured 4x
        slower here); prefill (s > 1) keeps SDPA's fused kernel."""
        if q.shape[2] > 1:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=self.scale,
                                                  enable_gqa=self.np != self.ng)
        b, hn, ng = q.shape[0], self.hn, self.ng
        qg = q.reshape(b, ng, self.np // ng, hn)  # heads are group-major (megatron's QKV layout)
        scores = torch.matmul(qg, k.transpose(-1, -2)).mul_(self.scale).add_(bias)  # [b, ng, np/ng, L]
        return torch.matmul(scores.softmax(dim=-1), v).reshape(b, self.np, 1, hn)

    def compact(self, order: torch.Tensor, keep: int) -> None:
        """Move cache rows ``order[:keep]`` to the front (generation's finished-row compaction)."""
        for k, v in zip(self.k, self.v):
            k[:keep] = k[order[:keep]]
            v[:keep] = v[order[:keep]]

    def forward(self, tokens: torch.Tensor, positions: torch.Tensor, masked: torch.Tensor, lo: int) -> torch.Tensor:
        """One prefill or decode step.

        Args:
            tokens, positions: [b, s] ids and position ids of cache slots ``lo .. lo+s-1``.
            masked: bool broadcastable to [b, 1, s, lo+s], True = key slot not attended.
            lo: first slot written.
        Returns:
            [b, V] logits (padded vocabulary) of the last position, fp32 if the model computes in it.
        """
        m, b, s = self.m, tokens.shape[0], tokens.shape[1]
        hi = lo + s
        # [s, b, h]: megatron's layout, so the MoE layers see tokens in the order the megatron path
        # gives them (routing statistics and any recorder agree); s = 1 makes the transposes views
        x = m.embedding(input_ids=tokens, position_ids=positions)
        cos = self.cos[positions][:, None]  # [b, 1, s, rot]
        sin = self.sin[positions][:, None]
        bias = torch.zeros(masked.shape, dtype=x.dtype, device=x.device)
        bias.masked_fill_(masked, torch.finfo(x.dtype).min / 2)  # finite: see attention.py's module doc
        hn, np_, ng = self.hn, self.np, self.ng
        for i, layer in enumerate(self.layers):
            att = layer.self_attention
            h = layer.input_layernorm(x)
            qkv = F.linear(h, att.linear_qkv.weight, att.linear_qkv.bias)  # [s, b, ng*(np/ng+2)*hn]
            qkv = qkv.view(s, b, ng, -1)
            q, k, v = torch.split(qkv, [np_ // ng * hn, hn, hn], dim=3)
            q = q.reshape(s, b, np_, hn)
            if att.q_layernorm is not None:
                q = att.q_layernorm(q)
            if att.k_layernorm is not None:
                k = att.k_layernorm(k)
            q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, heads, s, hn]
            self.k[i][:b, :, lo:hi] = self._rope(k, cos, sin)
            self.v[i][:b, :, lo:hi] = v
            ctx = self._attend(self._rope(q, cos, sin), self.k[i][:b, :, :hi], self.v[i][:b, :, :hi], bias)
            ctx = ctx.permute(2, 0, 1, 3).reshape(s, b, np_ * hn)
            out = F.linear(ctx, att.linear_proj.weight)
            if att.linear_proj.bias is not None:
                out = out + att.linear_proj.bias
            x = x + out
            mlp_out, mlp_bias = layer.mlp(layer.pre_mlp_layernorm(x))
            x = x + mlp_out if mlp_bias is None else x + mlp_out + mlp_bias
        last = x[-1]  # [b, h]: only the last position's logits are used
        if getattr(m.decoder, "final_layernorm", None) is not None:
            last = m.decoder.final_layernorm(last)
        weight = m.shared_embedding_or_output_weight() if self.shared else m.output_layer.weight
        return F.linear(last, weight)
