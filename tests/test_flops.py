"""The FLOP counter (megatron_gspo.model.flops) on Qwen3-30B-A3B's published shape."""

import pytest

from megatron_gspo.config import model_config_from_preset
from megatron_gspo.model.flops import (decode_flops_per_token, flops_per_token, generation_flops,
                                 matmul_params_per_token, mfu, peak_flops, s_avg)


def test_qwen3_30b_a3b_at_4k_is_23_gflop_per_token():
    cfg = model_config_from_preset("qwen3-30b-a3b")
    f = flops_per_token(cfg, 4096)
    assert f == pytest.approx(23.0e9, rel=2e-3)
    # the terms, spelled out: experts, attention projections, LM head; causal attention
    L, h = 48, 2048
    dense = L * h * 3 * 768 * 8 + L * (h * (32 * 128 + 2 * 4 * 128) + 32 * 128 * h) + h * 151936
    assert matmul_params_per_token(cfg) == dense
    assert f == 6 * dense + 6 * 32 * 128 * L * 4096
    # the log-prob pass is forward only: a third
    assert flops_per_token(cfg, 4096, training=False) == pytest.approx(f / 3)


def test_s_avg_weights_by_tokens():
    assert s_avg(4096) == 4096
    assert s_avg([4096, 4096]) == 4096
    assert s_avg([1000, 3000]) == pytest.approx((1000**2 + 3000**2) / 4000)
    cfg = model_config_from_preset("qwen3-30b-a3b")
    # packing short sequences lowers the attention term only
    assert flops_per_token(cfg, [1024] * 4) < flops_per_token(cfg, 4096)
    with pytest.raises(ValueError):
        s_avg([])


def test_decode_and_generation_flops():
    cfg = model_config_from_preset("tiny")
    p = matmul_params_per_token(cfg)
    assert decode_flops_per_token(cfg, 10) == 2 * p + 4 * 4 * 16 * 2 * 10
    g = generation_flops(cfg, prompt_len=8, new_tokens=3, batch=2)
    assert g == pytest.approx(2 * 8 * flops_per_token(cfg, 8, training=False)
                              + 2 * decode_flops_per_token(cfg, 9) + 2 * decode_flops_per_token(cfg, 10))


def test_peak_and_mfu():
    assert peak_flops("NVIDIA H100 80GB HBM3", "bf16") == 989e12
    assert peak_flops("NVIDIA H100 80GB HBM3", "fp8") == 1979e12
    assert peak_flops("NVIDIA H100 PCIe", "bf16") == 756e12
    assert peak_flops("AMD EPYC", "fp32") is None
    assert mfu(1000.0, 1e9, None) is None
    assert mfu(10_000.0, 23e9, 989e12) == pytest.approx(10_000 * 23e9 / 989e12)


def test_decode_bytes_per_step_by_hand():
    """The 2B proxy at 256 rows: every one of its 32 experts is hit (1 - (24/32)^256 ~ 1), so a step
    reads all ~2.0B parameters in bf16 (the issue's 'reading the 2B weights once per step'); one row
    touches top-8 experts only; the KV cache is rows x context x L x 2 x n_kv x d."""
    from megatron_gspo.config import model_config_from_preset
    from megatron_gspo.model.flops import decode_bytes_per_step

    cfg = model_config_from_preset("qwen3-moe-2b-proxy")
    h, L, V, E, f = 2048, 8, 151936, 32, 768
    attn = h * (32 * 128 + 2 * 4 * 128) + 32 * 128 * h
    full = decode_bytes_per_step(cfg, 256, 96, 2)
    dense = L * (attn + E * h + 2 * h) + h * V + h
    assert full["weights"] == pytest.approx((dense + L * E * 3 * h * f) * 2, rel=1e-9)
    assert full["weights"] == pytest.approx(cfg.num_parameters() * 2 - h * V * 2, rel=0.01)  # all but the embedding
    assert full["kv_cache"] == 256 * 96 * L * 2 * 4 * 128 * 2
    one = decode_bytes_per_step(cfg, 1, 96, 2)
    assert one["weights"] == pytest.approx((dense + L * 8 * 3 * h * f) * 2, rel=1e-9)
    assert one["total"] == one["weights"] + one["kv_cache"]
