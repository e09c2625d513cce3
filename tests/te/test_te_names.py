"""The Transformer Engine spec's real parameter names against every place the project renames, shards or
initializes by name: init_weights (unit names, distributions), the preflight's TE-vs-local weight copy
(preflight/numerics.copy_weights). The CPU tests check these with names typed by hand; here the names come
from TE-spec models built by model.build_model (construct-only)."""

import dataclasses

import pytest
import torch

from megatron_gspo.config import model_config_from_preset
from te_spec_names import te_to_local, tensors

CFG = model_config_from_preset("tiny")


def test_unit_names_are_the_same_for_both_specs(cpu_models):
    """init_weights' layout-free units (which also name what weight sync streams) do not depend on the spec:
    the TE spec's fused input norm and grouped experts are the local spec's units."""
    from megatron_gspo.model.init_weights import unit_names

    te, st = cpu_models(CFG, "te")
    local, _ = cpu_models(CFG, "local")
    te_units, local_units = unit_names(te, st), unit_names(local, st)
    assert sorted(te_units.values()) == sorted(local_units.values())
    assert te_units["decoder.layers.1.mlp.experts.linear_fc2.weight3"] == "decoder.layers.1.mlp.experts.3.linear_fc2.weight"
    for name, unit in te_units.items():
        assert local_units[te_to_local(name)] == unit, name


def test_every_te_parameter_has_the_local_specs_init_rule(cpu_models):
    from megatron_gspo.model.init_weights import init_std, unit_names

    te, st = cpu_models(CFG, "te")
    for name, unit in unit_names(te, st).items():
        std = init_std(unit, 0.02, CFG.num_layers)  # the unit is spec-free: the local spec's rule
        p = dict(te.named_parameters())[name]
        if std is None:
            assert torch.all(p == 1), name  # norms start at one
        else:
            assert p.dim() == 2 and abs(p.std().item() / std - 1) < 0.25, (name, p.std().item(), std)


@pytest.mark.parametrize("experts", ["te_grouped", "sequential"])
def test_preflight_copies_local_weights_into_the_te_spec(cpu_models, experts):
    """preflight's TE-vs-local log-prob comparison (a GPU item) copies the local spec's weights into the TE
    spec by name: every TE parameter gets exactly its local counterpart, for both TE expert paths."""
    from megatron_gspo.preflight.numerics import copy_weights

    local, _ = cpu_models(dataclasses.replace(CFG, moe_expert_impl="sequential"), "local", seed=1)
    te, _ = cpu_models(dataclasses.replace(CFG, moe_expert_impl=experts), "te", seed=2)
    copy_weights(local, te)
    lt = tensors(local)
    for k, v in tensors(te).items():
        assert torch.equal(v, lt[te_to_local(k)]), k
