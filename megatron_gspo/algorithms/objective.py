"""The RL objective of one micro-batch: its loss and its metrics, composed from this package's parts.

The trainer runs, per micro-batch, ``forward_logprobs -> objective -> backward``; everything between the
forward's log-probs and the scalar it differentiates is here, in the order it is applied:

    loss mask            the response tokens, minus responses cut at the token limit under
                         train.overlong_filtering (overlong.loss_mask; DAPO §3.4)
    correction weights   pi_old / pi_rollout, truncated (TIS) or masked (MIS, IcePop), a sequence mask
                         (geometric, log-prob error, OPSM), or none (rollout_correction.correction_weights)
    policy loss          the loss named by loss.name, its settings resolved once (ObjectiveConfig.policy:
                         losses.resolve_loss), divided by the minibatch's unit count over every DP rank
                         (``normalizer``)
    first minibatch      trained on the weights that sampled it: the rollout mismatch
                         (rollout_correction.mismatch_metrics) and how far it is from ratio 1
                         (losses.on_policy_metrics; GSPO §4.1)

Token grid (as losses.py): every per-token tensor is [b, w-1] on the shifted grid of a micro-batch of b
rows and w token columns; ``micro.mask`` marks the response tokens among the targets ``tokens[:, 1:]``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Optional, Protocol

import torch

from megatron_gspo.algorithms.losses import Metrics, ResolvedLoss, on_policy_metrics, resolve_loss
from megatron_gspo.algorithms.overlong import loss_mask as overlong_loss_mask
from megatron_gspo.algorithms.rollout_correction import correction_weights, mismatch_metrics
from megatron_gspo.config import ON_POLICY_RATIO_TOLERANCE, LossConfig, RolloutCorrectionConfig

Tensor = torch.Tensor
log = logging.getLogger("megatron_gspo")


@dataclass(frozen=True)
class ObjectiveConfig:
    """The part of a job the objective reads: the loss, the rollout correction, overlong filtering. ``policy``: the
    loss section resolved and checked once, here (losses.resolve_loss), into the frozen settings the loss reads
    on every micro-batch."""

    loss: LossConfig
    correction: RolloutCorrectionConfig
    overlong_filtering: bool = False
    policy: ResolvedLoss = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "policy", resolve_loss(self.loss))

    @classmethod
    def of(cls, job) -> "ObjectiveConfig":
        """The view of a ``config.JobConfig``."""
        return cls(job.loss, job.rollout_correction, job.train.overlong_filtering)


class MicroBatch(Protocol):
    """What the objective reads of a micro-batch (rollout.prepare.TrainBatch has it): b rows, [b, w-1] grid."""

    mask: Tensor  # [b, w-1] bool: response tokens
    truncated: Optional[Tensor]  # [b] bool: cut at generation.max_new_tokens without a stop token
    advantages: Tensor  # [b] fp32
    sample_logprobs: Tensor  # [b, w-1] fp32, the rollout's
    old_logprobs: Tensor  # [b, w-1] fp32, the old policy's
    ref_logprobs: Optional[Tensor]  # [b, w-1] fp32, the KL reference's (loss.kl_coef > 0), else None


def loss_mask(cfg: ObjectiveConfig, micro: MicroBatch) -> Tensor:
    """[b, w-1] bool: the tokens the loss trains on (the response mask, minus truncated responses under
    train.overlong_filtering)."""
    return overlong_loss_mask(micro.mask, micro.truncated) if cfg.overlong_filtering else micro.mask


def loss_units(cfg: ObjectiveConfig, micro: MicroBatch) -> Tensor:
    """0-dim fp32: the micro-batch's share of the loss normalizer (response tokens for a "token-mean"
    loss, else responses with >= 1 token in the loss mask). The trainer sums it over the minibatch's
    micro-batches, all-reduces it over DP and clamps it to >= 1: the ``normalizer`` of ``objective``."""
    return cfg.policy.units(loss_mask(cfg, micro))


def objective(cfg: ObjectiveConfig, micro: MicroBatch, logp: Tensor, entropy: Optional[Tensor], normalizer: Tensor,
              *, on_sampling_weights: bool = False) -> tuple[Tensor, Metrics]:
    """The loss of one micro-batch and its metrics: loss mask -> rollout-correction weights -> the policy loss.

    logp [b, w-1] fp32, differentiable: the training forward's log-probs (at the sampling temperature);
    entropy [b, w-1] fp32 or None: its per-token entropy; normalizer: 0-dim, the loss units of the whole
    minibatch over every DP rank (``loss_units`` summed, all-reduced, clamped >= 1), so the losses of all
    micro-batches and ranks add up to the minibatch's loss. ``on_sampling_weights``: the forward ran on the
    weights that sampled the rollout (a step's first minibatch): the metrics also measure the rollout
    mismatch (rollout/*) and the distance from ratio 1 (onpolicy/*).

    Returns (loss, metrics): a 0-dim tensor to call ``backward()`` on, and detached local ``Metric``s (the
    loss's, then rollout_correction/*, then rollout/* and onpolicy/* when ``on_sampling_weights``)."""
    mask = loss_mask(cfg, micro)
    rc = cfg.correction
    # pi_old / pi_rollout weights: None when off, all 1.0 when the old log-probs are the rollout's
    weights, rc_metrics = correction_weights(micro.old_logprobs, micro.sample_logprobs, mask, rc.mode, rc.level,
                                             *rc.mode_bounds, logp=logp, advantages=micro.advantages)
    loss, metrics = cfg.policy(logp, micro.old_logprobs, micro.advantages, mask, ref_logp=micro.ref_logprobs,
                               entropy=entropy, global_batch_normalizer=normalizer, is_weights=weights)
    metrics.update(rc_metrics)
    if on_sampling_weights:  # generation ran on these weights: float noise, or a real mismatch
        metrics.update(mismatch_metrics(logp, micro.sample_logprobs, micro.mask, *rc.bounds))
        metrics.update(on_policy_metrics(logp, micro.old_logprobs, mask, metrics))
    return loss, metrics


def nonfinite_rows(micro: MicroBatch, logp: Tensor) -> Tensor:
    """[b] bool on logp's device: the rows of a micro-batch whose current or old log-probs are not finite
    on a response token (no host sync: ``bad_sample_ids`` reads them only when the update is skipped)."""
    return ~torch.where(micro.mask, logp.detach() - micro.old_logprobs, 0.0).isfinite().all(-1)


def bad_sample_ids(bad_rows: list[tuple[list, Tensor]]) -> list[str]:
    """The sample ids of the rows that ``nonfinite_rows`` flagged, per micro-batch (host syncs: the failure
    path only)."""
    return [ids[r] for ids, mask in bad_rows for r in torch.nonzero(mask).flatten().tolist()]


def warn_off_policy(deviation: float, step: int, recompute_old_logprobs: bool) -> bool:
    """Warn, and return True, if the first minibatch of ``step``, trained on the sampling weights, was not at
    ratio 1 (``deviation``: its loss/onpolicy/seq_ratio_dev_max). The trainer says it once per run."""
    if not deviation > ON_POLICY_RATIO_TOLERANCE:
        return False
    log.warning("step %d: the first minibatch's sequence ratios deviate from 1 by up to %.3g (> %g) although it "
                "trains on the weights that sampled it: the old log-probs carry another forward's rounding%s",
                step, deviation, ON_POLICY_RATIO_TOLERANCE,
                "; set train.old_logprobs=recompute" if not recompute_old_logprobs else "")
    return True
