"""DAPO dynamic sampling (arXiv 2503.14476 §3.2): keep only groups whose rewards differ.

A group of G responses to one prompt whose rewards are all equal has advantages exactly 0 under every
group-relative estimator: it adds nothing to the policy gradient but counts in the loss normalizer,
so as accuracy rises (more all-correct groups) the effective batch shrinks. Dynamic sampling drops
such groups and generates more prompts, round after round, until the step has P informative groups:

    round 0: P prompts x G samples -> keep the informative groups
    round r: P more prompts        -> keep, until P are kept or r = max extra rounds

then trains on the first P kept groups in generation order; past the cap, the step is filled up with
the earliest dropped groups (zero advantage: no policy gradient, the batch keeps its shape).
"""

from __future__ import annotations

import torch


def informative_groups(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """[P] bool: True for groups whose rewards are not all equal.

    rewards: [P*G] prompt-major (group i = rows i*G .. i*G+G-1) or [P, G]. DAPO's condition
    0 < |{correct}| < G, generalized to any reward: max > min within the group."""
    r = rewards.reshape(-1, group_size)
    return r.amax(dim=1) > r.amin(dim=1)


def pick_groups(informative: list[list[bool]], needed: int, fill: bool) -> tuple[list[tuple[int, int]], int]:
    """Which groups a step trains on: the first ``needed`` informative ones in (round, group) order.

    informative: per generation round, the informative flag of each of its groups. fill: when fewer
    than ``needed`` are informative, append the earliest uninformative groups up to ``needed`` (the
    last round was the cap). Returns ([(round, group index in round)], number of filled groups); the
    list is shorter than ``needed`` only when fill is False (another round is due)."""
    kept = [(r, g) for r, flags in enumerate(informative) for g, ok in enumerate(flags) if ok][:needed]
    if len(kept) == needed or not fill:
        return kept, 0
    rest = [(r, g) for r, flags in enumerate(informative) for g, ok in enumerate(flags) if not ok]
    extra = rest[: needed - len(kept)]
    return kept + extra, len(extra)
