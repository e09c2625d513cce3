"""Group-relative advantage estimators (GRPO / GSPO / Dr. GRPO / MaxRL).

Each prompt is answered ``group_size`` times; a response's advantage is its reward relative to the
other responses to the same prompt, so no value network is needed:

    grpo      A_i = (r_i - mean(r_group)) / (std(r_group) + eps)     GSPO paper §4.1, GRPO (DeepSeekMath)
    dr_grpo   A_i =  r_i - mean(r_group)                              Dr. GRPO (arXiv 2503.20783): no std division
    mean_only alias of dr_grpo
    maxrl     A_i = (r_i - mean(r_group)) / mean(r_group)             MaxRL (arXiv 2602.02710), as prime-rl / SkyRL

Rewards are laid out prompt-major: ``[P*G]`` (prompt 0's G responses first) or ``[P, G]``.
The result is always flat ``[P*G]`` in the same order, one advantage per response; the loss
broadcasts it over the response's tokens.

Standard deviation: we use the *unbiased* (Bessel, divide by G-1) std, as ``torch.std`` does by
default and as verl, TRL and OpenRLHF compute it, so advantages can be cross-checked against
those implementations directly. The papers just write "std"; for
G=16 the two conventions differ by a factor sqrt(16/15) ~ 1.03, i.e. a learning-rate rescale.

A group whose rewards are all equal carries no learning signal: its advantages are exactly 0
(never NaN, never eps-sized noise from a rounded mean). With G=1 every group is such a group.
"""

from __future__ import annotations

from typing import Callable

import torch

AdvantageEstimator = Callable[[torch.Tensor, int], torch.Tensor]

# name -> estimator, in registration order; config.ADVANTAGE_ESTIMATOR_NAMES lists the same names (the
# config is a leaf and cannot import this file: tests/test_config.py checks they agree)
ADVANTAGE_ESTIMATORS: dict[str, AdvantageEstimator] = {}


def register_advantage(*names: str) -> Callable[[AdvantageEstimator], AdvantageEstimator]:
    """Decorator: register an estimator under each of ``names`` (the values of
    ``train.advantage_estimator``; more than one: aliases); called as ``fn(rewards, group_size)``."""
    def register(fn: AdvantageEstimator) -> AdvantageEstimator:
        for name in names:
            if name in ADVANTAGE_ESTIMATORS:
                raise ValueError(f"advantage estimator {name!r} is registered twice "
                                 f"({ADVANTAGE_ESTIMATORS[name].__qualname__} and {fn.__qualname__})")
            ADVANTAGE_ESTIMATORS[name] = fn
        return fn
    return register


def _validate(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """Check the layout and values; return rewards as [P, G] float64."""
    if isinstance(group_size, bool) or not isinstance(group_size, int) or group_size < 1:
        raise ValueError(f"group_size must be a positive integer, got {group_size!r}")
    r = torch.as_tensor(rewards)
    if r.dim() == 2:
        if r.shape[1] != group_size:
            raise ValueError(
                f"rewards of shape {tuple(r.shape)} must be [num_prompts, group_size] with group_size={group_size}"
            )
    elif r.dim() == 1:
        if r.numel() % group_size != 0:
            raise ValueError(
                f"rewards length {r.numel()} is not divisible by group_size {group_size}"
            )
    else:
        raise ValueError(f"rewards must be 1-D [P*G] or 2-D [P, G], got shape {tuple(r.shape)}")
    r = r.detach().to(torch.float64).reshape(-1, group_size)
    bad = (~torch.isfinite(r)).reshape(-1).nonzero().flatten().tolist()
    if bad:
        shown = bad[:16]
        more = f" (+{len(bad) - len(shown)} more)" if len(bad) > len(shown) else ""
        raise ValueError(f"rewards contain non-finite values at flat indices {shown}{more}")
    return r


def group_advantages(
    rewards: torch.Tensor, group_size: int, normalize_std: bool = True, eps: float = 1e-6
) -> torch.Tensor:
    """Group-relative advantages.

    rewards: [P*G] or [P, G] (prompt-major), any real dtype.
    group_size: G, responses per prompt.
    normalize_std: divide by (unbiased group std + eps) (GRPO); False = mean-centering only (Dr. GRPO).
    Returns [P*G] in the rewards' floating dtype (float32 for integer/bool rewards), on the same device.
    Raises ValueError on a layout that does not match group_size or on non-finite rewards.
    """
    if eps < 0:
        raise ValueError(f"eps must be >= 0, got {eps}")
    r = _validate(rewards, group_size)  # [P, G] float64: the subtraction below is exact enough
    mean = r.mean(dim=1, keepdim=True)
    adv = r - mean
    if normalize_std and group_size > 1:
        std = r.std(dim=1, keepdim=True, correction=1)
        adv = adv / (std + eps)
    # Exact zeros for constant groups: (r - mean) can be ~1e-17 when the mean rounds, and that
    # divided by eps would be a spurious signal.
    constant = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True))
    adv = torch.where(constant, torch.zeros_like(adv), adv)

    src = torch.as_tensor(rewards)
    out_dtype = src.dtype if src.dtype.is_floating_point else torch.float32
    return adv.reshape(-1).to(dtype=out_dtype, device=src.device)


@register_advantage("grpo")
def grpo_advantages(rewards: torch.Tensor, group_size: int, eps: float = 1e-6) -> torch.Tensor:
    """(r - group mean) / (group std + eps); the estimator of GRPO and GSPO."""
    return group_advantages(rewards, group_size, normalize_std=True, eps=eps)


@register_advantage("dr_grpo", "mean_only")
def dr_grpo_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """r - group mean (Dr. GRPO: dividing by the std up-weights near-constant groups)."""
    return group_advantages(rewards, group_size, normalize_std=False)


@register_advantage("maxrl")
def maxrl_advantages(rewards: torch.Tensor, group_size: int) -> torch.Tensor:
    """MaxRL (arXiv 2602.02710): A_i = (r_i - mean(r_group)) / mean(r_group), GRPO's centred reward normalized by
    the group's mean instead of its std: the policy gradient of the order-G truncation of the maximum-likelihood
    objective, which weighs a prompt solved with probability p about 1 / p (hard prompts count more).

    rewards: [P*G] or [P, G] (prompt-major), any real dtype; returns [P*G] as group_advantages does. The rewards
    are meant to be >= 0 (a pass rate; canonically binary): a group whose mean is <= 0 carries no signal and gets
    0 (prime-rl's rule; SkyRL divides by mean + 1e-6, the same for binary rewards), as does a constant group."""
    r = _validate(rewards, group_size)  # [P, G] float64
    mean = r.mean(dim=1, keepdim=True)
    constant = (r.amax(dim=1, keepdim=True) == r.amin(dim=1, keepdim=True)) | (mean <= 0)
    adv = torch.where(constant, torch.zeros_like(r), (r - mean) / torch.where(constant, 1.0, mean))
    src = torch.as_tensor(rewards)
    out_dtype = src.dtype if src.dtype.is_floating_point else torch.float32
    return adv.reshape(-1).to(dtype=out_dtype, device=src.device)


def get_advantage_estimator(name: str) -> AdvantageEstimator:
    """The estimator registered under ``name``; called as ``fn(rewards, group_size)``."""
    try:
        return ADVANTAGE_ESTIMATORS[name]
    except KeyError:
        raise ValueError(
            f"unknown advantage estimator {name!r}; valid names: {sorted(ADVANTAGE_ESTIMATORS)}"
        ) from None
