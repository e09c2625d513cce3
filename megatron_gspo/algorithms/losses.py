"""Policy losses for RL post-training, as pure functions: GSPO, GSPO-token, GRPO (PPO-clip) and GSPO's
successors SAPO (soft gate), CISPO (clipped importance weights), GMPO (geometric mean) and LUSPO
(length-unbiased GSPO).

Token grid
    Every per-token input is a [B, T] tensor on the *response-aligned token grid*: row i is one
    sampled response (padded to T), ``mask[i, t]`` is 1 at response tokens and 0 at prompt and
    padding positions. Response lengths L_i = mask[i].sum() vary; rows with L_i = 0 are ignored
    (they count neither as sequences nor as tokens). Values at masked positions are never read:
    they may be garbage, inf or NaN without changing the loss, the gradient or the metrics.

    logp      [B, T]  log pi_theta(y_t | ...) of the current policy (requires grad)
    old_logp  [B, T]  log pi_theta_old, the policy that sampled the batch (no grad)
    advantages [B] per sequence, or [B, T] per token
    mask      [B, T]  bool or 0/1 float
    ref_logp  [B, T]  reference policy (optional; for the KL penalty)
    entropy   [B, T]  per-token policy entropy (optional; for the entropy bonus / metric)
    is_weights [B] or [B, T]  rollout-correction importance weights (optional, rollout_correction.py):
              multiply each policy-gradient term after clipping; all 1.0 leaves loss and gradient bit-identical

Return value
    Every loss returns ``(loss, metrics)``: a scalar tensor to call ``backward()`` on, and a dict
    of ``Metric`` (see metrics.py): detached local sums/counts/min/max that reduce exactly over
    data-parallel ranks and micro-batches with ``reduce_metrics`` / ``MetricAccumulator``.

Normalization, data parallelism and gradient accumulation
    Each loss is ``numerator / normalizer``: the numerator sums per-sequence terms (gspo,
    gspo_token, sapo, gmpo, luspo, grpo / cispo "seq-mean-*") or per-token terms (grpo / cispo
    "token-mean"), and the normalizer counts those units. By default it is the local count, which is right for one process and one
    micro-batch. Otherwise pass ``global_batch_normalizer`` = the count over the whole global batch
    (all DP ranks, all micro-batches of the optimizer step): all-reduce (SUM) the local
    ``batch_normalizer(cfg, mask)`` of every micro-batch. Then the per-rank, per-micro-batch losses
    *add up* to the global-batch loss, and *summing* their gradients reproduces the DP=1 gradient
    exactly. Megatron-core does not sum by default: its DDP scales gradients by 1/dp_size and its
    schedule divides each micro-batch loss by num_microbatches, so either multiply the loss by
    dp_size * num_microbatches, or run with ``calculate_per_token_loss=True`` and hand Megatron
    the numerator (``global_batch_normalizer=1``) with ``batch_normalizer`` as its token count.

Numerics
    Log-ratios are bounded by ``log_ratio_bound`` before ``exp`` (20 -> ratios within
    [2e-9, 4.9e8]): a 32k-token response whose log-probs drifted cannot overflow to inf. The bound
    uses ``torch.clamp``, which passes the gradient unchanged inside the bound (and zero outside,
    where the ratio is so far off-policy that the sample should not steer the update anyway).
    All arithmetic runs in at least float32, whatever the input dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Union

import torch

from megatron_gspo.config import AGG_MODE_LOSSES, LOSS_AGG_MODES, SAPO_TAUS, LossConfig
from megatron_gspo.config.checks import check_clip_range, check_loss_range
from megatron_gspo.config.checks import finite as _finite
from megatron_gspo.runtime.metrics import Metric

Tensor = torch.Tensor
Metrics = dict[str, Metric]
Normalizer = Optional[Union[float, Tensor]]

# ----------------------------------------------------------------------------------------------
# Registry (verl's register_policy_loss): a new loss is one decorated function in this file
# ----------------------------------------------------------------------------------------------

PolicyLoss = Callable[..., tuple[Tensor, Metrics]]

# name -> loss function, in registration order (the order of this file); config.LOSS_NAMES lists the
# same names (the config is a leaf and cannot import this file: tests/test_config.py checks they agree)
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str) -> Callable[[PolicyLoss], PolicyLoss]:
    """Decorator: register a policy loss under ``name`` (the value of ``loss.name``). The function is
    called as ``fn(logp, old_logp, advantages, mask, *, ref_logp, entropy, global_batch_normalizer,
    is_weights, **loss_kwargs(cfg))`` and returns ``(loss, metrics)`` (see the module doc)."""
    def register(fn: PolicyLoss) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice ({POLICY_LOSSES[name].__qualname__} "
                             f"and {fn.__qualname__})")
        POLICY_LOSSES[name] = fn
        return fn
    return register


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss registered under ``name``."""
    try:
        return POLICY_LOSSES[name]
    except KeyError:
        raise ValueError(f"unknown policy loss {name!r}; valid names: {list(POLICY_LOSSES)}") from None


# ----------------------------------------------------------------------------------------------
# Shared plumbing
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Batch:
    mask: Tensor  # [B, T] bool
    logp: Tensor  # [B, T] compute dtype, differentiable
    log_ratio: Tensor  # [B, T] logp - old_logp, exactly 0 outside the mask (differentiable)
    lengths: Tensor  # [B] response tokens per row, compute dtype
    active: Tensor  # [B] bool, rows with >= 1 response token
    adv: Tensor  # [B] or [B, T], compute dtype, detached


def _prepare(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
             ref_logp: Optional[Tensor], entropy: Optional[Tensor]) -> _Batch:
    if logp.dim() != 2:
        raise ValueError(f"logp must be [B, T], got shape {tuple(logp.shape)}")
    shape = tuple(logp.shape)
    for name, t in (("old_logp", old_logp), ("mask", mask), ("ref_logp", ref_logp), ("entropy", entropy)):
        if t is not None and tuple(t.shape) != shape:
            raise ValueError(f"{name} must have logp's shape {shape}, got {tuple(t.shape)}")
    if tuple(advantages.shape) not in (shape[:1], shape):
        raise ValueError(f"advantages must be [B]={shape[:1]} or [B, T]={shape}, got {tuple(advantages.shape)}")
    dtype = torch.promote_types(logp.dtype, torch.float32)
    m = mask if mask.dtype == torch.bool else mask != 0
    lp = logp.to(dtype)
    # where(), not mask * (...): 0 * inf = NaN, and masked positions may hold anything.
    log_ratio = torch.where(m, lp - old_logp.detach().to(dtype), 0.0)
    lengths = m.sum(dim=-1).to(dtype)
    return _Batch(m, lp, log_ratio, lengths, lengths > 0, advantages.detach().to(dtype))


def _masked(x: Tensor, b: _Batch) -> Tensor:
    return torch.where(b.mask, x, 0.0)


def _token_mean_per_seq(x: Tensor, b: _Batch) -> Tensor:
    """[B, T] -> [B]: mean over each row's response tokens (0 for empty rows)."""
    return _masked(x, b).sum(dim=-1) / b.lengths.clamp(min=1)


def _aggregate(x: Tensor, b: _Batch, mode: str, norm_constant: Optional[float]) -> tuple[Tensor, Tensor]:
    """[B, T] per-token loss -> (per-unit terms, local unit count); loss = terms.sum() / count.

    The terms are per token ([B, T], 0 off-mask) for "token-mean" and per sequence ([B], 0 for
    empty rows) otherwise. Returning them unsummed lets the metrics sum them in float64, so the
    reduced value does not depend on how the batch was split over ranks and micro-batches.
    """
    if mode == "token-mean":
        return _masked(x, b), b.lengths.sum()
    if mode == "seq-mean-token-mean":
        return _token_mean_per_seq(x, b), b.active.sum().to(x.dtype)
    if mode == "seq-mean-token-sum-norm":
        return _masked(x, b).sum(dim=-1) / norm_constant, b.active.sum().to(x.dtype)
    if mode == "seq-mean-token-sum":  # internal (LUSPO's KL / entropy terms): each sequence weighs its length
        return _masked(x, b).sum(dim=-1), b.active.sum().to(x.dtype)
    raise ValueError(f"loss_agg_mode={mode!r} is not one of {list(LOSS_AGG_MODES)}")


def _k3(ref_logp: Tensor, b: _Batch, bound: float) -> Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref): exp(d) - d - 1 >= 0, d = ref_logp - logp."""
    d = torch.where(b.mask, ref_logp.detach().to(b.logp.dtype) - b.logp, 0.0).clamp(-bound, bound)
    return torch.expm1(d) - d


def _seq_log_ratio(b: _Batch) -> Tensor:
    """[B]: (1/|y_i|) sum_t log(pi/pi_old), the log of GSPO's s_i before the bound."""
    return b.log_ratio.sum(dim=-1) / b.lengths.clamp(min=1)


def _validate_common(kl_coef: float, entropy_coef: float, ref_logp: Optional[Tensor],
                     entropy: Optional[Tensor], global_batch_normalizer: Normalizer) -> None:
    if not (_finite(kl_coef) and kl_coef >= 0):
        raise ValueError(f"kl_coef must be >= 0, got {kl_coef}")
    if not (_finite(entropy_coef) and entropy_coef >= 0):
        raise ValueError(f"entropy_coef must be >= 0, got {entropy_coef}")
    if kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={kl_coef} > 0 needs ref_logp (the reference policy's log-probs)")
    if entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={entropy_coef} > 0 needs the per-token entropy tensor")
    if isinstance(global_batch_normalizer, (int, float)) and not global_batch_normalizer > 0:
        raise ValueError(f"global_batch_normalizer must be > 0, got {global_batch_normalizer}")


def _check_weights(w: Tensor, b: _Batch) -> Tensor:
    """Rollout-correction weights [B] or [B, T] as a detached tensor of the loss's dtype."""
    if tuple(w.shape) not in (tuple(b.mask.shape[:1]), tuple(b.mask.shape)):
        raise ValueError(f"is_weights must be [B]={tuple(b.mask.shape[:1])} or [B, T]={tuple(b.mask.shape)}, "
                         f"got {tuple(w.shape)}")
    # where(): masked positions may hold anything (a mis weight of 0 times an inf must not be NaN)
    return w.detach().to(b.logp.dtype) if w.dim() == 1 else torch.where(b.mask, w.detach().to(b.logp.dtype), 0.0)


def _check_agg_mode(mode: str, norm_constant: Optional[float]) -> None:
    if mode not in LOSS_AGG_MODES:
        raise ValueError(f"loss_agg_mode={mode!r} is not one of {list(LOSS_AGG_MODES)}")
    if mode == "seq-mean-token-sum-norm" and not (
        norm_constant is not None and _finite(norm_constant) and norm_constant > 0
    ):
        raise ValueError(
            "loss_agg_mode='seq-mean-token-sum-norm' needs loss_agg_norm_constant > 0 (the maximum "
            f"response length), got {norm_constant}"
        )


def _sum_over_count(terms: Tensor, count: Tensor) -> Metric:
    # The *local* count: reduced over ranks, sum / count is the global-batch value.
    return Metric.from_sum_count(terms.detach().to(torch.float64).sum(), count)


def _finish(
    pg_terms: Tensor, count: Tensor, b: _Batch, *, mode: str, norm_constant: Optional[float],
    kl_coef: float, ref_logp: Optional[Tensor], entropy_coef: float, entropy: Optional[Tensor],
    bound: float, global_batch_normalizer: Normalizer, metrics: Metrics,
) -> tuple[Tensor, Metrics]:
    """Add the KL and entropy terms (aggregated like the policy term) and normalize.

    pg_terms: per-unit policy loss terms as returned by _aggregate (sum = numerator)."""
    terms = pg_terms
    metrics["pg_loss"] = _sum_over_count(pg_terms, count)
    if ref_logp is not None:
        kl_terms, _ = _aggregate(_k3(ref_logp, b, bound), b, mode, norm_constant)
        metrics["kl_ref"] = _sum_over_count(kl_terms, count)
        if kl_coef > 0:
            terms = terms + kl_coef * kl_terms
    if entropy is not None:
        ent = entropy.to(b.logp.dtype)
        metrics["entropy"] = Metric.mean(ent, b.mask)
        if entropy_coef > 0:
            ent_terms, _ = _aggregate(ent, b, mode, norm_constant)
            terms = terms - entropy_coef * ent_terms  # a bonus: higher entropy lowers the loss
    metrics["loss"] = _sum_over_count(terms, count)
    normalizer = count.clamp(min=1) if global_batch_normalizer is None else global_batch_normalizer
    return terms.sum() / normalizer, metrics


def _batch_metrics(b: _Batch, seq_ratio: Tensor) -> Metrics:
    """Metrics every loss reports: lengths, advantages, KL(old||new) estimates, sequence ratios."""
    act, m = b.active, b.mask
    lr = b.log_ratio.detach().to(torch.float64)
    adv_sel = act if b.adv.dim() == 1 else m
    return {
        "num_sequences": Metric.sum(act.to(torch.float64)),
        "num_tokens": Metric.sum(b.lengths),
        "response_length/mean": Metric.mean(b.lengths, act),
        "response_length/min": Metric.min(b.lengths, act),
        "response_length/max": Metric.max(b.lengths, act),
        "advantages/mean": Metric.mean(b.adv, adv_sel),
        "advantages/std": Metric.std(b.adv, adv_sel),
        "advantages/min": Metric.min(b.adv, adv_sel),
        "advantages/max": Metric.max(b.adv, adv_sel),
        # KL(pi_old || pi_theta) over the sampled tokens: k1 = log(old/new), k3 = r - 1 - log r.
        "approx_kl": Metric.mean(-lr, m),
        "approx_kl_k3": Metric.mean(torch.expm1(lr) - lr, m),
        "seq_ratio/mean": Metric.mean(seq_ratio, act),
        "seq_ratio/min": Metric.min(seq_ratio, act),
        "seq_ratio/max": Metric.max(seq_ratio, act),
        "seq_ratio/hist": Metric.cat(seq_ratio, act),
    }


def on_policy_metrics(logp: Tensor, old_logp: Tensor, mask: Tensor, loss_metrics: Metrics) -> Metrics:
    """How far a minibatch trained on the very weights that sampled it is from ratio 1 (GSPO §4.1:
    on-policy, s_i = 1 and nothing is clipped; any deviation is the old log-probs' rounding).

    logp, old_logp, mask: [B, T] (the current and old log-probs of one micro-batch, its loss mask);
    loss_metrics: what the loss returned for that micro-batch. Returns detached Metrics:
      onpolicy/seq_ratio_dev_max    max over responses of |s_i - 1|, s_i = exp(mean_t log ratio) (GSPO eq. 7)
      onpolicy/log_ratio_abs_max    max over response tokens of |log pi - log pi_old|
      onpolicy/clip_frac_low, _high the loss's own clip fractions on it"""
    b = _prepare(logp.detach(), old_logp, torch.zeros(logp.shape[0], device=logp.device), mask, None, None)
    seq_dev = torch.expm1(_seq_log_ratio(b).to(torch.float64)).abs()
    return {
        "onpolicy/seq_ratio_dev_max": Metric.max(seq_dev, b.active),
        "onpolicy/log_ratio_abs_max": Metric.max(b.log_ratio.to(torch.float64).abs(), b.mask),
        "onpolicy/clip_frac_low": loss_metrics["clip_frac_low"],
        "onpolicy/clip_frac_high": loss_metrics["clip_frac_high"],
    }


# ----------------------------------------------------------------------------------------------
# GSPO
# ----------------------------------------------------------------------------------------------


def _gspo_common(b: _Batch, bound: float) -> tuple[Tensor, Tensor]:
    """(s_i [B] differentiable, in-bound [B] bool) for the sequence-level importance ratio."""
    mean_lr = _seq_log_ratio(b)
    # clamp passes the gradient for bound-inclusive values; in_bound mirrors that for gspo_token.
    in_bound = (mean_lr >= -bound) & (mean_lr <= bound)
    return mean_lr.clamp(-bound, bound).exp(), in_bound


def _clip_masks(adv: Tensor, ratio: Tensor, low: float, high: float) -> tuple[Tensor, Tensor]:
    """Where the *clipped* branch of min(r A, clip(r) A) is the active one.

    A > 0 and r > 1 + high: the objective is flat at (1 + high) A  -> clipped high.
    A < 0 and r < 1 - low:  the objective is flat at (1 - low) A   -> clipped low.
    Everywhere else min(...) picks r A, including ratios outside the range whose update would move
    them back inside (e.g. A > 0, r < 1 - low): those keep their gradient, as in PPO.
    """
    return (adv < 0) & (ratio < 1 - low), (adv > 0) & (ratio > 1 + high)


def _clip_objective(ratio: Tensor, adv: Tensor, clip_low: Tensor, clip_high: Tensor,
                    low: float, high: float) -> Tensor:
    """Value of min(r A, clip(r, 1-low, 1+high) A) with zero gradient where the clip is active."""
    clipped_value = ratio.detach().clamp(1 - low, 1 + high) * adv
    return torch.where(clip_low | clip_high, clipped_value, ratio * adv)


def _seq_clip_metrics(clip_low: Tensor, clip_high: Tensor, s: Tensor, b: _Batch,
                      low: float, high: float) -> Metrics:
    """Clip fractions over sequences (a [B, T] mask counts its token fraction per sequence)."""
    def per_seq(x: Tensor) -> Tensor:
        return x.to(b.logp.dtype) if x.dim() == 1 else _token_mean_per_seq(x.to(b.logp.dtype), b)

    return {
        "clip_frac_low": Metric.mean(per_seq(clip_low), b.active),
        "clip_frac_high": Metric.mean(per_seq(clip_high), b.active),
        # Regardless of the advantage's sign: how far off-policy the batch is.
        "ratio_out_low_frac": Metric.mean((s < 1 - low).to(torch.float64), b.active),
        "ratio_out_high_frac": Metric.mean((s > 1 + high).to(torch.float64), b.active),
    }


def _gspo_sequence_objective(b: _Batch, low: float, high: float, bound: float,
                             is_weights: Optional[Tensor]) -> tuple[Tensor, Metrics]:
    """GSPO's per-sequence objective min(s_i A_i, clip(s_i) A_i) [B] (differentiable), rollout-corrected,
    with the batch and sequence-clip metrics (shared by gspo_loss and luspo_loss)."""
    adv = b.adv if b.adv.dim() == 1 else _token_mean_per_seq(b.adv, b)
    s, _ = _gspo_common(b, bound)
    clip_low, clip_high = _clip_masks(adv, s.detach(), low, high)
    obj = _clip_objective(s, adv, clip_low, clip_high, low, high)
    if is_weights is not None:
        # the sequence is GSPO's unit: a token-level weight enters as its mean over the response
        w = _check_weights(is_weights, b)
        obj = obj * (w if w.dim() == 1 else _token_mean_per_seq(w, b))
    metrics = _batch_metrics(b, s.detach())
    metrics.update(_seq_clip_metrics(clip_low, clip_high, s.detach(), b, low, high))
    return obj, metrics


@register_policy_loss("gspo")
def gspo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4, log_ratio_bound: float = 20.0,
    kl_coef: float = 0.0, entropy_coef: float = 0.0, ref_logp: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None, global_batch_normalizer: Normalizer = None,
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, Metrics]:
    """GSPO: one importance ratio and one clip per sequence.

    Implements J_GSPO of arXiv 2507.18071 §4.1: mean_i min(s_i A_i, clip(s_i, 1-eps_l, 1+eps_h) A_i), s_i = (pi_theta(y_i)/pi_old(y_i))^(1/|y_i|).

    logp, old_logp, mask (, ref_logp, entropy): [B, T]; advantages: [B], or [B, T] reduced to [B]
    by its masked mean over each response (a per-sequence advantage broadcast over tokens comes
    back unchanged; use gspo_token for advantages that genuinely vary per token).
    s_i is computed in log space, exp(clamp(mean_t(logp - old_logp), +-log_ratio_bound)).
    loss = -(1/N) sum_i obj_i over the N sequences with >= 1 response token (N = global
    normalizer if given); KL / entropy terms are averaged per sequence then over sequences.
    Returns (scalar loss, metrics); clip fractions count sequences.
    """
    check_clip_range(clip_ratio_low, clip_ratio_high, log_ratio_bound, where="")
    _validate_common(kl_coef, entropy_coef, ref_logp, entropy, global_batch_normalizer)
    b = _prepare(logp, old_logp, advantages, mask, ref_logp, entropy)
    obj, metrics = _gspo_sequence_objective(b, clip_ratio_low, clip_ratio_high, log_ratio_bound, is_weights)
    pg_terms = torch.where(b.active, -obj, 0.0)  # [B]
    count = b.active.sum().to(obj.dtype)
    return _finish(pg_terms, count, b, mode="seq-mean-token-mean", norm_constant=None, kl_coef=kl_coef,
                   ref_logp=ref_logp, entropy_coef=entropy_coef, entropy=entropy, bound=log_ratio_bound,
                   global_batch_normalizer=global_batch_normalizer, metrics=metrics)


@register_policy_loss("gspo_token")
def gspo_token_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    clip_ratio_low: float = 3e-4, clip_ratio_high: float = 4e-4, log_ratio_bound: float = 20.0,
    kl_coef: float = 0.0, entropy_coef: float = 0.0, ref_logp: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None, global_batch_normalizer: Normalizer = None,
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, Metrics]:
    """GSPO-token: GSPO's sequence ratio with a per-token advantage.

    Implements J_GSPO-token of arXiv 2507.18071 §4.3: mean_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it) A_it), s_it = sg[s_i] pi_theta(y_it)/sg[pi_theta(y_it)].

    logp, old_logp, mask (, ref_logp, entropy): [B, T]; advantages: [B] (broadcast) or [B, T].
    s_it has the value of s_i and the gradient s_i * grad log pi(y_it), so clipping happens on the
    sequence ratio: a token's clipped branch is active iff sign(A_it) and s_i say so. With
    per-sequence advantages the loss value and the gradient w.r.t. logp equal gspo_loss's (up to
    rounding), clipped sequences (zero gradient) and out-of-bound log-ratios included.
    loss = -(1/N) sum_i (masked token mean of obj_it); N as in gspo_loss.
    """
    check_clip_range(clip_ratio_low, clip_ratio_high, log_ratio_bound, where="")
    _validate_common(kl_coef, entropy_coef, ref_logp, entropy, global_batch_normalizer)
    b = _prepare(logp, old_logp, advantages, mask, ref_logp, entropy)
    adv = b.adv[:, None] if b.adv.dim() == 1 else b.adv  # [B, 1] broadcasts over tokens

    s, in_bound = _gspo_common(b, log_ratio_bound)
    s_val = s.detach()
    # pi/sg[pi] = exp(logp - sg[logp]): value exactly 1, gradient grad logp. Outside the bound the
    # sequence gets no gradient, matching the clamp inside gspo_loss's s_i.
    tok = torch.where(b.mask & in_bound[:, None], b.logp - b.logp.detach(), 0.0)
    s_tok = s_val[:, None] * tok.exp()  # [B, T]
    s_grid = s_val[:, None].expand_as(s_tok)
    clip_low, clip_high = _clip_masks(adv, s_grid, clip_ratio_low, clip_ratio_high)
    obj = _clip_objective(s_tok, adv, clip_low, clip_high, clip_ratio_low, clip_ratio_high)
    if is_weights is not None:
        w = _check_weights(is_weights, b)
        obj = obj * (w[:, None] if w.dim() == 1 else w)
    pg_terms = -_token_mean_per_seq(obj, b)  # [B], 0 for empty rows
    count = b.active.sum().to(obj.dtype)

    metrics = _batch_metrics(b, s_val)
    metrics.update(_seq_clip_metrics(clip_low, clip_high, s_val, b, clip_ratio_low, clip_ratio_high))
    return _finish(pg_terms, count, b, mode="seq-mean-token-mean", norm_constant=None, kl_coef=kl_coef,
                   ref_logp=ref_logp, entropy_coef=entropy_coef, entropy=entropy, bound=log_ratio_bound,
                   global_batch_normalizer=global_batch_normalizer, metrics=metrics)


# ----------------------------------------------------------------------------------------------
# GRPO
# ----------------------------------------------------------------------------------------------


# long: one loss, its paper's formula: the docstring (shapes, every option) is half of it
@register_policy_loss("grpo")
def grpo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    clip_ratio_low: float = 0.2, clip_ratio_high: float = 0.2, log_ratio_bound: float = 20.0,
    loss_agg_mode: str = "token-mean", loss_agg_norm_constant: Optional[float] = None,
    dual_clip_c: Optional[float] = None, kl_coef: float = 0.0, entropy_coef: float = 0.0,
    ref_logp: Optional[Tensor] = None, entropy: Optional[Tensor] = None,
    global_batch_normalizer: Normalizer = None, is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, Metrics]:
    """GRPO: PPO-clip on per-token importance ratios.

    Implements J_GRPO of arXiv 2507.18071 §2: (1/G) sum_i (1/|y_i|) sum_t min(w_it A_it, clip(w_it, 1-eps_l, 1+eps_h) A_it), w_it = pi_theta(y_it)/pi_old(y_it).

    logp, old_logp, mask (, ref_logp, entropy): [B, T]; advantages: [B] (broadcast) or [B, T].
    w_it = exp(clamp(logp - old_logp, +-log_ratio_bound)). dual_clip_c (> 1): for A < 0 the
    per-token objective is max(obj, c A), i.e. no gradient once w > c. The per-token loss (and the
    k3 KL / entropy terms) are aggregated by loss_agg_mode:
      token-mean               sum_it l_it / (number of response tokens)
      seq-mean-token-mean      (1/N) sum_i (1/|y_i|) sum_t l_it        (the formula above)
      seq-mean-token-sum-norm  (1/N) sum_i (1/C) sum_t l_it, C = loss_agg_norm_constant (Dr. GRPO)
    The denominator (tokens or sequences) is replaced by global_batch_normalizer when given.
    Returns (scalar loss, metrics); clip fractions count tokens.
    """
    check_clip_range(clip_ratio_low, clip_ratio_high, log_ratio_bound, where="")
    _validate_common(kl_coef, entropy_coef, ref_logp, entropy, global_batch_normalizer)
    _check_agg_mode(loss_agg_mode, loss_agg_norm_constant)
    if dual_clip_c is not None and not (_finite(dual_clip_c) and dual_clip_c > 1):
        raise ValueError(f"dual_clip_c must be > 1, got {dual_clip_c}")
    b = _prepare(logp, old_logp, advantages, mask, ref_logp, entropy)
    adv = b.adv[:, None] if b.adv.dim() == 1 else b.adv

    ratio = b.log_ratio.clamp(-log_ratio_bound, log_ratio_bound).exp()  # [B, T]; 1 off-mask
    r_val = ratio.detach()
    clip_low, clip_high = _clip_masks(adv, r_val, clip_ratio_low, clip_ratio_high)
    obj = _clip_objective(ratio, adv, clip_low, clip_high, clip_ratio_low, clip_ratio_high)
    if dual_clip_c is not None:
        # A < 0 and w > c: PPO's unclipped branch would push an already far-too-likely token down
        # with weight w (unbounded); dual clip caps the objective at c A (constant, no gradient).
        dual = (adv < 0) & (r_val > dual_clip_c)
        obj = torch.where(dual, dual_clip_c * adv.expand_as(obj), obj)
    if is_weights is not None:  # after both clips, as verl applies rollout IS weights
        w = _check_weights(is_weights, b)
        obj = obj * (w[:, None] if w.dim() == 1 else w)
    pg_terms, count = _aggregate(-obj, b, loss_agg_mode, loss_agg_norm_constant)

    m = b.mask
    seq_ratio = _seq_log_ratio(b).detach().clamp(-log_ratio_bound, log_ratio_bound).exp()
    metrics = _batch_metrics(b, seq_ratio)  # sequence ratio too, for comparison with GSPO
    metrics.update({
        "clip_frac_low": Metric.mean(clip_low.expand_as(m).to(torch.float64), m),
        "clip_frac_high": Metric.mean(clip_high.expand_as(m).to(torch.float64), m),
        "ratio_out_low_frac": Metric.mean((r_val < 1 - clip_ratio_low).to(torch.float64), m),
        "ratio_out_high_frac": Metric.mean((r_val > 1 + clip_ratio_high).to(torch.float64), m),
        "token_ratio/mean": Metric.mean(r_val, m),
        "token_ratio/min": Metric.min(r_val, m),
        "token_ratio/max": Metric.max(r_val, m),
    })
    if dual_clip_c is not None:
        metrics["dual_clip_frac"] = Metric.mean(dual.expand_as(m).to(torch.float64), m)
    return _finish(pg_terms, count, b, mode=loss_agg_mode, norm_constant=loss_agg_norm_constant,
                   kl_coef=kl_coef, ref_logp=ref_logp, entropy_coef=entropy_coef, entropy=entropy,
                   bound=log_ratio_bound, global_batch_normalizer=global_batch_normalizer, metrics=metrics)


# ----------------------------------------------------------------------------------------------
# GSPO's successors: SAPO, CISPO, GMPO, LUSPO
# ----------------------------------------------------------------------------------------------

# A SAPO token counts as gated (its clip_frac) once the gate has cut its gradient weight below this
# share of the unclipped surrogate's (4 sigma (1 - sigma) < 1/2: |r - 1| > 1.76 / tau).
SAPO_GATED_WEIGHT = 0.5


def _token_adv(b: _Batch) -> Tensor:
    """Advantages on the token grid: [B, 1] (broadcasts) or [B, T] with 0 off-mask (masked positions may
    hold NaN; a NaN times a zero gradient would still be NaN in the backward pass)."""
    return b.adv[:, None] if b.adv.dim() == 1 else torch.where(b.mask, b.adv, 0.0)


def _token_ratio_metrics(r_val: Tensor, b: _Batch) -> Metrics:
    return {"token_ratio/mean": Metric.mean(r_val, b.mask), "token_ratio/min": Metric.min(r_val, b.mask),
            "token_ratio/max": Metric.max(r_val, b.mask)}


def _token_weights(is_weights: Optional[Tensor], b: _Batch) -> Optional[Tensor]:
    """Rollout-correction weights on the token grid ([B, 1] or [B, T]), or None."""
    if is_weights is None:
        return None
    w = _check_weights(is_weights, b)
    return w[:, None] if w.dim() == 1 else w


def _seq_ratio_value(b: _Batch, bound: float) -> Tensor:
    """[B] GSPO's sequence ratio exp(mean_t log-ratio), detached: every loss reports it (seq_ratio/*)."""
    return _seq_log_ratio(b).detach().clamp(-bound, bound).exp()


def _check_positive(name: str, value: float) -> None:
    if not (_finite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


@register_policy_loss("sapo")
def sapo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    tau_pos: float = SAPO_TAUS[0], tau_neg: float = SAPO_TAUS[1], log_ratio_bound: float = 20.0,
    kl_coef: float = 0.0, entropy_coef: float = 0.0, ref_logp: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None, global_batch_normalizer: Normalizer = None,
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, Metrics]:
    """SAPO: a smooth, temperature-controlled gate on each token's ratio instead of a hard clip.

    Implements J_SAPO of arXiv 2511.20347: (1/G) sum_i (1/|y_i|) sum_t f_it(r_it) A_it, f_it(x) = (4/tau_it) sigmoid(tau_it (x - 1)), tau_it = tau_pos if A_it > 0 else tau_neg.

    logp, old_logp, mask (, ref_logp, entropy): [B, T]; advantages: [B] (broadcast) or [B, T].
    r_it = exp(clamp(logp - old_logp, +-log_ratio_bound)). The gradient of a token's term is
    w_it r_it A_it grad log pi with the gate weight w_it = 4 sigma (1 - sigma), sigma = sigmoid(tau_it
    (r_it - 1)): exactly the unclipped surrogate's at r = 1 (w = 1, so on-policy SAPO is the policy
    gradient), decaying smoothly as the ratio leaves 1 in either direction; no token's gradient is
    cut to zero at a threshold. Aggregation as the formula: token mean per sequence, then mean over
    the N sequences with >= 1 response token (N = global normalizer if given); KL / entropy alike.
    Metrics: clip_frac_low / _high count the tokens whose gate weight fell below SAPO_GATED_WEIGHT
    with r < 1 / r > 1, whatever the advantage's sign (below r = 1 the gate's argument is at least
    -tau, so at the paper's temperatures the weight stays above 0.78 there and clip_frac_low is 0:
    the gate mostly damps ratios that ran high); gate/weight_mean, gate/weight_min, and the token
    ratio statistics.
    """
    _check_positive("tau_pos", tau_pos)
    _check_positive("tau_neg", tau_neg)
    _check_positive("log_ratio_bound", log_ratio_bound)
    _validate_common(kl_coef, entropy_coef, ref_logp, entropy, global_batch_normalizer)
    b = _prepare(logp, old_logp, advantages, mask, ref_logp, entropy)
    adv = _token_adv(b)

    ratio = b.log_ratio.clamp(-log_ratio_bound, log_ratio_bound).exp()  # [B, T]; 1 off-mask
    tau = torch.where(adv > 0, adv.new_tensor(tau_pos), adv.new_tensor(tau_neg))
    gate = torch.sigmoid(tau * (ratio - 1))
    obj = (4 / tau) * gate * adv  # f(r) A
    w = _token_weights(is_weights, b)
    if w is not None:
        obj = obj * w
    pg_terms, count = _aggregate(-obj, b, "seq-mean-token-mean", None)

    m, r_val = b.mask, ratio.detach()
    weight = (4 * gate * (1 - gate)).detach().expand_as(m)  # the gate's share of the unclipped gradient
    gated = weight < SAPO_GATED_WEIGHT
    metrics = _batch_metrics(b, _seq_ratio_value(b, log_ratio_bound))
    metrics.update({
        "clip_frac_low": Metric.mean((gated & (r_val < 1)).to(torch.float64), m),
        "clip_frac_high": Metric.mean((gated & (r_val > 1)).to(torch.float64), m),
        "ratio_out_low_frac": Metric.mean((gated & (r_val < 1)).to(torch.float64), m),
        "ratio_out_high_frac": Metric.mean((gated & (r_val > 1)).to(torch.float64), m),
        "gate/weight_mean": Metric.mean(weight, m),
        "gate/weight_min": Metric.min(weight, m),
        **_token_ratio_metrics(r_val, b),
    })
    return _finish(pg_terms, count, b, mode="seq-mean-token-mean", norm_constant=None, kl_coef=kl_coef,
                   ref_logp=ref_logp, entropy_coef=entropy_coef, entropy=entropy, bound=log_ratio_bound,
                   global_batch_normalizer=global_batch_normalizer, metrics=metrics)


@register_policy_loss("cispo")
def cispo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    clip_ratio_low: float = 1.0, clip_ratio_high: float = 4.0, log_ratio_bound: float = 20.0,
    loss_agg_mode: str = "token-mean", loss_agg_norm_constant: Optional[float] = None,
    kl_coef: float = 0.0, entropy_coef: float = 0.0, ref_logp: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None, global_batch_normalizer: Normalizer = None,
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, Metrics]:
    """CISPO: clip the importance-sampling weight, not the update; every token keeps a gradient.

    Implements J_CISPO of arXiv 2506.13585 eq. (4): (1/sum_i |o_i|) sum_i sum_t sg(r^_it) A_it log pi_theta(o_it), r^_it = clip(r_it, 1 - eps_low, 1 + eps_high).

    logp, old_logp, mask (, ref_logp, entropy): [B, T]; advantages: [B] (broadcast) or [B, T].
    r_it = exp(clamp(logp - old_logp, +-log_ratio_bound)) enters only as the detached weight r^_it,
    so the gradient of a token's term is r^_it A_it grad log pi whatever its ratio (the bound caps the
    weight, never the gradient). clip_ratio_low = 1 puts the lower end at 0: no lower bound, as in
    MiniMax-M1. The loss value is the paper's surrogate, -r^ A log pi (it depends on log pi itself,
    not only on the ratio: on-policy it is -A log pi, not -A). Aggregated by loss_agg_mode as in
    grpo_loss ("token-mean", the paper's, by default); KL / entropy alike.
    Metrics: clip_frac_low / _high count the tokens whose weight was truncated (r < 1 - eps_low /
    r > 1 + eps_high, whatever the advantage's sign), and the token ratio statistics.
    """
    check_loss_range("cispo", clip_ratio_low, clip_ratio_high, log_ratio_bound, where="")
    _validate_common(kl_coef, entropy_coef, ref_logp, entropy, global_batch_normalizer)
    _check_agg_mode(loss_agg_mode, loss_agg_norm_constant)
    b = _prepare(logp, old_logp, advantages, mask, ref_logp, entropy)
    adv = _token_adv(b)

    r_val = b.log_ratio.detach().clamp(-log_ratio_bound, log_ratio_bound).exp()  # [B, T]; 1 off-mask
    weight = r_val.clamp(1 - clip_ratio_low, 1 + clip_ratio_high)  # sg(r^)
    lp = torch.where(b.mask, b.logp, 0.0)  # masked positions may hold anything
    obj = weight * adv * lp
    w = _token_weights(is_weights, b)
    if w is not None:
        obj = obj * w
    pg_terms, count = _aggregate(-obj, b, loss_agg_mode, loss_agg_norm_constant)

    m = b.mask
    low, high = r_val < 1 - clip_ratio_low, r_val > 1 + clip_ratio_high
    metrics = _batch_metrics(b, _seq_ratio_value(b, log_ratio_bound))
    metrics.update({
        "clip_frac_low": Metric.mean(low.to(torch.float64), m),
        "clip_frac_high": Metric.mean(high.to(torch.float64), m),
        "ratio_out_low_frac": Metric.mean(low.to(torch.float64), m),
        "ratio_out_high_frac": Metric.mean(high.to(torch.float64), m),
        **_token_ratio_metrics(r_val, b),
    })
    return _finish(pg_terms, count, b, mode=loss_agg_mode, norm_constant=loss_agg_norm_constant,
                   kl_coef=kl_coef, ref_logp=ref_logp, entropy_coef=entropy_coef, entropy=entropy,
                   bound=log_ratio_bound, global_batch_normalizer=global_batch_normalizer, metrics=metrics)


# long: one loss, its paper's formula: the docstring (shapes, every option) is half of it
@register_policy_loss("gmpo")
def gmpo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    clip_ratio_low: float = 0.4, clip_ratio_high: float = 0.4, log_ratio_bound: float = 20.0,
    kl_coef: float = 0.0, entropy_coef: float = 0.0, ref_logp: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None, global_batch_normalizer: Normalizer = None,
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, Metrics]:
    """GMPO: the geometric mean of token ratios, each clipped in log space before the mean.

    Implements J_GMPO of arXiv 2507.20673: (1/G) sum_i (prod_t min[r_it^sgn(A_i), clip(r_it^sgn(A_i), e^-eps_l, e^eps_h)]^sgn(A_i))^(1/|o_i|) A_i.

    logp, old_logp, mask (, ref_logp, entropy): [B, T]; advantages: [B], or [B, T] reduced to [B]
    by its masked mean over each response (GMPO's advantage is per sequence). In log space, with
    l_it = clamp(logp - old_logp, +-log_ratio_bound): c_it = min(l_it, clamp(l_it, -eps_l, eps_h))
    for A_i > 0, max(...) for A_i < 0 (PPO's one-sided trust region per token: a clipped token has
    zero gradient, the others keep theirs), and the objective is A_i exp(mean_t c_it). With the
    paper's symmetric range (0.4 / 0.4) this is the formula above exactly; an asymmetric range puts
    eps_l on the low side for A < 0 and eps_h on the high side for A > 0, as PPO does.
    Rollout-correction weights per token enter as their geometric mean over the response (the
    correction of GMPO's ratio: GM(r rho) = GM(r) GM(rho)); a zero weight zeroes the sequence.
    loss = -(1/N) sum_i obj_i over the N sequences with >= 1 response token; KL / entropy are
    averaged per sequence then over sequences. Metrics: clip fractions count tokens; seq_ratio/* is
    the unclipped geometric mean (GSPO's s_i), seq_ratio_clipped/* the one the loss uses.
    """
    check_loss_range("gmpo", clip_ratio_low, clip_ratio_high, log_ratio_bound, where="")
    _validate_common(kl_coef, entropy_coef, ref_logp, entropy, global_batch_normalizer)
    b = _prepare(logp, old_logp, advantages, mask, ref_logp, entropy)
    adv = b.adv if b.adv.dim() == 1 else _token_mean_per_seq(b.adv, b)

    lr = b.log_ratio.clamp(-log_ratio_bound, log_ratio_bound)  # [B, T]; 0 off-mask
    lr_val = lr.detach()
    a = adv[:, None]
    # the clipped branch of min / max is the active one exactly here (then the token's term is constant)
    clip_high = (a > 0) & (lr_val > clip_ratio_high)
    clip_low = (a < 0) & (lr_val < -clip_ratio_low)
    clipped = torch.where(clip_high, clip_ratio_high, torch.where(clip_low, -clip_ratio_low, lr))
    ratio = _token_mean_per_seq(clipped, b).exp()  # [B]: the clipped geometric mean
    obj = adv * ratio
    if is_weights is not None:
        w = _check_weights(is_weights, b)
        if w.dim() == 2:  # exp(mean_t log w_t); log 0 = -inf gives 0 (off-mask entries excluded)
            w = _token_mean_per_seq(torch.where(b.mask, torch.log(w), 0.0), b).exp()
        obj = obj * w
    pg_terms = torch.where(b.active, -obj, 0.0)  # [B]
    count = b.active.sum().to(obj.dtype)

    m = b.mask
    r_val = lr_val.exp()
    metrics = _batch_metrics(b, _seq_ratio_value(b, log_ratio_bound))
    metrics.update({
        "clip_frac_low": Metric.mean(clip_low.to(torch.float64), m),
        "clip_frac_high": Metric.mean(clip_high.to(torch.float64), m),
        "ratio_out_low_frac": Metric.mean((lr_val < -clip_ratio_low).to(torch.float64), m),
        "ratio_out_high_frac": Metric.mean((lr_val > clip_ratio_high).to(torch.float64), m),
        "seq_ratio_clipped/mean": Metric.mean(ratio.detach(), b.active),
        "seq_ratio_clipped/min": Metric.min(ratio.detach(), b.active),
        "seq_ratio_clipped/max": Metric.max(ratio.detach(), b.active),
        **_token_ratio_metrics(r_val, b),
    })
    return _finish(pg_terms, count, b, mode="seq-mean-token-mean", norm_constant=None, kl_coef=kl_coef,
                   ref_logp=ref_logp, entropy_coef=entropy_coef, entropy=entropy, bound=log_ratio_bound,
                   global_batch_normalizer=global_batch_normalizer, metrics=metrics)


@register_policy_loss("luspo")
def luspo_loss(
    logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
    clip_ratio_low: float = 2e-3, clip_ratio_high: float = 2.5e-3, log_ratio_bound: float = 20.0,
    kl_coef: float = 0.0, entropy_coef: float = 0.0, ref_logp: Optional[Tensor] = None,
    entropy: Optional[Tensor] = None, global_batch_normalizer: Normalizer = None,
    is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, Metrics]:
    """LUSPO: GSPO with each sequence's objective scaled by its length (GSPO's length bias removed).

    Implements J_LUSPO of arXiv 2602.05261: (1/G) sum_i |y_i| min(s_i A_i, clip(s_i, 1-eps_l, 1+eps_h) A_i), s_i as in GSPO.

    logp, old_logp, mask (, ref_logp, entropy), advantages: as gspo_loss (the same s_i, clipping,
    rollout correction and metrics). GSPO's s_i is a per-token geometric mean, so its gradient
    spreads 1/|y_i| over each token and a long response moves each of its tokens less than a short
    one: LUSPO multiplies the sequence's term by |y_i|, which gives every token of the batch the
    same weight. loss = -(1/N) sum_i |y_i| obj_i over the N sequences with >= 1 response token
    (N = global normalizer if given): the value scales with the response length. The KL / entropy
    terms scale with it too (token sums per sequence, then the mean over sequences).
    """
    check_loss_range("luspo", clip_ratio_low, clip_ratio_high, log_ratio_bound, where="")
    _validate_common(kl_coef, entropy_coef, ref_logp, entropy, global_batch_normalizer)
    b = _prepare(logp, old_logp, advantages, mask, ref_logp, entropy)
    obj, metrics = _gspo_sequence_objective(b, clip_ratio_low, clip_ratio_high, log_ratio_bound, is_weights)
    pg_terms = torch.where(b.active, -b.lengths * obj, 0.0)  # [B]
    count = b.active.sum().to(obj.dtype)
    return _finish(pg_terms, count, b, mode="seq-mean-token-sum", norm_constant=None, kl_coef=kl_coef,
                   ref_logp=ref_logp, entropy_coef=entropy_coef, entropy=entropy, bound=log_ratio_bound,
                   global_batch_normalizer=global_batch_normalizer, metrics=metrics)


# ----------------------------------------------------------------------------------------------
# Dispatch
# ----------------------------------------------------------------------------------------------


def batch_normalizer(cfg: LossConfig, mask: Tensor) -> Tensor:
    """The local unit count the loss divides by: response tokens for grpo / cispo "token-mean",
    sequences with >= 1 response token otherwise. Sum it over micro-batches and all-reduce it over
    the DP group to get ``global_batch_normalizer``. Returns a float32 scalar on mask's device."""
    m = mask if mask.dtype == torch.bool else mask != 0
    if cfg.name in AGG_MODE_LOSSES and cfg.loss_agg_mode == "token-mean":
        return m.sum().to(torch.float32)
    return (m.sum(dim=-1) > 0).sum().to(torch.float32)


def loss_kwargs(cfg: LossConfig) -> dict:
    """The hyperparameters of ``cfg.name``'s loss function, as keyword arguments, from the config."""
    kwargs: dict = dict(log_ratio_bound=cfg.log_ratio_bound, kl_coef=cfg.kl_coef, entropy_coef=cfg.entropy_coef)
    if cfg.name == "sapo":
        return {**kwargs, "tau_pos": cfg.sapo_tau_pos, "tau_neg": cfg.sapo_tau_neg}
    low, high = cfg.clip_range()
    kwargs.update(clip_ratio_low=low, clip_ratio_high=high)
    if cfg.name in AGG_MODE_LOSSES:
        kwargs.update(loss_agg_mode=cfg.loss_agg_mode, loss_agg_norm_constant=cfg.loss_agg_norm_constant)
    if cfg.name == "grpo":
        kwargs.update(dual_clip_c=cfg.dual_clip_c)
    return kwargs


def compute_policy_loss(
    cfg: LossConfig, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
    ref_logp: Optional[Tensor] = None, entropy: Optional[Tensor] = None,
    global_batch_normalizer: Normalizer = None, is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, Metrics]:
    """Dispatch to the loss named by ``cfg.name`` with the config's hyperparameters (is_weights: the
    rollout-correction weights, rollout_correction.correction_weights)."""
    return get_policy_loss(cfg.name)(logp, old_logp, advantages, mask, ref_logp=ref_logp, entropy=entropy,
                                     global_batch_normalizer=global_batch_normalizer, is_weights=is_weights,
                                     **loss_kwargs(cfg))
