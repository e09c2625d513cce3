"""Policy losses for RL post-training, as pure functions: GSPO, GSPO-token, GRPO (PPO-clip), GSPO's
successors SAPO (soft gate), CISPO (clipped importance weights), GMPO (geometric mean) and LUSPO
(length-unbiased GSPO), and the peers' VESPO (a smooth sequence weight) and DPPO (a trust region on the
token's probability: binary TV or binary KL).

A loss is one spec and one function (verl's ``register_policy_loss``): ``@register_policy_loss(name, spec)`` on a
function ``(b: LossBatch, s: settings, is_weights) -> PolicyTerms`` that states its paper's formula; the spec
(config/loss_spec.py; the built-ins' in config/losses.py, which the job's rules read without importing this
module) declares the ratio it uses, its clip range's defaults and units, its aggregation and its own settings
with their bounds, which the config checks by key when a job is loaded. The shared plumbing is written once, in
``policy_loss``: the public function every caller sees, ``fn(logp, old_logp, advantages, mask, *, ref_logp,
entropy, global_batch_normalizer, is_weights, **settings)``, checks the settings (in the precision of its inputs),
prepares the batch, runs the formula, checks what it returned, adds the KL and entropy terms aggregated like the
policy term, and normalizes. A job resolves its loss once (``resolve_loss`` -> ``ResolvedLoss``: the settings
checked and frozen) and calls it on every micro-batch without checking them again. A loss of your own:
``@policy_loss(LossSpec(...))`` in a module of yours, run with ``loss.name=package.module:function`` or
``loss.name=path/to/file.py:function`` (docs/algorithms.md).

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
    gspo_token, sapo, gmpo, luspo, grpo / cispo / dppo "seq-mean-*") or per-token terms (vespo, grpo / cispo /
    dppo "token-mean"), and the normalizer counts those units. By default it is the local count, which is right for one process and one
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
    All arithmetic runs in at least float32, whatever the input dtype; the settings are checked in
    that precision (loss_spec.py: what would overflow there is refused by name).
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Callable, Optional, Union

import torch

from megatron_gspo.config import LossConfig
from megatron_gspo.config.loss_spec import (  # the spec's vocabulary, for a loss of one's own
    CONFIGURABLE,
    FP32_INPUTS,
    LOG_RATIO,
    RATIO,
    SEQUENCE,
    TOKEN,
    WEIGHT,
    LossSpec,
    Numerics,
    Setting,
    numerics_of_format,
    resolve_settings,
)
from megatron_gspo.config.losses import (
    LOSS_SPECS,
    VESPO_LOG_W_FLOOR,
    LossSettings,
    loss_settings,
    plugin,
    register_spec,
)
from megatron_gspo.errors import ConfigError
from megatron_gspo.runtime.metrics import Metric

Tensor = torch.Tensor
Metrics = dict[str, Metric]
Normalizer = Optional[Union[float, Tensor]]

__all__ = [
    "CONFIGURABLE", "LOG_RATIO", "POLICY_LOSSES", "RATIO", "SAPO_GATED_WEIGHT", "SEQUENCE", "TOKEN", "WEIGHT",
    "LossBatch", "LossConfig", "LossSpec", "Metrics", "PolicyTerms", "ResolvedLoss", "Setting", "batch_normalizer",
    "cispo_loss", "compute_policy_loss", "get_policy_loss", "gmpo_loss", "grpo_loss", "gspo_loss", "gspo_token_loss",
    "luspo_loss", "on_policy_metrics", "policy_loss", "register_policy_loss", "resolve_loss", "sapo_loss",
    "vespo_loss", "dppo_tv_loss", "dppo_kl_loss",
]


# ----------------------------------------------------------------------------------------------
# What a loss's formula is handed, and what it returns
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossBatch:
    """One batch on the token grid, prepared once for every loss (the module doc's shapes)."""

    mask: Tensor  # [B, T] bool
    logp: Tensor  # [B, T] compute dtype, differentiable
    log_ratio: Tensor  # [B, T] logp - old_logp, exactly 0 outside the mask (differentiable)
    lengths: Tensor  # [B] response tokens per row, compute dtype
    active: Tensor  # [B] bool, rows with >= 1 response token
    adv: Tensor  # [B] or [B, T], compute dtype, detached

    def token_mean(self, x: Tensor) -> Tensor:
        """[B, T] -> [B]: mean over each row's response tokens (0 for empty rows)."""
        return torch.where(self.mask, x, 0.0).sum(dim=-1) / self.lengths.clamp(min=1)

    def seq_log_ratio(self) -> Tensor:
        """[B]: (1/|y_i|) sum_t log(pi/pi_old), the log of GSPO's s_i before the bound."""
        return self.log_ratio.sum(dim=-1) / self.lengths.clamp(min=1)

    def seq_adv(self) -> Tensor:
        """[B]: the advantage per sequence (a [B, T] one reduced by its mean over each response)."""
        return self.adv if self.adv.dim() == 1 else self.token_mean(self.adv)

    def token_adv(self) -> Tensor:
        """Advantages on the token grid: [B, 1] (broadcasts) or [B, T] with 0 off-mask (masked positions may
        hold NaN; a NaN times a zero gradient would still be NaN in the backward pass)."""
        return self.adv[:, None] if self.adv.dim() == 1 else torch.where(self.mask, self.adv, 0.0)

    def token_ratio(self, bound: float) -> Tensor:
        """[B, T] exp(clamp(logp - old_logp, +-bound)), differentiable; 1 off-mask."""
        return self.log_ratio.clamp(-bound, bound).exp()

    def weights(self, is_weights: Tensor) -> Tensor:
        """Rollout-correction weights [B] or [B, T] as a detached tensor of the loss's dtype (0 off-mask)."""
        w = is_weights
        if tuple(w.shape) not in (tuple(self.mask.shape[:1]), tuple(self.mask.shape)):
            raise ValueError(f"is_weights must be [B]={tuple(self.mask.shape[:1])} or [B, T]={tuple(self.mask.shape)}, "
                             f"got {tuple(w.shape)}")
        # where(): masked positions may hold anything (a mis weight of 0 times an inf must not be NaN)
        w = w.detach().to(self.logp.dtype)
        return w if w.dim() == 1 else torch.where(self.mask, w, 0.0)

    def token_weights(self, is_weights: Optional[Tensor]) -> Optional[Tensor]:
        """Rollout-correction weights on the token grid ([B, 1] or [B, T]), or None."""
        if is_weights is None:
            return None
        w = self.weights(is_weights)
        return w[:, None] if w.dim() == 1 else w


@dataclass(frozen=True)
class PolicyTerms:
    """What a loss's formula returns: the policy loss terms (negated objective) per unit, ``[B]`` (0 for empty
    rows; the loss divides their sum by the sequences), or per token, ``[B, T]`` (``per_token``: aggregated by the
    spec's mode, as the KL and entropy terms are); its own metrics (at least clip_frac_low / clip_frac_high: the
    share whose gradient its clip or gate cut); and ``constant``, a part of the value without gradient, shaped as
    ``terms``, added in float64 (SAPO's 2 A / tau: summed with the rest in fp32 it would swamp it)."""

    terms: Tensor
    per_token: bool = False
    metrics: Metrics = field(default_factory=dict)
    constant: Optional[Tensor] = None


LossFormula = Callable[[LossBatch, SimpleNamespace, Optional[Tensor]], PolicyTerms]
PolicyLoss = Callable[..., tuple[Tensor, Metrics]]


# ----------------------------------------------------------------------------------------------
# The plumbing every loss shares
# ----------------------------------------------------------------------------------------------


def _prepare(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
             ref_logp: Optional[Tensor], entropy: Optional[Tensor]) -> LossBatch:
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
    return LossBatch(m, lp, log_ratio, lengths, lengths > 0, advantages.detach().to(dtype))


def _aggregate(x: Tensor, b: LossBatch, mode: str, norm_constant: Optional[float]) -> tuple[Tensor, Tensor]:
    """[B, T] per-token loss -> (per-unit terms, local unit count); loss = terms.sum() / count.

    The terms are per token ([B, T], 0 off-mask) for "token-mean" and per sequence ([B], 0 for
    empty rows) otherwise. Returning them unsummed lets the metrics sum them in float64, so the
    reduced value does not depend on how the batch was split over ranks and micro-batches.
    """
    if mode == "token-mean":
        return torch.where(b.mask, x, 0.0), b.lengths.sum()
    if mode == "seq-mean-token-mean":
        return b.token_mean(x), b.active.sum().to(x.dtype)
    if mode == "seq-mean-token-sum-norm":
        return torch.where(b.mask, x, 0.0).sum(dim=-1) / norm_constant, b.active.sum().to(x.dtype)
    if mode == "seq-mean-token-sum":  # each sequence weighs its length (LUSPO)
        return torch.where(b.mask, x, 0.0).sum(dim=-1), b.active.sum().to(x.dtype)
    raise ValueError(f"loss_agg_mode={mode!r} is not an aggregation mode")


def _k3(ref_logp: Tensor, b: LossBatch, bound: float) -> Tensor:
    """Per-token k3 estimator of KL(pi_theta || pi_ref): exp(d) - d - 1 >= 0, d = ref_logp - logp."""
    d = torch.where(b.mask, ref_logp.detach().to(b.logp.dtype) - b.logp, 0.0).clamp(-bound, bound)
    return torch.expm1(d) - d


def _validate_inputs(s: SimpleNamespace, ref_logp: Optional[Tensor], entropy: Optional[Tensor],
                     global_batch_normalizer: Normalizer) -> None:
    if s.kl_coef > 0 and ref_logp is None:
        raise ValueError(f"kl_coef={s.kl_coef} > 0 needs ref_logp (the reference policy's log-probs)")
    if s.entropy_coef > 0 and entropy is None:
        raise ValueError(f"entropy_coef={s.entropy_coef} > 0 needs the per-token entropy tensor")
    if isinstance(global_batch_normalizer, (int, float)) and not global_batch_normalizer > 0:
        raise ValueError(f"global_batch_normalizer must be > 0, got {global_batch_normalizer}")


def _sum_over_count(terms: Tensor, count: Tensor, constant: Optional[Tensor] = None) -> Metric:
    # The *local* count: reduced over ranks, sum / count is the global-batch value.
    total = terms.detach().to(torch.float64).sum()
    return Metric.from_sum_count(total if constant is None else total + constant.sum(), count)


def _units(out: PolicyTerms, b: LossBatch, mode: str, s: SimpleNamespace) -> tuple[Tensor, Tensor, Optional[Tensor]]:
    """The formula's terms per unit of the loss's aggregation: (terms, local count, float64 constant or None)."""
    norm_constant = getattr(s, "loss_agg_norm_constant", None)
    if out.per_token:
        terms, count = _aggregate(out.terms, b, mode, norm_constant)
        constant = None if out.constant is None else _aggregate(out.constant, b, mode, norm_constant)[0]
        return terms, count, constant
    if mode == "token-mean":
        raise ValueError("a loss whose formula returns terms per sequence aggregates per sequence: its spec's "
                         "aggregation cannot be token-mean")
    return out.terms, b.active.sum().to(out.terms.dtype), out.constant


def _finish(out: PolicyTerms, b: LossBatch, s: SimpleNamespace, mode: str, ref_logp: Optional[Tensor],
            entropy: Optional[Tensor], global_batch_normalizer: Normalizer, metrics: Metrics) -> tuple[Tensor, Metrics]:
    """Aggregate the policy terms, add the KL and entropy terms (aggregated like them) and normalize."""
    pg_terms, count, constant = _units(out, b, mode, s)
    norm_constant = getattr(s, "loss_agg_norm_constant", None)
    terms = pg_terms
    metrics["pg_loss"] = _sum_over_count(pg_terms, count, constant)
    if ref_logp is not None:
        kl_terms, _ = _aggregate(_k3(ref_logp, b, s.log_ratio_bound), b, mode, norm_constant)
        metrics["kl_ref"] = _sum_over_count(kl_terms, count)
        if s.kl_coef > 0:
            terms = terms + s.kl_coef * kl_terms
    if entropy is not None:
        ent = entropy.to(b.logp.dtype)
        metrics["entropy"] = Metric.mean(ent, b.mask)
        if s.entropy_coef > 0:
            ent_terms, _ = _aggregate(ent, b, mode, norm_constant)
            terms = terms - s.entropy_coef * ent_terms  # a bonus: higher entropy lowers the loss
    metrics["loss"] = _sum_over_count(terms, count, constant)
    normalizer = count.clamp(min=1) if global_batch_normalizer is None else global_batch_normalizer
    total = terms.sum() if constant is None else terms.sum() + constant.sum().to(terms.dtype)
    return total / normalizer, metrics


def _batch_metrics(b: LossBatch, seq_ratio: Tensor) -> Metrics:
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


def _seq_ratio_value(b: LossBatch, bound: float) -> Tensor:
    """[B] GSPO's sequence ratio exp(mean_t log-ratio), detached: every loss reports it (seq_ratio/*)."""
    return b.seq_log_ratio().detach().clamp(-bound, bound).exp()


def _numerics(dtype: torch.dtype) -> Numerics:
    info = torch.finfo(dtype)
    return numerics_of_format({torch.float32: "fp32", torch.float64: "float64"}.get(dtype, str(dtype)),
                              info.max, info.eps / 2)


def _signature(spec: LossSpec) -> inspect.Signature:
    """The public signature of a loss: the inputs, then its settings with their defaults (for help())."""
    p = inspect.Parameter
    params = [p(n, p.POSITIONAL_OR_KEYWORD) for n in ("logp", "old_logp", "advantages", "mask")]
    params += [p(n, p.KEYWORD_ONLY, default=v) for n, v in spec.defaults().items()]
    params += [p(n, p.KEYWORD_ONLY, default=None)
               for n in ("ref_logp", "entropy", "global_batch_normalizer", "is_weights")]
    return inspect.Signature(params)


def _what(x) -> str:
    """What a formula handed back, in a few words (for the line refusing it)."""
    if isinstance(x, Tensor):
        return f"a tensor of shape {tuple(x.shape)}"
    text = repr(x)
    return f"a {type(x).__name__} ({text if len(text) <= 60 else text[:57] + '...'})"


def _check_terms(out, b: LossBatch, who: str) -> None:
    """A formula's return value, before the plumbing reads it: a PolicyTerms whose terms (and constant) are per
    sequence, [B], or per token, [B, T] with ``per_token``, and whose metrics are Metrics holding the clip
    fractions every loss reports (the trainer's on-policy check reads them). A plug-in's mistake is refused in
    one line naming the loss, not as a size mismatch or a KeyError in the plumbing. Shapes and keys only: no
    host sync, cheap on every call."""
    if not isinstance(out, PolicyTerms):
        raise ConfigError(f"{who}: its formula returned {_what(out)}, not a losses.PolicyTerms(terms, per_token, "
                          "metrics, constant)")
    shape = tuple(b.mask.shape) if out.per_token else tuple(b.mask.shape[:1])
    want = f"{'[B, T]' if out.per_token else '[B]'} = {shape} (per_token={out.per_token})"
    for name, t in (("terms", out.terms), ("constant", out.constant)):
        if (t is not None or name == "terms") and not (isinstance(t, Tensor) and tuple(t.shape) == shape):
            raise ConfigError(f"{who}: its formula returned {name} as {_what(t)} for a batch of [B, T] = "
                              f"{tuple(b.mask.shape)}; they must be {want}")
    metrics = out.metrics if isinstance(out.metrics, dict) else {}
    missing = [k for k in ("clip_frac_low", "clip_frac_high") if k not in metrics]
    if missing:
        raise ConfigError(f"{who}: its formula's metrics lack {' and '.join(missing)} (got "
                          f"{sorted(metrics) if isinstance(out.metrics, dict) else _what(out.metrics)}): every loss "
                          "reports the share its clip or gate cut, 0 where it has none")
    for k, v in metrics.items():
        if not isinstance(v, Metric):
            raise ConfigError(f"{who}: its formula's metric {k!r} is {_what(v)}, not a runtime.metrics.Metric "
                              "(Metric.mean(values, mask), Metric.sum(...), ...)")


def _evaluate(formula: LossFormula, who: str, values, mode: str, logp: Tensor, old_logp: Tensor,
              advantages: Tensor, mask: Tensor, ref_logp: Optional[Tensor], entropy: Optional[Tensor],
              global_batch_normalizer: Normalizer, is_weights: Optional[Tensor]) -> tuple[Tensor, Metrics]:
    """A loss on one batch with settings already checked (``values``: its keywords; ``mode``: its aggregation):
    prepare the batch, run the formula, check what it returned, aggregate, add the KL and entropy terms and
    normalize. ``who`` names the loss in the line refusing a formula's return value."""
    s = SimpleNamespace(**values)
    _validate_inputs(s, ref_logp, entropy, global_batch_normalizer)
    b = _prepare(logp, old_logp, advantages, mask, ref_logp, entropy)
    out = formula(b, s, is_weights)
    _check_terms(out, b, who)
    metrics = _batch_metrics(b, _seq_ratio_value(b, s.log_ratio_bound))
    metrics.update(out.metrics)
    return _finish(out, b, s, mode, ref_logp, entropy, global_batch_normalizer, metrics)


def policy_loss(spec: LossSpec) -> Callable[[LossFormula], PolicyLoss]:
    """Decorator: the loss function of a formula ``formula(b, s, is_weights) -> PolicyTerms`` and its spec.

    The function returned is what every caller uses, ``fn(logp, old_logp, advantages, mask, *, ref_logp=None,
    entropy=None, global_batch_normalizer=None, is_weights=None, **settings) -> (loss, metrics)`` (the module
    doc): it checks ``settings`` against the spec in the precision of its inputs (defaults filled in; ``s`` holds
    them by keyword), prepares the batch, reports the metrics every loss reports, runs the formula, aggregates
    its terms, adds the KL and entropy terms and normalizes. ``fn.spec`` is the spec; ``fn.evaluate`` the same
    without the check of the settings (a job's loss, resolved once: ResolvedLoss). Registered with
    register_policy_loss, or named by ``loss.name=module:function`` as a plug-in."""
    def make(formula: LossFormula) -> PolicyLoss:
        named = spec if spec.name else dataclasses.replace(spec, name=formula.__name__)

        @functools.wraps(formula)
        def loss(logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *, ref_logp: Optional[Tensor] = None,
                 entropy: Optional[Tensor] = None, global_batch_normalizer: Normalizer = None,
                 is_weights: Optional[Tensor] = None, **settings) -> tuple[Tensor, Metrics]:
            dtype = torch.promote_types(logp.dtype, torch.float32)
            values = resolve_settings(named, settings, _numerics(dtype), formula.__name__)
            return _evaluate(formula, f"policy loss {named.name!r}", values, named.mode(values), logp, old_logp,
                             advantages, mask, ref_logp, entropy, global_batch_normalizer, is_weights)

        del loss.__wrapped__  # help() shows the public signature, not the formula's
        loss.__signature__ = _signature(named)
        loss.spec = named
        loss.evaluate = functools.partial(_evaluate, formula)
        return loss
    return make


# name -> loss function, in registration order (the built-ins below, then any registered in code)
POLICY_LOSSES: dict[str, PolicyLoss] = {}


def register_policy_loss(name: str, spec: Optional[LossSpec] = None) -> Callable[[Callable], PolicyLoss]:
    """Decorator (verl's ``register_policy_loss``): register a loss under ``name``, the value of ``loss.name``.
    With a spec it decorates a formula (policy_loss) and the config learns the spec (config/losses.py: the
    built-ins' are declared there); without one it registers a ready loss function as it is (which a job cannot
    use: the config checks a loss's settings against its spec)."""
    def reg(fn: Callable) -> PolicyLoss:
        if name in POLICY_LOSSES:
            raise ValueError(f"policy loss {name!r} is registered twice ({POLICY_LOSSES[name].__qualname__} and "
                             f"{fn.__qualname__})")
        if spec is not None:
            fn = policy_loss(register_spec(name, spec))(fn)
        POLICY_LOSSES[name] = fn
        return fn
    return reg


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss registered under ``name``, or the plug-in it names (``module:function``, loaded on first use)."""
    fn = POLICY_LOSSES.get(name) or plugin(name)
    if fn is None:
        raise ValueError(f"unknown policy loss {name!r}; valid names: {list(POLICY_LOSSES)}")
    return fn


def on_policy_metrics(logp: Tensor, old_logp: Tensor, mask: Tensor, loss_metrics: Metrics) -> Metrics:
    """How far a minibatch trained on the very weights that sampled it is from ratio 1 (GSPO §4.1:
    on-policy, s_i = 1 and nothing is clipped; any deviation is the old log-probs' rounding).

    logp, old_logp, mask: [B, T] (the current and old log-probs of one micro-batch, its loss mask);
    loss_metrics: what the loss returned for that micro-batch. Returns detached Metrics:
      onpolicy/seq_ratio_dev_max    max over responses of |s_i - 1|, s_i = exp(mean_t log ratio) (GSPO eq. 7)
      onpolicy/log_ratio_abs_max    max over response tokens of |log pi - log pi_old|
      onpolicy/clip_frac_low, _high the loss's own clip fractions on it"""
    b = _prepare(logp.detach(), old_logp, torch.zeros(logp.shape[0], device=logp.device), mask, None, None)
    seq_dev = torch.expm1(b.seq_log_ratio().to(torch.float64)).abs()
    return {
        "onpolicy/seq_ratio_dev_max": Metric.max(seq_dev, b.active),
        "onpolicy/log_ratio_abs_max": Metric.max(b.log_ratio.to(torch.float64).abs(), b.mask),
        "onpolicy/clip_frac_low": loss_metrics["clip_frac_low"],
        "onpolicy/clip_frac_high": loss_metrics["clip_frac_high"],
    }


# ----------------------------------------------------------------------------------------------
# GSPO
# ----------------------------------------------------------------------------------------------


def _gspo_common(b: LossBatch, bound: float) -> tuple[Tensor, Tensor]:
    """(s_i [B] differentiable, in-bound [B] bool) for the sequence-level importance ratio."""
    mean_lr = b.seq_log_ratio()
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


def _seq_clip_metrics(clip_low: Tensor, clip_high: Tensor, s: Tensor, b: LossBatch,
                      low: float, high: float) -> Metrics:
    """Clip fractions over sequences (a [B, T] mask counts its token fraction per sequence)."""
    def per_seq(x: Tensor) -> Tensor:
        return x.to(b.logp.dtype) if x.dim() == 1 else b.token_mean(x.to(b.logp.dtype))

    return {
        "clip_frac_low": Metric.mean(per_seq(clip_low), b.active),
        "clip_frac_high": Metric.mean(per_seq(clip_high), b.active),
        # Regardless of the advantage's sign: how far off-policy the batch is.
        "ratio_out_low_frac": Metric.mean((s < 1 - low).to(torch.float64), b.active),
        "ratio_out_high_frac": Metric.mean((s > 1 + high).to(torch.float64), b.active),
    }


def _gspo_sequence_objective(b: LossBatch, s: SimpleNamespace, is_weights: Optional[Tensor]) -> tuple[Tensor, Metrics]:
    """GSPO's per-sequence objective min(s_i A_i, clip(s_i) A_i) [B] (differentiable), rollout-corrected,
    with the sequence-clip metrics (shared by gspo_loss and luspo_loss)."""
    low, high = s.clip_ratio_low, s.clip_ratio_high
    adv = b.seq_adv()
    ratio, _ = _gspo_common(b, s.log_ratio_bound)
    clip_low, clip_high = _clip_masks(adv, ratio.detach(), low, high)
    obj = _clip_objective(ratio, adv, clip_low, clip_high, low, high)
    if is_weights is not None:
        # the sequence is GSPO's unit: a token-level weight enters as its mean over the response
        w = b.weights(is_weights)
        obj = obj * (w if w.dim() == 1 else b.token_mean(w))
    return obj, _seq_clip_metrics(clip_low, clip_high, ratio.detach(), b, low, high)


@register_policy_loss("gspo", LOSS_SPECS["gspo"])
def gspo_loss(b: LossBatch, s: SimpleNamespace, is_weights: Optional[Tensor]) -> PolicyTerms:
    """GSPO: one importance ratio and one clip per sequence.

    Implements J_GSPO of arXiv 2507.18071 §4.1: mean_i min(s_i A_i, clip(s_i, 1-eps_l, 1+eps_h) A_i), s_i = (pi_theta(y_i)/pi_old(y_i))^(1/|y_i|).

    logp, old_logp, mask (, ref_logp, entropy): [B, T]; advantages: [B], or [B, T] reduced to [B]
    by its masked mean over each response (a per-sequence advantage broadcast over tokens comes
    back unchanged; use gspo_token for advantages that genuinely vary per token).
    s_i is computed in log space, exp(clamp(mean_t(logp - old_logp), +-log_ratio_bound)).
    clip_ratio_low / clip_ratio_high: the ratio range [1 - low, 1 + high] (default 3e-4 / 4e-4, §5.1).
    loss = -(1/N) sum_i obj_i over the N sequences with >= 1 response token (N = global
    normalizer if given); KL / entropy terms are averaged per sequence then over sequences.
    Returns (scalar loss, metrics); clip fractions count sequences.
    """
    obj, metrics = _gspo_sequence_objective(b, s, is_weights)
    return PolicyTerms(torch.where(b.active, -obj, 0.0), metrics=metrics)  # [B]


@register_policy_loss("gspo_token", LOSS_SPECS["gspo_token"])
def gspo_token_loss(b: LossBatch, s: SimpleNamespace, is_weights: Optional[Tensor]) -> PolicyTerms:
    """GSPO-token: GSPO's sequence ratio with a per-token advantage.

    Implements J_GSPO-token of arXiv 2507.18071 §4.3: mean_i (1/|y_i|) sum_t min(s_it A_it, clip(s_it) A_it), s_it = sg[s_i] pi_theta(y_it)/sg[pi_theta(y_it)].

    logp, old_logp, mask (, ref_logp, entropy): [B, T]; advantages: [B] (broadcast) or [B, T].
    s_it has the value of s_i and the gradient s_i * grad log pi(y_it), so clipping happens on the
    sequence ratio: a token's clipped branch is active iff sign(A_it) and s_i say so. With
    per-sequence advantages the loss value and the gradient w.r.t. logp equal gspo_loss's (up to
    rounding), clipped sequences (zero gradient) and out-of-bound log-ratios included.
    loss = -(1/N) sum_i (masked token mean of obj_it); N as in gspo_loss.
    """
    low, high = s.clip_ratio_low, s.clip_ratio_high
    adv = b.adv[:, None] if b.adv.dim() == 1 else b.adv  # [B, 1] broadcasts over tokens
    ratio, in_bound = _gspo_common(b, s.log_ratio_bound)
    s_val = ratio.detach()
    # pi/sg[pi] = exp(logp - sg[logp]): value exactly 1, gradient grad logp. Outside the bound the
    # sequence gets no gradient, matching the clamp inside gspo_loss's s_i.
    tok = torch.where(b.mask & in_bound[:, None], b.logp - b.logp.detach(), 0.0)
    s_tok = s_val[:, None] * tok.exp()  # [B, T]
    clip_low, clip_high = _clip_masks(adv, s_val[:, None].expand_as(s_tok), low, high)
    obj = _clip_objective(s_tok, adv, clip_low, clip_high, low, high)
    w = b.token_weights(is_weights)
    if w is not None:
        obj = obj * w
    return PolicyTerms(-b.token_mean(obj), metrics=_seq_clip_metrics(clip_low, clip_high, s_val, b, low, high))


# ----------------------------------------------------------------------------------------------
# GRPO
# ----------------------------------------------------------------------------------------------


@register_policy_loss("grpo", LOSS_SPECS["grpo"])
def grpo_loss(b: LossBatch, s: SimpleNamespace, is_weights: Optional[Tensor]) -> PolicyTerms:
    """GRPO: PPO-clip on per-token importance ratios.

    Implements J_GRPO of arXiv 2507.18071 §2: (1/G) sum_i (1/|y_i|) sum_t min(w_it A_it, clip(w_it, 1-eps_l, 1+eps_h) A_it), w_it = pi_theta(y_it)/pi_old(y_it).

    logp, old_logp, mask (, ref_logp, entropy): [B, T]; advantages: [B] (broadcast) or [B, T].
    w_it = exp(clamp(logp - old_logp, +-log_ratio_bound)); clip range default 0.2 / 0.2 (DAPO's
    clip-higher: 0.2 / 0.28). dual_clip_c (> 1): for A < 0 the per-token objective is max(obj, c A),
    i.e. no gradient once w > c. The per-token loss (and the k3 KL / entropy terms) are aggregated
    by loss_agg_mode:
      token-mean               sum_it l_it / (number of response tokens)
      seq-mean-token-mean      (1/N) sum_i (1/|y_i|) sum_t l_it        (the formula above)
      seq-mean-token-sum-norm  (1/N) sum_i (1/C) sum_t l_it, C = loss_agg_norm_constant (Dr. GRPO)
    The denominator (tokens or sequences) is replaced by global_batch_normalizer when given.
    Returns (scalar loss, metrics); clip fractions count tokens.
    """
    low, high, dual_clip_c = s.clip_ratio_low, s.clip_ratio_high, s.dual_clip_c
    adv = b.adv[:, None] if b.adv.dim() == 1 else b.adv
    ratio = b.token_ratio(s.log_ratio_bound)  # [B, T]; 1 off-mask
    r_val = ratio.detach()
    clip_low, clip_high = _clip_masks(adv, r_val, low, high)
    obj = _clip_objective(ratio, adv, clip_low, clip_high, low, high)
    if dual_clip_c is not None:
        # A < 0 and w > c: PPO's unclipped branch would push an already far-too-likely token down
        # with weight w (unbounded); dual clip caps the objective at c A (constant, no gradient).
        dual = (adv < 0) & (r_val > dual_clip_c)
        obj = torch.where(dual, dual_clip_c * adv.expand_as(obj), obj)
    w = b.token_weights(is_weights)
    if w is not None:  # after both clips, as verl applies rollout IS weights
        obj = obj * w
    m = b.mask
    metrics = {
        "clip_frac_low": Metric.mean(clip_low.expand_as(m).to(torch.float64), m),
        "clip_frac_high": Metric.mean(clip_high.expand_as(m).to(torch.float64), m),
        "ratio_out_low_frac": Metric.mean((r_val < 1 - low).to(torch.float64), m),
        "ratio_out_high_frac": Metric.mean((r_val > 1 + high).to(torch.float64), m),
        **_token_ratio_metrics(r_val, b),
    }
    if dual_clip_c is not None:
        metrics["dual_clip_frac"] = Metric.mean(dual.expand_as(m).to(torch.float64), m)
    return PolicyTerms(-obj, per_token=True, metrics=metrics)


# ----------------------------------------------------------------------------------------------
# GSPO's successors: SAPO, CISPO, GMPO, LUSPO
# ----------------------------------------------------------------------------------------------

# A SAPO token counts as gated (its clip_frac) once the gate has cut its gradient weight below this
# share of the unclipped surrogate's (4 sigma (1 - sigma) < 1/2: |r - 1| > 1.76 / tau).
SAPO_GATED_WEIGHT = 0.5


def _token_fracs(low: Tensor, high: Tensor, m: Tensor) -> Metrics:
    """The clip and ratio-out fractions of a loss whose clipped tokens are its out-of-range ones (a truncated or
    gated weight): low / high [B, T] bool (or broadcastable), m [B, T] the loss mask."""
    low, high = low.expand_as(m).to(torch.float64), high.expand_as(m).to(torch.float64)
    return {"clip_frac_low": Metric.mean(low, m), "clip_frac_high": Metric.mean(high, m),
            "ratio_out_low_frac": Metric.mean(low, m), "ratio_out_high_frac": Metric.mean(high, m)}


def _token_ratio_metrics(r_val: Tensor, b: LossBatch) -> Metrics:
    return {"token_ratio/mean": Metric.mean(r_val, b.mask), "token_ratio/min": Metric.min(r_val, b.mask),
            "token_ratio/max": Metric.max(r_val, b.mask)}


@register_policy_loss("sapo", LOSS_SPECS["sapo"])
def sapo_loss(b: LossBatch, s: SimpleNamespace, is_weights: Optional[Tensor]) -> PolicyTerms:
    """SAPO: a smooth, temperature-controlled gate on each token's ratio instead of a hard clip.

    Implements J_SAPO of arXiv 2511.20347: (1/G) sum_i (1/|y_i|) sum_t f_it(r_it) A_it, f_it(x) = (4/tau_it) sigmoid(tau_it (x - 1)), tau_it = tau_pos if A_it > 0 else tau_neg.

    logp, old_logp, mask (, ref_logp, entropy): [B, T]; advantages: [B] (broadcast) or [B, T].
    r_it = exp(clamp(logp - old_logp, +-log_ratio_bound)); tau_pos / tau_neg: the gate's temperatures (loss.sapo_tau_*,
    paper values 1.0 / 1.05). f is computed as 2/tau + (2/tau) tanh(tau (r - 1) / 2), the same function: the
    constant 2 A / tau has no gradient and is summed apart, in float64 (in fp32, sigmoid near 1/2 and the sum
    with 2 A / tau would round the policy term away at small tau). The gradient of a token's term is
    w_it r_it A_it grad log pi with the gate weight w_it = 4 sigma (1 - sigma) = sech^2(tau (r - 1) / 2):
    exactly the unclipped surrogate's at r = 1 (w = 1, so on-policy SAPO is the policy gradient), decaying
    smoothly as the ratio leaves 1 in either direction; no token's gradient is cut to zero at a threshold.
    Aggregation as the formula: token mean per sequence, then mean over the N sequences with >= 1 response
    token (N = global normalizer if given); KL / entropy alike. Metrics: clip_frac_low / _high count the
    tokens whose gate weight fell below SAPO_GATED_WEIGHT with r < 1 / r > 1, whatever the advantage's sign
    (below r = 1 the gate's argument is at least -tau, so at the paper's temperatures the weight stays above
    0.78 there and clip_frac_low is 0: the gate mostly damps ratios that ran high); gate/weight_mean,
    gate/weight_min, and the token ratio statistics.
    """
    adv = b.token_adv()
    ratio = b.token_ratio(s.log_ratio_bound)  # [B, T]; 1 off-mask
    tau = torch.where(adv > 0, adv.new_tensor(s.tau_pos), adv.new_tensor(s.tau_neg))
    half = torch.tanh(tau * (ratio - 1) / 2)  # sigmoid(x) = (1 + tanh(x / 2)) / 2, without the rounding near 1/2
    obj = (2 / tau) * half * adv  # f(r) A - 2 A / tau
    constant = (2 / tau.to(torch.float64)) * adv.to(torch.float64)
    w = b.token_weights(is_weights)
    if w is not None:
        obj, constant = obj * w, constant * w.to(torch.float64)
    m, r_val = b.mask, ratio.detach()
    weight = (1 - half * half).detach().expand_as(m)  # 4 sigma (1 - sigma): the gate's share of the gradient
    gated = weight < SAPO_GATED_WEIGHT
    metrics = {
        **_token_fracs(gated & (r_val < 1), gated & (r_val > 1), m),
        "gate/weight_mean": Metric.mean(weight, m),
        "gate/weight_min": Metric.min(weight, m),
        **_token_ratio_metrics(r_val, b),
    }
    return PolicyTerms(-obj, per_token=True, metrics=metrics, constant=-constant.expand_as(m))


@register_policy_loss("cispo", LOSS_SPECS["cispo"])
def cispo_loss(b: LossBatch, s: SimpleNamespace, is_weights: Optional[Tensor]) -> PolicyTerms:
    """CISPO: clip the importance-sampling weight, not the update; every token keeps a gradient.

    Implements J_CISPO of arXiv 2506.13585 eq. (4): (1/sum_i |o_i|) sum_i sum_t sg(r^_it) A_it log pi_theta(o_it), r^_it = clip(r_it, 1 - eps_low, 1 + eps_high).

    logp, old_logp, mask (, ref_logp, entropy): [B, T]; advantages: [B] (broadcast) or [B, T].
    r_it = exp(clamp(logp - old_logp, +-log_ratio_bound)) enters only as the detached weight r^_it,
    so the gradient of a token's term is r^_it A_it grad log pi whatever its ratio (the bound caps the
    weight, never the gradient). Clip range default 1.0 / 4.0: the lower end at 0 (no lower bound, as in
    MiniMax-M1) and a cap of 5 (ScaleRL's, arXiv 2510.13786). The loss value is the paper's surrogate,
    -r^ A log pi (it depends on log pi itself, not only on the ratio: on-policy it is -A log pi, not -A).
    Aggregated by loss_agg_mode as in grpo_loss ("token-mean", the paper's, by default); KL / entropy
    alike. Metrics: clip_frac_low / _high count the tokens whose weight was truncated (r < 1 - eps_low /
    r > 1 + eps_high, whatever the advantage's sign), and the token ratio statistics.
    """
    adv = b.token_adv()
    r_val = b.log_ratio.detach().clamp(-s.log_ratio_bound, s.log_ratio_bound).exp()  # [B, T]; 1 off-mask
    weight = r_val.clamp(1 - s.clip_ratio_low, 1 + s.clip_ratio_high)  # sg(r^)
    lp = torch.where(b.mask, b.logp, 0.0)  # masked positions may hold anything
    obj = weight * adv * lp
    w = b.token_weights(is_weights)
    if w is not None:
        obj = obj * w
    m = b.mask
    low, high = r_val < 1 - s.clip_ratio_low, r_val > 1 + s.clip_ratio_high
    return PolicyTerms(-obj, per_token=True, metrics={
        **_token_fracs(low, high, m),
        **_token_ratio_metrics(r_val, b),
    })


@register_policy_loss("gmpo", LOSS_SPECS["gmpo"])
def gmpo_loss(b: LossBatch, s: SimpleNamespace, is_weights: Optional[Tensor]) -> PolicyTerms:
    """GMPO: the geometric mean of token ratios, each clipped in log space before the mean.

    Implements J_GMPO of arXiv 2507.20673: (1/G) sum_i (prod_t min[r_it^sgn(A_i), clip(r_it^sgn(A_i), e^-eps_l, e^eps_h)]^sgn(A_i))^(1/|o_i|) A_i.

    logp, old_logp, mask (, ref_logp, entropy): [B, T]; advantages: [B], or [B, T] reduced to [B]
    by its masked mean over each response (GMPO's advantage is per sequence). In log space, with
    l_it = clamp(logp - old_logp, +-log_ratio_bound): c_it = min(l_it, clamp(l_it, -eps_l, eps_h))
    for A_i > 0, max(...) for A_i < 0 (PPO's one-sided trust region per token: a clipped token has
    zero gradient, the others keep theirs), and the objective is A_i exp(mean_t c_it). With the
    paper's symmetric range (0.4 / 0.4, §4: ratios within e^-0.4 .. e^0.4) this is the formula above
    exactly; an asymmetric range puts eps_l on the low side for A < 0 and eps_h on the high side for
    A > 0, as PPO does. Rollout-correction weights per token enter as their geometric mean over the
    response (the correction of GMPO's ratio: GM(r rho) = GM(r) GM(rho)); a zero weight zeroes the
    sequence. loss = -(1/N) sum_i obj_i over the N sequences with >= 1 response token; KL / entropy are
    averaged per sequence then over sequences. Metrics: clip fractions count tokens; seq_ratio/* is
    the unclipped geometric mean (GSPO's s_i), seq_ratio_clipped/* the one the loss uses.
    """
    low, high = s.clip_ratio_low, s.clip_ratio_high
    adv = b.seq_adv()
    lr = b.log_ratio.clamp(-s.log_ratio_bound, s.log_ratio_bound)  # [B, T]; 0 off-mask
    lr_val = lr.detach()
    a = adv[:, None]
    # the clipped branch of min / max is the active one exactly here (then the token's term is constant)
    clip_high = (a > 0) & (lr_val > high)
    clip_low = (a < 0) & (lr_val < -low)
    clipped = torch.where(clip_high, high, torch.where(clip_low, -low, lr))
    ratio = b.token_mean(clipped).exp()  # [B]: the clipped geometric mean
    obj = adv * ratio
    if is_weights is not None:
        w = b.weights(is_weights)
        if w.dim() == 2:  # exp(mean_t log w_t); log 0 = -inf gives 0 (off-mask entries excluded)
            w = b.token_mean(torch.where(b.mask, torch.log(w), 0.0)).exp()
        obj = obj * w
    m = b.mask
    return PolicyTerms(torch.where(b.active, -obj, 0.0), metrics={  # [B]
        "clip_frac_low": Metric.mean(clip_low.to(torch.float64), m),
        "clip_frac_high": Metric.mean(clip_high.to(torch.float64), m),
        "ratio_out_low_frac": Metric.mean((lr_val < -low).to(torch.float64), m),
        "ratio_out_high_frac": Metric.mean((lr_val > high).to(torch.float64), m),
        "seq_ratio_clipped/mean": Metric.mean(ratio.detach(), b.active),
        "seq_ratio_clipped/min": Metric.min(ratio.detach(), b.active),
        "seq_ratio_clipped/max": Metric.max(ratio.detach(), b.active),
        **_token_ratio_metrics(lr_val.exp(), b),
    })


@register_policy_loss("luspo", LOSS_SPECS["luspo"])
def luspo_loss(b: LossBatch, s: SimpleNamespace, is_weights: Optional[Tensor]) -> PolicyTerms:
    """LUSPO: GSPO with each sequence's objective scaled by its length (GSPO's length bias removed).

    Implements J_LUSPO of arXiv 2602.05261: (1/G) sum_i |y_i| min(s_i A_i, clip(s_i, 1-eps_l, 1+eps_h) A_i), s_i as in GSPO.

    logp, old_logp, mask (, ref_logp, entropy), advantages: as gspo_loss (the same s_i, clipping,
    rollout correction and metrics; clip range default 2e-3 / 2.5e-3, §5.1). GSPO's s_i is a per-token
    geometric mean, so its gradient spreads 1/|y_i| over each token and a long response moves each of its
    tokens less than a short one: LUSPO multiplies the sequence's term by |y_i|, which gives every token of
    the batch the same weight. loss = -(1/N) sum_i |y_i| obj_i over the N sequences with >= 1 response token
    (N = global normalizer if given): the value scales with the response length. The KL / entropy
    terms scale with it too (token sums per sequence, then the mean over sequences).
    """
    obj, metrics = _gspo_sequence_objective(b, s, is_weights)
    return PolicyTerms(torch.where(b.active, -b.lengths * obj, 0.0), metrics=metrics)  # [B]


# ----------------------------------------------------------------------------------------------
# The peers' losses since GSPO: VESPO (TRL), DPPO (prime-rl, SkyRL, verl)
# ----------------------------------------------------------------------------------------------


@register_policy_loss("vespo", LOSS_SPECS["vespo"])
def vespo_loss(b: LossBatch, s: SimpleNamespace, is_weights: Optional[Tensor]) -> PolicyTerms:
    """VESPO: a smooth weight of the whole response's importance ratio on REINFORCE, in place of a hard clip.

    Implements the VESPO objective of arXiv 2602.10693 as TRL 1.16 states it: (1 / sum_i |y_i|) sum_i sum_t sg[phi(w_i)] A_it log pi_theta(y_it), phi(w) = e^lambda w^k e^(-lambda w), w_i = prod_t pi_theta(y_it) / pi_old(y_it).

    logp, old_logp, mask (, ref_logp, entropy): [B, T]; advantages: [B] (broadcast) or [B, T]. In log space:
    log w_i = clamp(sum_t clamp(logp - old_logp, +-log_ratio_bound), log 1e-8, log_ratio_bound) (TRL's bounds at
    the default bound of 20), phi = exp(lambda + k log w - lambda w) with (k, lambda) = (vespo_k_pos,
    vespo_lambda_pos) where A >= 0, else the _neg pair (TRL's defaults 2 / 3 and 3 / 2); phi(1) = 1, so on-policy
    VESPO is the token-mean policy gradient. phi is detached: a token's gradient is phi A grad log pi, and the loss
    value is the surrogate -phi A log pi (it depends on log pi, as CISPO's). Rollout correction as TRL applies it:
    token weights [B, T] enter w (log w_i += sum_t log rho_it, each bounded below by log 1e-8); a weight per
    response [B] (sequence-level IS, the sequence masks) multiplies its terms. Aggregation "token-mean", as TRL's;
    KL / entropy alike. Metrics: clip_frac_low / _high count the tokens whose weight phi fell below
    SAPO_GATED_WEIGHT with w < 1 / w > 1 (the share of the policy gradient the weight mostly cut, as SAPO's gate
    reports); vespo/phi_mean, _min, _max over tokens; seq_weight/log_mean, the mean of log w_i.
    """
    adv = b.token_adv()  # [B, 1] or [B, T]
    bound = s.log_ratio_bound
    log_w = b.log_ratio.detach().clamp(-bound, bound).sum(dim=-1)  # [B]; off-mask log-ratios are 0
    seq_w = None
    if is_weights is not None:
        w = b.weights(is_weights)
        if w.dim() == 2:  # TRL: the token IS ratios join the sequence's ratio, in log space
            log_w = log_w + torch.where(b.mask, torch.log(w).clamp(VESPO_LOG_W_FLOOR, bound), 0.0).sum(dim=-1)
        else:
            seq_w = w
    log_w = log_w.clamp(VESPO_LOG_W_FLOOR, bound)[:, None]  # [B, 1]
    nonneg = adv >= 0
    k = torch.where(nonneg, adv.new_tensor(s.k_pos), adv.new_tensor(s.k_neg))
    lam = torch.where(nonneg, adv.new_tensor(s.lambda_pos), adv.new_tensor(s.lambda_neg))
    phi = torch.exp(lam + k * log_w - lam * log_w.exp()).nan_to_num(nan=0.0, posinf=0.0, neginf=0.0)
    lp = torch.where(b.mask, b.logp, 0.0)  # masked positions may hold anything
    obj = phi * adv * lp  # [B, T]
    if seq_w is not None:
        obj = obj * seq_w[:, None]
    m = b.mask
    phi_t, w_t = phi.expand_as(m), log_w.expand_as(m)
    cut = phi_t < SAPO_GATED_WEIGHT
    return PolicyTerms(-obj, per_token=True, metrics={
        **_token_fracs(cut & (w_t < 0), cut & (w_t > 0), m),
        "vespo/phi_mean": Metric.mean(phi_t, m),
        "vespo/phi_min": Metric.min(phi_t, m),
        "vespo/phi_max": Metric.max(phi_t, m),
        "seq_weight/log_mean": Metric.mean(log_w[:, 0], b.active),
        **_token_ratio_metrics(b.log_ratio.detach().clamp(-bound, bound).exp(), b),
    })


# DPPO's binary KL: 1 - p is bounded below by this before its log (SkyRL's and the paper code's epsilon): a token
# the policy makes certain (p = 1) has a finite divergence
DPPO_KL_EPS = 1e-8


def _dppo(b: LossBatch, s: SimpleNamespace, is_weights: Optional[Tensor], divergence: str) -> PolicyTerms:
    """DPPO's objective with the trust region measured by ``divergence`` ("tv" or "kl"): dppo_tv_loss's doc."""
    adv = b.token_adv()  # [B, 1] or [B, T]
    low, high = s.clip_ratio_low, s.clip_ratio_high
    ratio = b.token_ratio(s.log_ratio_bound)  # [B, T]; 1 off-mask
    m = b.mask
    # the token's log-probability under the current and the old policy (0 off the mask), at most 0: a probability
    logp = torch.where(m, b.logp.detach(), 0.0).clamp(max=0.0)
    log_mu = torch.where(m, b.logp.detach() - b.log_ratio.detach(), 0.0).clamp(max=0.0)
    p, mu = logp.exp(), log_mu.exp()
    if divergence == "tv":
        div = p - mu
        up, down = div > high, -div > low
    else:  # the binary KL of (mu, p): KL(Bernoulli(mu) || Bernoulli(p))
        div = mu * (log_mu - logp) + (1 - mu) * torch.log((1 - mu + DPPO_KL_EPS) / (1 - p + DPPO_KL_EPS))
        up, down = (p > mu) & (div > high), (p < mu) & (div > low)
    masked_high, masked_low = (adv > 0) & up, (adv < 0) & down  # the move the advantage asks for, too far
    keep = ~(masked_high | masked_low)
    obj = torch.where(keep, ratio * adv, 0.0)
    w = b.token_weights(is_weights)
    if w is not None:
        obj = obj * w
    terms = -obj
    if s.kl_tau > 0:  # Kimi-K2.5's squared log-ratio (prime-rl's default loss), on every token, masked or not
        terms = terms + s.kl_tau * b.log_ratio.clamp(-s.log_ratio_bound, s.log_ratio_bound) ** 2
    r_val = ratio.detach()
    return PolicyTerms(terms, per_token=True, metrics={
        "clip_frac_low": Metric.mean(masked_low.expand_as(m).to(torch.float64), m),
        "clip_frac_high": Metric.mean(masked_high.expand_as(m).to(torch.float64), m),
        "ratio_out_low_frac": Metric.mean(down.to(torch.float64), m),
        "ratio_out_high_frac": Metric.mean(up.to(torch.float64), m),
        f"dppo/{divergence}_mean": Metric.mean(div.abs() if divergence == "tv" else div, m),
        f"dppo/{divergence}_max": Metric.max(div.abs() if divergence == "tv" else div, m),
        **_token_ratio_metrics(r_val, b),
    })


@register_policy_loss("dppo_tv", LOSS_SPECS["dppo_tv"])
def dppo_tv_loss(b: LossBatch, s: SimpleNamespace, is_weights: Optional[Tensor]) -> PolicyTerms:
    """DPPO-Binary-TV: the policy gradient with a trust region on the change of each sampled token's probability.

    Implements DPPO of arXiv 2602.04879 eq. 13: sum_it M_it r_it A_it / (tokens), M_it = 0 where A_it > 0 and p_it - p_old,it > delta_high or A_it < 0 and p_old,it - p_it > delta_low, else 1.

    logp, old_logp, mask (, ref_logp, entropy): [B, T]; advantages: [B] (broadcast) or [B, T]. p = exp(logp) and
    p_old = exp(old_logp) (the sampled token's probability: the binary total variation of the token's
    distribution, |p - p_old|); r = exp(clamp(logp - old_logp, +-log_ratio_bound)) keeps its whole gradient where
    M = 1 (no ratio clip), none where M = 0 (M is detached). delta_low / delta_high: loss.clip_ratio_low / _high
    (default 0.2 / 0.2, the paper's, SkyRL's and prime-rl's dppo_mask_low / _high). A token moved too far in the
    direction its advantage pushes is masked; one moved the other way keeps its gradient (PPO's asymmetry).
    dppo_kl_tau > 0 adds tau (log r)^2 on every response token (prime-rl's default loss: tau = 1e-3). Aggregated by
    loss_agg_mode ("token-mean", the paper's, by default); rollout-correction weights multiply the policy term.
    Metrics: clip_frac_low / _high count the masked tokens with A < 0 / A > 0 (prime-rl's is_masked_low /
    _high); ratio_out_low_frac / _high_frac the tokens past delta whatever their advantage; dppo/tv_mean, _max.
    """
    return _dppo(b, s, is_weights, "tv")


@register_policy_loss("dppo_kl", LOSS_SPECS["dppo_kl"])
def dppo_kl_loss(b: LossBatch, s: SimpleNamespace, is_weights: Optional[Tensor]) -> PolicyTerms:
    """DPPO-Binary-KL: dppo_tv_loss with the trust region measured by the binary KL of the sampled token.

    Implements DPPO of arXiv 2602.04879 eq. 14: as eq. 13 with M_it = 0 where A_it > 0, p_it > p_old,it and D_it > delta_high, or A_it < 0, p_it < p_old,it and D_it > delta_low; D = p_old log(p_old / p) + (1 - p_old) log((1 - p_old) / (1 - p)).

    Shapes, ratio, rollout correction, aggregation, dppo_kl_tau and metrics as dppo_tv_loss (dppo/kl_mean, _max);
    delta default 0.05 / 0.05 (the paper's and SkyRL's for the KL variant). 1 - p and 1 - p_old carry
    DPPO_KL_EPS (SkyRL's), so a token made certain has a finite divergence.
    """
    return _dppo(b, s, is_weights, "kl")


# ----------------------------------------------------------------------------------------------
# Dispatch from the config
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ResolvedLoss:
    """A job's loss: its settings resolved and checked once (resolve_loss; algorithms/objective.py does it when
    the job's objective is built) and its function, called on every micro-batch without checking them again."""

    settings: LossSettings
    evaluate: Callable = field(repr=False)  # the loss function's evaluate (policy_loss)

    def __call__(self, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor, *,
                 ref_logp: Optional[Tensor] = None, entropy: Optional[Tensor] = None,
                 global_batch_normalizer: Normalizer = None, is_weights: Optional[Tensor] = None
                 ) -> tuple[Tensor, Metrics]:
        """(loss, metrics) of one batch: the loss function's, with the resolved settings (the module doc's shapes)."""
        return self.evaluate(f"loss.name={self.settings.name!r}", self.settings.values, self.settings.mode, logp,
                             old_logp, advantages, mask, ref_logp, entropy, global_batch_normalizer, is_weights)

    def units(self, mask: Tensor) -> Tensor:
        """The local unit count the loss divides by (mask [B, T]): response tokens for a "token-mean" loss,
        sequences with >= 1 response token otherwise. Sum it over micro-batches and all-reduce it over the DP
        group to get ``global_batch_normalizer``. A float32 scalar on mask's device."""
        m = mask if mask.dtype == torch.bool else mask != 0
        if self.settings.unit == "token":
            return m.sum().to(torch.float32)
        return (m.sum(dim=-1) > 0).sum().to(torch.float32)


def resolve_loss(cfg: LossConfig, numerics: Numerics = FP32_INPUTS) -> ResolvedLoss:
    """A loss section checked by key against its loss's spec (config/losses.py: a key the loss does not read is
    refused, not dropped; the bounds in ``numerics``, the loss inputs' format: fp32 in the trainer) and resolved
    into the frozen settings its function reads."""
    settings = loss_settings(cfg, numerics)
    evaluate = getattr(get_policy_loss(cfg.name), "evaluate", None)
    if evaluate is None:
        raise ConfigError(f"loss.name={cfg.name!r} is registered without a spec (register_policy_loss(name, "
                          "LossSpec(...))): its settings cannot be checked")
    return ResolvedLoss(settings, evaluate)


def batch_normalizer(cfg: LossConfig, mask: Tensor) -> Tensor:
    """ResolvedLoss.units of ``cfg``'s loss (the config resolved on the call)."""
    return resolve_loss(cfg).units(mask)


def compute_policy_loss(
    cfg: LossConfig, logp: Tensor, old_logp: Tensor, advantages: Tensor, mask: Tensor,
    ref_logp: Optional[Tensor] = None, entropy: Optional[Tensor] = None,
    global_batch_normalizer: Normalizer = None, is_weights: Optional[Tensor] = None,
) -> tuple[Tensor, Metrics]:
    """The loss named by ``cfg.name`` with the config's settings, resolved and checked on this call in the precision
    of the inputs (is_weights: the rollout-correction weights, rollout_correction.correction_weights). One call's
    convenience: a job resolves its loss once (resolve_loss, algorithms/objective.py)."""
    loss = resolve_loss(cfg, _numerics(torch.promote_types(logp.dtype, torch.float32)))
    return loss(logp, old_logp, advantages, mask, ref_logp=ref_logp, entropy=entropy,
                global_batch_normalizer=global_batch_normalizer, is_weights=is_weights)
