"""The Transformer Engine spec built on the CPU through the project's own code (model.build_model with
construct_only=True): what it is made of, that its forward is refused with the reason, and that
nothing of the construction's stand-in outlives it."""

import pytest
import torch

from megatron_gspo.config import ConfigError, model_config_from_preset
from megatron_gspo.model.gpt import ConstructOnlyError, forward_logits, resolve_impl


def _tiny(**kw):
    return model_config_from_preset("tiny", **kw)


def test_te_spec_builds_on_the_cpu_with_te_modules(cpu_models):
    from megatron.core.extensions.transformer_engine import TEGroupedLinear, TELayerNormColumnParallelLinear

    m, st = cpu_models(_tiny(), "te")
    assert m.construct_only and st.device.type == "cpu"
    assert isinstance(m.decoder.layers[0].self_attention.linear_qkv, TELayerNormColumnParallelLinear)
    assert isinstance(m.decoder.layers[0].mlp.experts.linear_fc1, TEGroupedLinear)
    assert all(p.device.type == "cpu" for p in m.parameters())
    # the construction's stand-in is gone: torch says what it said before
    assert torch.cuda.is_available() is False or torch.cuda.device_count() > 0


def test_forward_of_a_construct_only_model_is_refused_with_the_reason(cpu_models):
    m, _ = cpu_models(_tiny(), "te")
    tokens = torch.zeros(1, 4, dtype=torch.long)
    with pytest.raises(ConstructOnlyError, match="built construct-only.*kernels need a CUDA device"):
        forward_logits(m, tokens)
    # a TE module called directly is refused the same way, before TE reaches for a kernel
    with pytest.raises(ConstructOnlyError, match="TELayerNormColumnParallelLinear"):
        m.decoder.layers[0].self_attention.linear_qkv(torch.zeros(4, 1, 64))


def test_construct_only_is_refused_where_it_does_not_apply():
    with pytest.raises(ConfigError, match="needs model.transformer_impl='transformer_engine'"):
        resolve_impl(_tiny(transformer_impl="local"), torch.device("cpu"), construct_only=True)
    with pytest.raises(ConfigError, match="builds and runs for real"):
        resolve_impl(_tiny(transformer_impl="transformer_engine"), torch.device("cuda", 0), construct_only=True)
    # a job (no construct_only) on the CPU with TE importable: refused, with the reason
    with pytest.raises(ConfigError, match="runs on cpu and Transformer Engine.s kernels need a CUDA device"):
        resolve_impl(_tiny(transformer_impl="transformer_engine"), torch.device("cpu"))
    assert resolve_impl(_tiny(), torch.device("cpu")) == "local"
