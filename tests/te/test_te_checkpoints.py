"""Transformer Engine-spec checkpoints through the project's own checkpoint code (megatron_gspo.checkpoint),
on models built construct-only on the CPU: the names the TE spec saves, save -> resume -> strict load
bit-identical (weights, Adam moments, step), and checkpoints moving between the TE and the local spec in
both directions (the local spec saves no extra state for its norms: loading must not fail with "Missing key in
checkpoint state_dict: decoder.layers.self_attention.q_layernorm._extra_state")."""

import dataclasses
import re

import pytest
import torch

from megatron_gspo.config import CheckpointConfig, OptimizerConfig, model_config_from_preset
from megatron_gspo.errors import CheckpointError
from te_spec_names import sharded_keys, te_to_local, tensors

CFG = model_config_from_preset("tiny")


# ----------------------------------------------------------------------------------------------
# what the TE spec is made of, by name
# ----------------------------------------------------------------------------------------------


def test_te_and_local_spec_hold_the_same_tensors_under_the_documented_renames(cpu_models):
    te, _ = cpu_models(CFG, "te")
    local, _ = cpu_models(CFG, "local")
    te_sd, local_sd = tensors(te), tensors(local)
    assert {te_to_local(k) for k in te_sd} == set(local_sd)
    assert len(te_sd) == 33
    # the TE spec's own names, read from the model (no hand-typed list)
    assert "decoder.layers.0.self_attention.linear_qkv.layer_norm_weight" in te_sd
    assert "decoder.layers.1.mlp.experts.linear_fc1.weight3" in te_sd and "decoder.layers.0.input_layernorm.weight" not in te_sd
    extra = {k for k in te.state_dict() if k.endswith("_extra_state")}
    assert "decoder.layers.0.self_attention.core_attention._extra_state" in extra
    assert {"decoder.final_layernorm._extra_state", "decoder.layers.0.pre_mlp_layernorm._extra_state",
            "decoder.layers.0.self_attention.q_layernorm._extra_state"} <= extra
    # the layout-free init draws the same numbers for both specs from one seed
    for k, v in te_sd.items():
        assert torch.equal(v, local_sd[te_to_local(k)]), k


def test_sharded_state_dicts_differ_by_the_te_norm_extra_states_only(cpu_models):
    """The checkpoint names of both specs: the same global keys (layers stacked, experts on their axis),
    plus the extra state of TE's separate norms (q/k, pre-MLP, final), which the local spec's RMSNorm lacks."""
    te, _ = cpu_models(CFG, "te")
    local, _ = cpu_models(CFG, "local")
    a, b = sharded_keys(te), sharded_keys(local)
    assert b <= a
    assert {re.sub(r"/shard_.*", "", k) for k in a - b} == {
        "decoder.final_layernorm._extra_state", "decoder.layers.pre_mlp_layernorm._extra_state",
        "decoder.layers.self_attention.q_layernorm._extra_state",
        "decoder.layers.self_attention.k_layernorm._extra_state"}
    assert "decoder.layers.mlp.experts.experts.linear_fc1.weight" in a
    # 12 global tensors + the extra-state shards of 2 layers: linear_qkv / linear_proj / q, k, pre-MLP norms
    # one per layer, grouped experts one per (layer, expert) for fc1 and fc2, the final norm one
    assert len(a) == 12 + 2 * 5 + 2 * 2 * 4 + 1
    assert not any("core_attention" in k for k in a)  # TE's attention saves nothing


def test_a_strict_load_does_not_need_core_attentions_extra_state(cpu_models):
    """TE 2.20's DotProductAttention lists its ``_extra_state`` in state_dict() but drops it from a strict
    load's missing keys: a checkpoint without it (every torch_dist checkpoint: it is not in the sharded
    state dict) loads strictly. Kept as a test: a TE that stops dropping it breaks every TE resume."""
    te, _ = cpu_models(CFG, "te")
    sd = te.state_dict()
    key = "decoder.layers.0.self_attention.core_attention._extra_state"
    assert key in sd
    te.load_state_dict({k: v for k, v in sd.items() if "core_attention._extra_state" not in k}, strict=True)


# ----------------------------------------------------------------------------------------------
# save -> resume through the checkpoint manager, within and across specs
# ----------------------------------------------------------------------------------------------


def _trained(model, state, step_seed: int):
    """DDP + megatron's optimizer on ``model``, one Adam step on fixed gradients (no forward: a construct-only
    model has none). Returns (ddp, optimizer, scheduler)."""
    from megatron_gspo.model.gpt import wrap_ddp
    from megatron_gspo.trainer.optim import build_optimizer, build_scheduler, optimizer_step

    ddp = wrap_ddp(model, state)
    opt = build_optimizer(OptimizerConfig(lr=1e-2, clip_grad=0.0), ddp, state, bf16=False)
    sched = build_scheduler(OptimizerConfig(lr=1e-2), opt, 10)
    if step_seed is not None:
        ddp.zero_grad_buffer()
        g = torch.Generator().manual_seed(step_seed)
        # gradients keyed by the spec-free unit name: both specs get the same gradient for the same tensor
        from megatron_gspo.model.init_weights import unit_names

        names = unit_names(model, state)
        for n, p in model.named_parameters():
            g.manual_seed(step_seed + sum(map(ord, names[n])))
            p.main_grad.copy_(torch.randn(p.shape, generator=g))
        ok, norm = optimizer_step(opt, state.device)
        assert ok and norm > 0
        sched.step(1)
    return ddp, opt, sched


def _adam_moments(opt, model) -> dict:
    """{parameter name: (exp_avg, exp_avg_sq)} of megatron's (chained) optimizer."""
    by_param = {p: n for n, p in model.named_parameters()}
    out = {}
    for o in getattr(opt, "chained_optimizers", [opt]):
        for group in o.optimizer.param_groups:
            for p in group["params"]:
                st = o.optimizer.state.get(p, {})
                if "exp_avg" in st:
                    out[by_param[p]] = (st["exp_avg"].clone(), st["exp_avg_sq"].clone())
    return out


@pytest.mark.parametrize("saver, loader", [("te", "te"), ("local", "te"), ("te", "local")],
                         ids=["te-to-te", "local-to-te", "te-to-local"])
def test_resume_through_the_checkpoint_manager(cpu_models, tmp_path, saver, loader):
    """Save after one step with the saver's spec, resume with the loader's (CheckpointManager: verify,
    check_compatible, strict load of model, optimizer and scheduler): every weight and Adam moment equal bit
    for bit under the spec renames, and the TE extra states a local checkpoint lacks start fresh."""
    from megatron_gspo.checkpoint.manager import CheckpointManager

    src, st = cpu_models(CFG, saver, seed=3)
    ddp, opt, sched = _trained(src, st, step_seed=11)
    CheckpointManager(CheckpointConfig(save=str(tmp_path)), st).save(1, ddp, opt, sched, extra={"note": saver})

    dst, _ = cpu_models(CFG, loader, seed=4)  # other weights before the resume
    ddp2, opt2, sched2 = _trained(dst, st, step_seed=None)
    manager = CheckpointManager(CheckpointConfig(save=str(tmp_path), resume=True), st)
    assert manager.resuming
    manager.prepare(dst)
    got = manager.restore(ddp2, opt2, sched2)
    assert got["step"] == 1 and got["extra"] == {"note": saver}

    rename = te_to_local if (saver, loader) == ("te", "local") else (lambda k: k)
    back = {rename(k): k for k in tensors(src)} if saver == "te" else None
    src_t, dst_t = tensors(src), tensors(dst)
    for k, v in dst_t.items():
        src_key = k if saver == loader else (back[k] if saver == "te" else te_to_local(k))
        assert torch.equal(v, src_t[src_key]), k
    m_src, m_dst = _adam_moments(opt, src), _adam_moments(opt2, dst)
    assert len(m_dst) == len(dst_t) == len(m_src)
    for k, (a, b) in m_dst.items():
        src_key = k if saver == loader else (back[k] if saver == "te" else te_to_local(k))
        assert torch.equal(a, m_src[src_key][0]) and torch.equal(b, m_src[src_key][1]), k
    assert sched2.num_steps == sched.num_steps == 1


def test_a_checkpoint_missing_a_real_tensor_is_still_refused(cpu_models, tmp_path):
    """Filling extra states is not filling anything: a local checkpoint of a model without q/k norms loaded
    into the TE spec with them fails before loading, naming the tensors."""
    from megatron_gspo.checkpoint import load_model, save_model

    no_qk, _ = cpu_models(dataclasses.replace(CFG, qk_layernorm=False), "local")
    save_model(no_qk, str(tmp_path / "no_qk"))
    te, _ = cpu_models(CFG, "te")
    before = {k: v.clone() for k, v in tensors(te).items()}
    with pytest.raises(CheckpointError, match=r"checkpoint lacks 2 model tensors, e\.g\. \['decoder\.layers\.self_attention\.k_layernorm\.weight', "
                                              r"'decoder\.layers\.self_attention\.q_layernorm\.weight'\]"):
        load_model(te, str(tmp_path / "no_qk"))
    assert all(torch.equal(v, before[k]) for k, v in tensors(te).items())  # nothing half-loaded
