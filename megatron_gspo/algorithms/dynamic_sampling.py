"""DAPO dynamic sampling (arXiv 2503.14476 §3.2): keep only groups whose rewards differ.

A group of G responses to one prompt whose rewards are all equal has advantages exactly 0 under every
group-relative estimator: it adds nothing to the policy gradient but counts in the loss normalizer,
so as accuracy rises (more all-correct groups) the effective batch shrinks. Dynamic sampling drops
such groups and generates more prompts, round after round, until the step has P informative groups:

    round 0: P prompts x G samples -> keep the informative groups
    round r: P more prompts        -> keep, until P are kept or r = max extra rounds

then trains on the first P kept groups in generation order; past the cap, the step is filled up with
the earliest dropped groups (zero advantage: no policy gradient, the batch keeps its shape).

Between rounds only what can still be picked is kept (``prune_groups``): at most P groups, so a step's
memory does not grow with its rounds.
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


def prune_groups(groups: list, needed: int, informative=lambda g: g[0]) -> list:
    """The groups a step can still pick: the first ``needed`` informative ones and the earliest
    uninformative ones up to ``needed`` minus those (the fill-up of ``pick_groups``), each part in
    (round, group) order, informative first; every other group can never be picked and may be freed.
    At most ``needed`` groups: ``pick_groups``' answer for the same rounds once the step ends.
    groups: in (round, group) order; ``informative(group)`` says which ones carry signal."""
    inf = [g for g in groups if informative(g)][:needed]
    rest = [g for g in groups if not informative(g)][: needed - len(inf)]
    return inf + rest
