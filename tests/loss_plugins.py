"""A policy loss from a module of its own (loaded as `path/to/loss_plugins.py:spo_loss`): what adding a loss
takes, one decorated function whose spec carries its defaults, units, ratio kind and aggregation."""

import torch

from megatron_gspo.algorithms.losses import CONFIGURABLE, RATIO, TOKEN, LossSpec, PolicyTerms, policy_loss
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

