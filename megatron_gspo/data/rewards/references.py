"""Reference answers a reward cannot read, counted before training (a reward declares its check:
``reference_check=`` in register_reward)."""

from __future__ import annotations

import logging
from typing import Optional, Sequence

from megatron_gspo.config import RewardConfig
from megatron_gspo.data.rewards.registry import registered_spec
from megatron_gspo.errors import DataError, clip_repr

log = logging.getLogger("megatron_gspo")


def check_reference_answers(cfg: RewardConfig, references: Sequence[tuple[str, Optional[str]]], source: str) -> int:
    """Count the references ``[(where, answer)]`` of ``source`` that ``reward.name`` cannot read (its
    declared reference check; rewards without one are not checked): said with examples when any,
    refused (DataError) above reward.max_unreadable_reference_frac of them. Returns the count."""
    spec = registered_spec(cfg.name)
    problem = spec.reference_check if spec is not None else None
    if problem is None or not references:
        return 0
    bad = [(where, answer, why) for where, answer in references if (why := problem(answer)) is not None]
    if not bad:
        return 0
    share = len(bad) / len(references)
    reasons: dict[str, list[str]] = {}
    for where, answer, why in bad[:3]:  # a few examples, grouped by what is wrong with them
        reasons.setdefault(why, []).append(f"{where} {clip_repr(answer, 60)}")
    examples = "; ".join(f"{why}, e.g. {', '.join(found)}" for why, found in reasons.items())
    what = (f"{source}: the {cfg.name} reward cannot read {len(bad)} of {len(references)} reference answers "
            f"({share:.1%}): {examples}")
    if share > cfg.max_unreadable_reference_frac:
        raise DataError(f"{what}; every response to such a prompt scores 0. Give the references as "
                        "'... #### <answer>', '\\boxed{<answer>}' or a plain number or expression, or allow "
                        f"more than reward.max_unreadable_reference_frac={cfg.max_unreadable_reference_frac:g}")
    log.warning("%s; every response to such a prompt scores 0 (allowed: at most reward.max_unreadable_reference_frac"
                "=%g of them)", what, cfg.max_unreadable_reference_frac)
    return len(bad)
