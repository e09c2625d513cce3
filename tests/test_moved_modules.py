"""The deprecated aliases of moved modules: each warns with a FutureWarning naming
the new path, and *is* the new module (same objects: a hook subclassing the old path's TrainerHook is a
TrainerHook; a reward registered through the old path is in the one registry)."""

import importlib
import sys

import pytest

SHIMS = {'hooks': 'trainer.hooks', 'rewards': 'data.rewards'}


@pytest.mark.parametrize("old,new", sorted(SHIMS.items()))
def test_moved_module_alias_warns_and_is_the_new_module(old, new):
    new_mod = importlib.import_module(f"megatron_gspo.{new}")
    saved = sys.modules.pop(f"megatron_gspo.{old}", None)
    try:
        with pytest.warns(FutureWarning, match=rf"megatron_gspo\.{old} is deprecated .* import megatron_gspo\.{new}"):
            old_mod = importlib.import_module(f"megatron_gspo.{old}")
    finally:
        if saved is not None:
            sys.modules[f"megatron_gspo.{old}"] = saved
    assert old_mod is new_mod


def test_trainer_hook_through_the_old_path_is_the_trainers():
    with pytest.warns(FutureWarning):
        sys.modules.pop("megatron_gspo.hooks", None)
        from megatron_gspo.hooks import TrainerHook
    from megatron_gspo.trainer import TrainerHook as New
    assert TrainerHook is New


def test_reward_registered_through_the_old_path_is_registered():
    with pytest.warns(FutureWarning):
        sys.modules.pop("megatron_gspo.rewards", None)
        old = importlib.import_module("megatron_gspo.rewards")
    from megatron_gspo.data import rewards
    from megatron_gspo.data.rewards import registry

    name = "_moved_module_test_reward"
    registry._REGISTRY.pop(name, None)
    try:
        @old.register_reward(name)
        def _reward(prompt, response, answer, **kwargs):
            return 1.0

        assert rewards.resolve_reward(name).target is _reward
    finally:
        registry._REGISTRY.pop(name, None)
