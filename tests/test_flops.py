"""The FLOP counter (megatron_gspo.flops) on Qwen3-30B-A3B's published shape."""

import pytest

from megatron_gspo.config import model_config_from_preset
from megatron_gspo.flops import (decode_flops_per_token, flops_per_token, generation_flops,
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
