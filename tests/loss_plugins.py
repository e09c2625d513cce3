"""A policy loss from a module of its own (loaded as `path/to/loss_plugins.py:spo_loss`): what adding a loss
takes, one decorated function whose spec carries its defaults, units, ratio kind and aggregation."""

import torch

from megatron_gspo.algorithms.losses import CONFIGURABLE, RATIO, SEQUENCE, TOKEN, LossSpec, PolicyTerms, policy_loss
from megatron_gspo.runtime.metrics import Metric


@policy_loss(LossSpec(ratio=TOKEN, clip=(0.2, 0.2), units=RATIO, aggregation=CONFIGURABLE))
def spo_loss(b, s, is_weights):
    """SPO: PPO's clip replaced by a quadratic penalty on each token's ratio.

    Implements the surrogate of arXiv 2401.16025 (Simple Policy Optimization): r_t A_t - |A_t| (r_t - 1)^2 / (2 eps), eps = clip_ratio_high for A > 0, clip_ratio_low otherwise.

    b: the prepared batch (losses.LossBatch, [B, T]); s: the resolved settings. r_t = exp(clamp(logp - old_logp,
    +-log_ratio_bound)). The surrogate peaks at r = 1 + eps sign(A), where PPO's clip would flatten it: past it the
    gradient pulls the ratio back (clip_frac_* count those tokens). On-policy (r = 1) its value and gradient are
    the unclipped policy gradient's, as GRPO's."""
    ratio = b.token_ratio(s.log_ratio_bound)
    adv = b.token_adv()
    eps = torch.where(adv > 0, s.clip_ratio_high, s.clip_ratio_low)
    obj = ratio * adv - adv.abs() * (ratio - 1) ** 2 / (2 * eps)
    w = b.token_weights(is_weights)
    if w is not None:
        obj = obj * w
    r_val, m = ratio.detach(), b.mask
    high = ((adv > 0) & (r_val > 1 + s.clip_ratio_high)).expand_as(m)
    low = ((adv < 0) & (r_val < 1 - s.clip_ratio_low)).expand_as(m)
    return PolicyTerms(-obj, per_token=True, metrics={
        "clip_frac_low": Metric.mean(low.to(torch.float64), m),
        "clip_frac_high": Metric.mean(high.to(torch.float64), m),
        "token_ratio/max": Metric.max(r_val, m),
    })


# Plug-ins that return what the plumbing cannot read: each is refused in one line naming loss.name and what its
# formula returned (losses._check_terms), not with a traceback from deep in the plumbing.

def _clip_fracs(b):
    none = torch.zeros_like(b.mask, dtype=torch.float64)
    return {"clip_frac_low": Metric.mean(none, b.mask), "clip_frac_high": Metric.mean(none, b.mask)}


@policy_loss(LossSpec(ratio=TOKEN, clip=(0.2, 0.2), aggregation=CONFIGURABLE))
def float_loss(b, s, is_weights):
    """Returns a number, not PolicyTerms."""
    return 0.5


@policy_loss(LossSpec(ratio=TOKEN, clip=(0.2, 0.2), aggregation=CONFIGURABLE))
def reduced_loss(b, s, is_weights):
    """Returns its per-token terms already reduced to one number (a 0-dim tensor), per_token=True."""
    obj = torch.where(b.mask, b.token_ratio(s.log_ratio_bound) * b.token_adv(), 0.0)
    return PolicyTerms(-obj.sum(), per_token=True, metrics=_clip_fracs(b))


@policy_loss(LossSpec(ratio=SEQUENCE, clip=(0.2, 0.2), aggregation="seq-mean-token-mean"))
def row_short_loss(b, s, is_weights):
    """Returns per-sequence terms for all rows but the last."""
    return PolicyTerms(-(b.seq_log_ratio().exp() * b.seq_adv())[:-1], metrics=_clip_fracs(b))


@policy_loss(LossSpec(ratio=TOKEN, clip=(0.2, 0.2), aggregation=CONFIGURABLE))
def no_metrics_loss(b, s, is_weights):
    """Returns its terms without the clip fractions every loss reports."""
    obj = b.token_ratio(s.log_ratio_bound) * b.token_adv()
    return PolicyTerms(-obj, per_token=True)


@policy_loss(LossSpec(ratio=TOKEN, clip=(0.2, 0.2), aggregation=CONFIGURABLE))
def float_metrics_loss(b, s, is_weights):
    """Returns its clip fractions as plain numbers, not Metrics."""
    obj = b.token_ratio(s.log_ratio_bound) * b.token_adv()
    return PolicyTerms(-obj, per_token=True, metrics={"clip_frac_low": 0.0, "clip_frac_high": 0.0})
