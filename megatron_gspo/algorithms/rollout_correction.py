"""Rollout correction: importance sampling or masking between the rollout (behaviour) policy and the trained one.

The rollout samples with log-probs ``rollout_logp`` (recorded by the generator); the loss treats the
old policy's ``old_logp`` as the behaviour policy. When generation runs other kernels or another
precision than training (FP8, CUDA graphs, a separate inference engine), the two differ and the
policy gradient is off-policy by rho = pi_old / pi_rollout. The modes (``CORRECTIONS``) re-weight the loss:

    tis     truncated IS (Yao et al., "Your efficient RL framework secretly brings you off-policy RL
            training", 2025; verl rollout_is truncate):        w = min(rho, C)
    mis     masked IS (verl rollout_is mask mode, slime MIS):  w = rho if C_low <= rho <= C else 0
    icepop  IcePop (Ring-1T, arXiv 2510.18855; TRL token_mask, SkyRL token mask): mis per token, [0.5, 5]

at token level (rho_t = exp(old_logp_t - rollout_logp_t)) or sequence level (rho_i = prod_t rho_t); or mask
whole responses (w_i = 1 or 0):

    geo_mask           SkyRL's geometric sequence mask: keep if low <= exp(mean_t log rho_t) <= high
    seq_logprob_error  NeMo-RL's sequence log-prob error mask: keep if mean_t exp|log rho_t| <= threshold
    opsm               DeepSeek-V3.2's off-policy sequence mask (arXiv 2512.02556 eq. 9; TRL's
                       off_policy_mask_threshold): keep if A_i >= 0 or
                       mean_t log(pi_rollout / pi_theta) <= delta, pi_theta the policy being trained

A masked unit stays in the loss's normalizer (as TRL's masks; SkyRL and NeMo-RL drop it from the count).
Every mode but opsm is an exact no-op when rho is 1: log rho = 0 exactly, exp(0) = 1.0 and the loss multiplies
by 1.0, so the loss and its gradient are bit-identical to no correction (tests/test_rollout_correction.py).
With ``train.old_logprobs=rollout`` the old log-probs *are* the rollout's, so rho == 1 by construction.

The mismatch metrics measure the gap itself between a training forward and the rollout's log-probs
(``mismatch_metrics``): the k3 estimate of KL(pi_rollout || pi_train), mean / max |delta log-prob| and
the share of tokens whose rho leaves [C_low, C].
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_gspo.runtime.metrics import Metric

Tensor = torch.Tensor

# |log rho| is bounded before exp, as in losses.py: a long sequence's summed log-ratio must not overflow.
LOG_RATIO_BOUND = 20.0


def inactive_reason(mode: str, recompute_old_logprobs: bool) -> Optional[str]:
    """Why ``rollout_correction.mode`` cannot correct anything in a job, or None. ``recompute_old_logprobs``:
    the job's resolved old-log-prob source (config.old_logprob_source); without that pass the
    rollout's log-probs serve as the old policy's, rho == 1 by construction and every weight is 1.0 (opsm compares
    the rollout with the policy being trained, which moves within a step: it acts either way)."""
    if mode in ("off", "opsm") or recompute_old_logprobs:
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


def _rho(lr: Tensor) -> Tensor:
    return lr.clamp(-LOG_RATIO_BOUND, LOG_RATIO_BOUND).exp()


def _band_metrics(w: Tensor, sel: Tensor, below: Tensor, above: Tensor, name: str) -> dict[str, Metric]:
    """The weights' statistics and the share of units (tokens or responses, ``sel``) cut below / above the band."""
    return {
        "rollout_correction/weight_mean": Metric.mean(w, sel),
        "rollout_correction/weight_min": Metric.min(w, sel),
        "rollout_correction/weight_max": Metric.max(w, sel),
        f"rollout_correction/{name}": Metric.mean((below | above).to(torch.float64), sel),
        f"rollout_correction/{name}_low": Metric.mean(below.to(torch.float64), sel),
        f"rollout_correction/{name}_high": Metric.mean(above.to(torch.float64), sel),
    }


def _tis(c: "CorrectionInputs") -> tuple[Tensor, dict[str, Metric]]:
    """Yao et al. 2025: w = min(rho, C)."""
    rho = _rho(log_rho(c.old_logp, c.rollout_logp, c.mask, c.level))
    cut = rho > c.high
    w = torch.where(cut, torch.full_like(rho, c.high), rho)
    return w, _band_metrics(w, c.sel, torch.zeros_like(cut), cut, "truncated_frac")


def _mis(c: "CorrectionInputs") -> tuple[Tensor, dict[str, Metric]]:
    """verl / slime masked IS, IcePop (token level): w = rho inside [C_low, C], 0 outside."""
    rho = _rho(log_rho(c.old_logp, c.rollout_logp, c.mask, c.level))
    below, above = rho < c.low, rho > c.high
    w = torch.where(below | above, torch.zeros_like(rho), rho)
    return w, _band_metrics(w, c.sel, below, above, "masked_frac")


def _sequence_mask(keep_below: Tensor, keep_above: Tensor, c: "CorrectionInputs") -> tuple[Tensor, dict[str, Metric]]:
    """A 0 / 1 weight per response [B] from the responses cut below / above the mode's band."""
    w = (~(keep_below | keep_above)).float()
    return w, _band_metrics(w, c.sel, keep_below, keep_above, "masked_frac")


def _geo_mask(c: "CorrectionInputs") -> tuple[Tensor, dict[str, Metric]]:
    """SkyRL: keep a response whose geometric-mean rho, exp(mean_t log rho_t), lies in [low, high]."""
    geo = _rho(log_rho(c.old_logp, c.rollout_logp, c.mask, "sequence") / c.lengths)
    return _sequence_mask(geo < c.low, geo > c.high, c)


def _seq_logprob_error(c: "CorrectionInputs") -> tuple[Tensor, dict[str, Metric]]:
    """NeMo-RL: keep a response whose mean_t exp|log rho_t| is at most the threshold (low / high: the masked
    responses whose mean log rho is < 0 / >= 0, i.e. the training policy below / above the rollout's)."""
    d = log_rho(c.old_logp, c.rollout_logp, c.mask, "token")
    error = torch.where(c.mask, _rho(d.abs()), 0.0).sum(dim=-1) / c.lengths
    out = error > c.high
    below = d.sum(dim=-1) < 0
    return _sequence_mask(out & below, out & ~below, c)


def _opsm(c: "CorrectionInputs") -> tuple[Tensor, dict[str, Metric]]:
    """DeepSeek-V3.2 (TRL's get_off_policy_mask): drop a response with A < 0 whose mean_t log(pi_rollout / pi_theta)
    exceeds delta; pi_theta the current policy (detached). Only the policy falling below the rollout's is cut (low)."""
    if c.logp is None or c.advantages is None:
        raise ValueError("rollout_correction mode 'opsm' needs the current log-probs and the advantages")
    kl = log_rho(c.rollout_logp, c.logp, c.mask, "sequence") / c.lengths  # mean_t (log pi_rollout - log pi_theta)
    adv = c.advantages if c.advantages.dim() == 1 else (
        torch.where(c.mask, c.advantages, 0.0).sum(dim=-1) / c.lengths)
    drop = (adv < 0) & (kl > c.high)
    return _sequence_mask(drop, torch.zeros_like(drop), c)


@dataclass(frozen=True)
class CorrectionInputs:
    """What a correction reads (shapes as correction_weights'); ``sel``: the units its metrics count (response
    tokens at level "token", responses with >= 1 token otherwise); ``lengths``: [B] tokens per response, >= 1."""

    old_logp: Tensor
    rollout_logp: Tensor
    mask: Tensor
    level: str
    low: float
    high: float
    logp: Optional[Tensor]
    advantages: Optional[Tensor]
    sel: Tensor
    lengths: Tensor


# mode -> (its unit: "level" (rollout_correction.level), "token" or "sequence"; the function). Weights multiply each
# loss's policy terms (losses.py: is_weights); a sequence mask's weight is 0 or 1 per response.
CORRECTIONS = {
    "tis": ("level", _tis),
    "mis": ("level", _mis),
    "icepop": ("token", _mis),  # IcePop is masked IS per token, with its own band
    "geo_mask": ("sequence", _geo_mask),
    "seq_logprob_error": ("sequence", _seq_logprob_error),
    "opsm": ("sequence", _opsm),
}


def correction_weights(old_logp: Tensor, rollout_logp: Tensor, mask: Tensor, mode: str, level: str,
                       low: float, high: float, *, logp: Optional[Tensor] = None,
                       advantages: Optional[Tensor] = None) -> tuple[Optional[Tensor], dict[str, Metric]]:
    """Weights of the loss terms and their metrics, by ``rollout_correction.mode`` (the module doc's table).

    old_logp, rollout_logp, mask: [B, T]; logp [B, T] (the current policy's, detached here) and advantages [B] or
    [B, T]: read by "opsm" only. low / high: the mode's band (RolloutCorrectionConfig.mode_bounds). Returns
    (weights, metrics): weights [B, T] (tis / mis at level "token", icepop) or [B] (level "sequence", the sequence
    masks), detached fp32 on the inputs' device, or None for mode "off". Metrics: rollout_correction/weight_mean |
    min | max and the share of tokens (or responses) truncated (tis: truncated_frac) or masked (masked_frac), each
    with its _low / _high parts."""
    if mode == "off":
        return None, {}
    if mode not in CORRECTIONS:
        raise ValueError(f"mode={mode!r} is not one of {['off', *CORRECTIONS]}")
    unit, fn = CORRECTIONS[mode]
    unit = level if unit == "level" else unit
    if unit not in ("token", "sequence"):
        raise ValueError(f"level={level!r} is not one of ['token', 'sequence']")
    m = mask if mask.dtype == torch.bool else mask != 0
    sel = m if unit == "token" else m.any(dim=-1)
    lengths = m.sum(dim=-1).clamp(min=1).float()
    lp = None if logp is None else logp.detach().float()
    adv = None if advantages is None else advantages.detach().float()
    return fn(CorrectionInputs(old_logp, rollout_logp, m, unit, low, high, lp, adv, sel, lengths))


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
