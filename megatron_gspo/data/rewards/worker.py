"""The reward handler of the worker pool (runtime/workers.py), for ``reward.num_workers > 1``.

Built once per worker process from the reward's name (as the trainer loaded it) and its settings; each
request is one row ``(prompt, response, answer)``, answered with batch.score_one's value: the same float, or
the same SampleFailed, as in the trainer's process.
"""

from __future__ import annotations


def reward_handler(name: str, settings: dict):
    """``handle((prompt, response, answer), note)`` -> float or SampleFailed, for the reward ``name``."""
    from megatron_gspo.data.rewards.batch import score_one
    from megatron_gspo.data.rewards.registry import resolve_reward

    fn = resolve_reward(name).target
    return lambda row, note: score_one(fn, settings, *row)
