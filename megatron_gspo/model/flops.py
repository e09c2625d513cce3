"""Model FLOPs of a Qwen3-MoE decoder, for TFLOP/s and MFU reporting.

Counted per token (dense matmul FLOPs only: a multiply-add is 2 FLOPs; norms, softmax, router,
activations and RoPE are not counted, as in the PaLM / Megatron-LM MFU convention), training =
forward + backward = 3 x forward:

    F_train(token) = 6 * (  L * h * 3 * f_moe * k                          routed experts (SwiGLU: gate, up, down)
                          + L * (h * (n_q*d + 2*n_kv*d) + n_q*d * h)        attention projections q, k, v, o
                          + h * V )                                          LM head
                     + 6 * n_q * d * L * s_avg                              causal attention (QK^T and PV)

    s_avg = sum_i s_i^2 / sum_i s_i   over the sequences s_i of the batch

The attention term: a causal sequence of length s costs 2 (QK^T) + 2 (PV) FLOPs x n_q*d per (query,
key) pair over s^2/2 pairs, i.e. 2*n_q*d*s^2 per layer forward, 2*n_q*d*s per token; x3 for
training. Averaged over tokens of sequences of different lengths this is s_avg above. A forward-only
pass (the RL log-prob pass) is a third of F_train. A decode step (KV cache, context c) costs
2 * (the matmul params per token) + 4 * n_q * d * L * c: its single query attends all c keys.

    MFU = achieved FLOP/s per GPU / peak dense FLOP/s of the GPU in the compute dtype
        = tokens/s per GPU * F(token) / peak

For Qwen3-30B-A3B (48 layers, h 2048, 128 experts top-8 of 768, 32 q / 4 kv heads of 128, vocab
151936) at 4096-token sequences F_train is 23.0 GFLOP/token.

A decode step's floor is memory, not FLOPs: ``decode_bytes_per_step`` counts the bytes it must read
(the weights any row needs, the KV cache); benchmarks/run.py divides them by the device's measured
copy bandwidth.
"""

from __future__ import annotations

from typing import Optional, Sequence, Union

from megatron_gspo.config import ModelConfig

SeqLens = Union[int, float, Sequence[int]]


def s_avg(seq_lens: SeqLens) -> float:
    """Token-weighted mean sequence length: sum s_i^2 / sum s_i (a number is one length)."""
    if isinstance(seq_lens, (int, float)):
        return float(seq_lens)
    lens = [int(s) for s in seq_lens]
    total = sum(lens)
    if total <= 0:
        raise ValueError("s_avg: the sequences hold no tokens")
    return sum(s * s for s in lens) / total


def matmul_params_per_token(cfg: ModelConfig) -> int:
    """Weights a token is multiplied with (active experts, attention projections, LM head)."""
    h, L, d = cfg.hidden_size, cfg.num_layers, cfg.kv_channels
    nq, nkv = cfg.num_attention_heads, cfg.num_query_groups
    experts = L * h * 3 * cfg.moe_ffn_hidden_size * cfg.moe_router_topk
    attn = L * (h * (nq * d + 2 * nkv * d) + nq * d * h)
    head = h * cfg.vocab_size
    return experts + attn + head


def flops_per_token(cfg: ModelConfig, seq_lens: SeqLens, training: bool = True) -> float:
    """Model FLOPs per token of a training step (forward + backward), or of a forward-only pass
    (``training=False``: the log-prob pass, a third), for sequences of these lengths."""
    f = 6.0 * matmul_params_per_token(cfg) + 6.0 * cfg.num_attention_heads * cfg.kv_channels * cfg.num_layers * s_avg(seq_lens)
    return f if training else f / 3.0


def decode_flops_per_token(cfg: ModelConfig, context_len: float) -> float:
    """Forward FLOPs of one generated token attending ``context_len`` cached positions."""
    return 2.0 * matmul_params_per_token(cfg) + 4.0 * cfg.num_attention_heads * cfg.kv_channels * cfg.num_layers * context_len


def generation_flops(cfg: ModelConfig, prompt_len: int, new_tokens: int, batch: int) -> float:
    """FLOPs of a KV-cache generation: the prefill forward of the prompts and ``new_tokens - 1``
    decode steps (the last sampled token is never fed back)."""
    prefill = batch * prompt_len * flops_per_token(cfg, prompt_len, training=False)
    decode = sum(batch * decode_flops_per_token(cfg, prompt_len + j + 1) for j in range(new_tokens - 1))
    return prefill + decode


def decode_bytes_per_step(cfg: ModelConfig, rows: int, context_len: float, bytes_per_param: int) -> dict:
    """The bytes one decode step of ``rows`` rows must read at least (its floor on a memory-bound
    device is this over the memory bandwidth):

        weights  every dense weight once (attention projections, norms, router, LM head; the embedding
                 rows of the fed tokens are negligible), and each routed expert's three matrices once if
                 any row routes to it: E (1 - (1 - k/E)^rows) distinct experts per layer, the expected
                 count for routes spread uniformly (a skewed router touches fewer);
        kv_cache the cached keys and values of every row: rows x context x L x 2 x n_kv x d.

    Returns {"weights", "kv_cache", "total"} in bytes (``bytes_per_param``: 2 for bf16)."""
    h, L, d, E, k = cfg.hidden_size, cfg.num_layers, cfg.kv_channels, cfg.num_moe_experts, cfg.moe_router_topk
    nq, nkv = cfg.num_attention_heads, cfg.num_query_groups
    attn = h * (nq * d + 2 * nkv * d) + nq * d * h
    dense = L * (attn + E * h + 2 * h) + h * cfg.vocab_size + h
    touched = E * (1.0 - (1.0 - k / E) ** rows)
    experts = L * touched * 3 * h * cfg.moe_ffn_hidden_size
    weights = (dense + experts) * bytes_per_param
    kv = rows * context_len * L * 2 * nkv * d * bytes_per_param
    return {"weights": weights, "kv_cache": kv, "total": weights + kv}


# Peak dense (no sparsity) tensor-core FLOP/s per GPU, by compute dtype. bf16 / fp8 from NVIDIA's
# datasheets (SXM parts); "fp32" is the non-tensor-core FP32 rate.
_PEAKS = {
    "H100": {"bf16": 989e12, "fp8": 1979e12, "fp32": 67e12},
    "H200": {"bf16": 989e12, "fp8": 1979e12, "fp32": 67e12},
    "H800": {"bf16": 989e12, "fp8": 1979e12, "fp32": 67e12},
    "B200": {"bf16": 2250e12, "fp8": 4500e12, "fp32": 80e12},
    "A100": {"bf16": 312e12, "fp32": 19.5e12},
    "A10G": {"bf16": 70e12, "fp32": 31e12},
    "L40S": {"bf16": 362e12, "fp8": 733e12, "fp32": 91.6e12},
}


def peak_flops(device_name: str, dtype: str) -> Optional[float]:
    """Peak dense FLOP/s of a GPU (``torch.cuda.get_device_name()``) for "bf16" | "fp8" | "fp32";
    None when unknown (CPUs, unlisted GPUs): MFU is then not reported."""
    name = device_name.upper()
    if "H100" in name and "PCIE" in name:  # H100 PCIe: 756 bf16 / 1513 fp8 / 51 fp32
        return {"bf16": 756e12, "fp8": 1513e12, "fp32": 51e12}.get(dtype)
    for key, peaks in _PEAKS.items():
        if key in name:
            return peaks.get(dtype)
    return None


def mfu(tokens_per_s_per_gpu: float, flops_per_tok: float, peak: Optional[float]) -> Optional[float]:
    """Model FLOPs utilization in [0, 1], or None without a known peak."""
    if not peak:
        return None
    return tokens_per_s_per_gpu * flops_per_tok / peak
