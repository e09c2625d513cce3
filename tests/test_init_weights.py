"""Initial weights (megatron_gspo/model/init_weights.py): megatron's distributions, drawn from the seed
alone. That TP=2, EP=2 and TP=2 x EP=2 draw the one-rank model's numbers bit for bit is checked in
tests/test_parity_layouts.py (it builds those layouts anyway)."""

import math

import pytest
import torch

from megatron_gspo.config import ParallelConfig, model_config_from_preset
from megatron_gspo.model.init_weights import init_std, unit_name
from megatron_gspo.model.gpt import build_model


def test_unit_names_are_layout_free():
    # local layer 0 of a stage whose first layer is global 5; local expert 1 of EP rank 1 (2 per rank).
    # (The Transformer Engine spec's names, read from TE-spec models: tests/te/test_te_names.py.)
    layers = {0: 5, 1: 6}
    assert unit_name("decoder.layers.0.mlp.experts.local_experts.1.linear_fc1.weight", layers, 2) == \
        "decoder.layers.5.mlp.experts.3.linear_fc1.weight"
    assert unit_name("output_layer.weight", layers, 2) == "output_layer.weight"
    # the input norm under the name both specs' checkpoints use (model.build_layer_spec)
    assert unit_name("decoder.layers.1.input_layernorm.weight", layers, 2) == \
        "decoder.layers.6.self_attention.linear_qkv.layer_norm_weight"


def test_init_std_table():
    assert init_std("decoder.layers.0.self_attention.linear_qkv.weight", 0.02, 8) == 0.02
    assert init_std("decoder.layers.0.mlp.experts.3.linear_fc2.weight", 0.02, 8) == pytest.approx(0.02 / 4)
    assert init_std("decoder.layers.0.self_attention.linear_proj.weight", 0.02, 2) == pytest.approx(0.01)
    for norm in ("decoder.layers.0.input_layernorm.weight", "decoder.final_layernorm.weight",
                 "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight",
                 "decoder.layers.0.self_attention.q_layernorm.weight"):
        assert init_std(norm, 0.02, 2) is None


def test_same_distributions_as_megatrons_own_init_and_reproducible(single_rank):
    cfg = model_config_from_preset("tiny", num_moe_experts=8, hidden_size=128, moe_ffn_hidden_size=128)
    par = ParallelConfig(device="cpu", seed=3)
    st = single_rank(cfg, par)
    ours = dict(build_model(cfg, par, st).named_parameters())
    again = dict(build_model(cfg, par, st).named_parameters())
    other_seed = dict(build_model(cfg, ParallelConfig(device="cpu", seed=4), st).named_parameters())
    torch.manual_seed(0)
    megatron = dict(build_model(cfg, par, st, init_from_seed=False).named_parameters())
    assert ours.keys() == megatron.keys()
    for name, p in ours.items():
        m = megatron[name]
        assert torch.equal(p, again[name]), name  # the seed alone decides
        if torch.all(m == 1):  # norm weights
            assert torch.all(p == 1), name
            continue
        assert not torch.equal(p, other_seed[name]), name
        ratio = p.float().std().item() / m.float().std().item()
        assert abs(ratio - 1) < 0.1, (name, ratio)
        assert abs(p.float().mean().item()) < 3 * m.float().std().item() / math.sqrt(p.numel())  + 1e-4, name
