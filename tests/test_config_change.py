"""The resume policy of every job field (checkpoint/config_change.py): declared once, for every field."""

import pytest

from megatron_gspo.checkpoint import config_change as cc
from megatron_gspo.config import JobConfig, Resume, to_dict, walk_knobs
from megatron_gspo.errors import ConfigError

KEYS = sorted(cc.flatten(to_dict(JobConfig())))


def test_every_field_declares_a_resume_policy():
    """Every field of every section (nested sections walked) is declared with knob(resume=...): a field added
    without one fails here, by name."""
    declared = walk_knobs(JobConfig)
    undeclared = [key for key, k in declared if k is None or not isinstance(k.resume, Resume)]
    assert undeclared == []
    assert len(declared) > 100  # the whole job, not one section


def test_the_declared_policies_are_the_checkpoints_keys():
    """The walk of the dataclasses and the saved config (to_dict) name the same keys: a resume compares those."""
    assert sorted(cc.POLICIES) == KEYS


def test_trainer_and_rollout_layouts_are_treated_alike():
    """Issue 31: the rollout ranks' layout keys were refused while the trainer's parallel.* were allowed."""
    for key in cc.LAYOUT:
        assert cc.policy(key) == "may change", key
    assert {k.split(".", 1)[1] for k in cc.LAYOUT if k.startswith("rollout.")} <= \
        {k.split(".", 1)[1] for k in cc.LAYOUT if k.startswith("parallel.")} | {"world_size"}


@pytest.mark.parametrize("key, old, new", [
    # documented as result-neutral (docs/configuration.md), refused before
    ("generation.finished_check_interval", 0, 4),
    ("generation.cuda_graphs", False, True),
    ("rollout.weight_sync_bucket_mb", 256.0, 64.0),
    ("rollout.heartbeat_timeout_s", 60.0, 120.0),
    ("rollout.tensor_model_parallel_size", 1, 2),
    ("rollout.world_size", 1, 2),
])
def test_result_neutral_keys_resume_changed(key, old, new):
    section, name = key.split(".")
    saved, current = to_dict(JobConfig()), to_dict(JobConfig())
    saved[section][name], current[section][name] = old, new
    accepted = cc.check_resume_config("ckpt", saved, current)
    assert [(c.key, c.old, c.new, c.why) for c in accepted] == [(key, old, new, "may change at resume")]


@pytest.mark.parametrize("key, old, new", [
    ("rollout.mode", "colocated", "async"),
    ("rollout.max_staleness", 1, 2),
    ("generation.temperature", 1.0, 0.7),
    ("loss.name", "gspo", "grpo"),
    ("parallel.device", "auto", "cpu"),
])
def test_trajectory_keys_are_refused_unless_allowed(key, old, new):
    section, name = key.split(".")
    saved, current = to_dict(JobConfig()), to_dict(JobConfig())
    saved[section][name], current[section][name] = old, new
    with pytest.raises(ConfigError, match=rf"{key} {old!r} -> {new!r}: this changes the training trajectory"):
        cc.check_resume_config("ckpt", saved, current)
    accepted = cc.check_resume_config("ckpt", saved, current, allow=[section])
    assert [c.why for c in accepted] == ["checkpoint.allow_config_change"]


def test_a_key_without_a_declared_policy_is_refused(monkeypatch):
    """The safe side for a field nobody declared: refused, as a trajectory change."""
    monkeypatch.setattr(cc, "POLICIES", {k: p for k, p in cc.POLICIES.items() if k != "train.log_interval"})
    saved, current = to_dict(JobConfig()), to_dict(JobConfig())
    current["train"]["log_interval"] = saved["train"]["log_interval"] + 1
    with pytest.raises(ConfigError, match="train.log_interval"):
        cc.check_resume_config("ckpt", saved, current)
