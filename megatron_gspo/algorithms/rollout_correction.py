"""Rollout correction: importance sampling between the rollout (behaviour) policy and the old policy.

The rollout samples with log-probs ``rollout_logp`` (recorded by the generator); the loss treats the
old policy's ``old_logp`` as the behaviour policy. When generation runs other kernels or another
precision than training (FP8, CUDA graphs, a separate inference engine), the two differ and the
policy gradient is off-policy by rho = pi_old / pi_rollout. Two corrections re-weight the loss:

    tis  truncated IS (Yao et al., "Your efficient RL framework secretly brings you off-policy RL
         training", 2025; verl rollout_is truncate):        w = min(rho, C)
    mis  masked IS (verl rollout_is mask mode, slime MIS):  w = rho if C_low <= rho <= C else 0

at token level (rho_t = exp(old_logp_t - rollout_logp_t)) or sequence level (rho_i = prod_t rho_t).
Both are exact no-ops when rho is 1: log rho = 0 exactly, exp(0) = 1.0 and the loss multiplies by
1.0, so the loss and its gradient are bit-identical to no correction (tests/test_rollout_correction.py).
With ``train.old_logprobs=rollout`` the old log-probs *are* the rollout's, so rho == 1 by construction.

The mismatch metrics measure the gap itself between a training forward and the rollout's log-probs
(``mismatch_metrics``): the k3 estimate of KL(pi_rollout || pi_train), mean / max |delta log-prob| and
the share of tokens whose rho leaves [C_low, C].
"""

from __future__ import annotations

import math
from typing import Optional

import torch

from megatron_gspo.runtime.metrics import Metric

Tensor = torch.Tensor

# |log rho| is bounded before exp, as in losses.py: a long sequence's summed log-ratio must not overflow.
LOG_RATIO_BOUND = 20.0


def inactive_reason(mode: str, recompute_old_logprobs: bool) -> Optional[str]:
    """Why ``rollout_correction.mode`` cannot correct anything in a job, or None. ``recompute_old_logprobs``:
    the job's resolved old-log-prob source (config.old_logprob_source); without that pass the
    rollout's log-probs serve as the old policy's, rho == 1 by construction and every weight is 1.0."""
    if mode == "off" or recompute_old_logprobs:
        return None
    return (f"rollout_correction.mode={mode} corrects nothing in this job: the old log-probs are the rollout's "
            "(train.old_logprobs resolves to rollout), so pi_old / pi_rollout is exactly 1 and every weight 1.0; "
            "set train.old_logprobs=recompute to measure and correct a mismatch between rollout and training")


def log_rho(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, level: str) -> Tensor:
    """log(pi_old / pi_rollout): [B, T] for level "token" (0 off-mask), [B] for "sequence" (the sum
    over the response's tokens, i.e. the log of the product of the token ratios).

    old_logp, rollout_logp: [B, T] fp32 on the shifted token grid; mask: [B, T] bool response tokens."""
    m = mask if mask.dtype == torch.bool else mask != 0
    d = torch.where(m, old_logp.detach().float() - rollout_logp.detach().float(), 0.0)
    if level == "token":
        return d
    if level == "sequence":
        return d.sum(dim=-1)
    raise ValueError(f"level={level!r} is not one of ['token', 'sequence']")


def correction_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: str, level: str,
                       low: float, high: float) -> tuple[Optional[Tensor], dict[str, Metric]]:
    """Importance weights of the loss terms and their metrics (Yao et al. 2025 TIS; verl/slime MIS).

    TIS: w = min(rho, high); MIS: w = rho where low <= rho <= high, else 0. Returns (weights, metrics):
    weights [B, T] (level "token") or [B] (level "sequence"), detached fp32 on the inputs' device, or
    None for mode "off". Metrics: rollout_correction/weight_mean|min|max and the share of tokens
    (or sequences) truncated (tis) or masked (mis)."""
    if mode == "off":
        return None, {}
    lr = log_rho(old_logp, rollout_logp, mask, level)
    rho = lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()
    m = mask if mask.dtype == torch.bool else mask != 0
    sel = m if level == "token" else m.any(dim=-1)
    if mode == "tis":
        cut = rho > high
        w = torch.where(cut, torch.full_like(rho, high), rho)
        name = "rollout_correction/truncated_frac"
    elif mode == "mis":
        cut = (rho < low) | (rho > high)
        w = torch.where(cut, torch.zeros_like(rho), rho)
        name = "rollout_correction/masked_frac"
    else:
        raise ValueError(f"mode={mode!r} is not one of ['off', 'tis', 'mis']")
    metrics = {
        "rollout_correction/weight_mean": Metric.mean(w, sel),
        "rollout_correction/weight_min": Metric.min(w, sel),
        "rollout_correction/weight_max": Metric.max(w, sel),
        name: Metric.mean(cut.to(torch.float64), sel),
    }
    return w, metrics


def mismatch_metrics(train_logp: Tensor, rollout_logp: Tensor, mask: Tensor, low: float, high: float,
                     prefix: str = "rollout/") -> dict[str, Metric]:
    """How far the training forward's log-probs are from the rollout's, per response token.

    train_logp, rollout_logp, mask: [B, T]. With d = train_logp - rollout_logp (log rho):
      mismatch_k3            mean of exp(d) - d - 1: k3 estimate of KL(pi_rollout || pi_train) (tokens
                             sampled from the rollout policy; Schulman's k3, as verl's rollout_is metrics)
      logprob_diff_mean/max  mean / max |d|
      mismatch_ratio_out_frac share of tokens with exp(d) outside [low, high]"""
    m = mask if mask.dtype == torch.bool else mask != 0
    d = torch.where(m, train_logp.detach().double() - rollout_logp.detach().double(), 0.0)
    gap = d.abs()
    lo = math.log(low) if low > 0 else -math.inf
    out = (d < lo) | (d > math.log(high))
    return {
        f"{prefix}mismatch_k3": Metric.mean(torch.expm1(d) - d, m),
        f"{prefix}logprob_diff_mean": Metric.mean(gap, m),
        f"{prefix}logprob_diff_max": Metric.max(gap, m),
        f"{prefix}mismatch_ratio_out_frac": Metric.mean(out.to(torch.float64), m),
    }
