"""What a policy loss declares beside its function: the vocabulary of a loss's spec and the check of its settings.

A spec (``LossSpec``) says which importance ratio the loss uses (per sequence or per token: routing replay applies to
the second), its clip range's default and units, how it aggregates (fixed by its paper, or ``loss.loss_agg_mode``),
and its own settings with their bounds. The built-in losses' specs, the registry of the names a job can give and the
loss section read through its spec are config/losses.py; the formulas are algorithms/losses.py. It sits in config/
so that the job's rules check a loss section by key without importing the losses (config is below algorithms).

Bounds in the training precision. A token's gradient is at most its ratio, e^log_ratio_bound, times its advantage
(the KL term's, kl_coef times as much), divided by loss_agg_norm_constant under "seq-mean-token-sum-norm"; Adam's
second moment and the gradient norm square it, so that weight must stay below the square root of the largest
number of the training precision's format (fp32 and bf16 alike: 1.84e19). SAPO's arithmetic is the loss's own
(fp32 in every precision): its temperature must keep the gate's product chain (tau (r - 1), 4 / tau) inside
fp32, and its loss value holds 2 A / tau, whose fp32 rounding must not outweigh the policy term.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_gspo.config.checks import check as _check
from megatron_gspo.config.checks import finite as _finite
from megatron_gspo.config.sections import LOSS_AGG_MODES, LossConfig

SEQUENCE, TOKEN = "sequence", "token"  # LossSpec.ratio
CONFIGURABLE = "loss.loss_agg_mode"  # LossSpec.aggregation of a loss that aggregates as the config says
# the loss value's constant part may carry at most this share of a unit advantage in rounding (SAPO: 2 / tau)
VALUE_ROUNDING = 2.0 ** -10


# ----------------------------------------------------------------------------------------------
# Numerics: the formats a loss's settings must fit
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Numerics:
    """The formats that bound a loss's settings: the training precision's (gradients are squared there: Adam's
    second moment, the gradient norm) and the loss's own arithmetic's (at least fp32, whatever the model's)."""

    name: str  # the training precision, for messages: "fp32", "bf16", "fp32 or bf16 (model.precision=auto)"
    largest: float  # the largest finite number of the training precision's format
    loss: str  # the loss's arithmetic: "fp32" (or "float64" for float64 inputs)
    loss_largest: float
    loss_roundoff: float  # its unit roundoff

    @property
    def weight_limit(self) -> float:
        """The largest per-token gradient weight whose square stays finite in the training precision."""
        return math.sqrt(self.largest)


FORMATS = {"fp32": (3.4028234663852886e38, 2.0 ** -24), "bf16": (3.3895313892515355e38, 2.0 ** -8),
           "float64": (1.7976931348623157e308, 2.0 ** -53)}


def numerics_of(precision: str) -> Numerics:
    """The Numerics of a job's model.precision ("auto": fp32 on the CPU, bf16 on a GPU that has it; the stricter
    of the two). The loss runs in fp32 in each."""
    names = ("fp32", "bf16") if precision == "auto" else (precision,)
    largest = min(FORMATS[n][0] for n in names)
    name = "fp32 or bf16 (model.precision=auto)" if precision == "auto" else precision
    return Numerics(name, largest, "fp32", *FORMATS["fp32"])


def numerics_of_format(name: str, largest: float, roundoff: float) -> Numerics:
    """The Numerics of a loss function's inputs: their compute format is both (losses.py: torch.finfo)."""
    return Numerics(name, largest, name, largest, roundoff)


# The trainer's loss inputs (its log-probs are fp32 in every precision): what a job's loss is resolved in once
# (algorithms/objective.py), as the loss function checks its keywords in its inputs' format on a call.
FP32_INPUTS = numerics_of_format("fp32", *FORMATS["fp32"])


# ----------------------------------------------------------------------------------------------
# Settings and clip units
# ----------------------------------------------------------------------------------------------

Values = dict  # the resolved settings of one call: {function keyword: value}


@dataclass(frozen=True)
class Setting:
    """One setting of a loss: the function's keyword ``arg``, read from ``loss.<key>`` of the config, and the
    check of its value, ``check(value, values, numerics, label, where)``: ``values`` the call's other settings,
    ``numerics`` None for the precision-free part, ``label`` its name in messages (``loss.<key>`` or ``arg``),
    ``where`` the prefix of the others' (``"loss."`` or ``""``)."""

    arg: str
    key: str
    check: Callable[[Any, Values, Optional[Numerics], str, str], None]


def _nonnegative_coef(weight: Callable[[Values], float]) -> Callable:
    def check(v, values, numerics, label, where):
        _check(_finite(v) and v >= 0, f"{label} must be a finite number >= 0, got {v!r}")
        if numerics is not None and v > 0:
            limit = numerics.weight_limit / weight(values)
            _check(v <= limit, f"{label}={v!r} exceeds {limit:.3g}, the largest {numerics.name} takes: it scales a "
                               "token's gradient, which Adam and the gradient norm square (overflow above "
                               f"{numerics.largest:.3g})")
    return check


def _agg_scale(values: Values) -> float:
    """1 / loss_agg_norm_constant where "seq-mean-token-sum-norm" divides by a constant below 1, else 1."""
    c = values.get("loss_agg_norm_constant") if values.get("loss_agg_mode") == "seq-mean-token-sum-norm" else None
    return 1.0 / c if c is not None and c < 1 else 1.0


def _ratio_cap(values: Values) -> float:
    """A token's largest ratio weight: e^log_ratio_bound, times the aggregation's scale."""
    return math.exp(values["log_ratio_bound"]) * _agg_scale(values)


def _check_log_ratio_bound(v, values, numerics, label, where):
    _check(_finite(v) and v > 0, f"{label} must be a finite number > 0, got {v!r}")
    if numerics is not None:
        limit = math.log(numerics.weight_limit)
        _check(v <= limit, f"{label}={v!r} exceeds {limit:.4g}, the largest {numerics.name} takes: a token's ratio, "
                           "up to e^log_ratio_bound, scales its gradient, which Adam and the gradient norm square "
                           f"(overflow above {numerics.largest:.3g})")


def _check_norm_constant(v, values, numerics, label, where):
    if values.get("loss_agg_mode") != "seq-mean-token-sum-norm":
        return  # (the config refuses a constant without its mode: check_loss_config)
    _check(v is not None and _finite(v) and v > 0,
           f"{label} must be a number > 0 (the maximum response length) with {where}loss_agg_mode="
           f"'seq-mean-token-sum-norm', got {v}")
    if numerics is None:
        return
    ratio = math.exp(values["log_ratio_bound"])
    floor = ratio / numerics.weight_limit
    _check(v >= floor, f"{label}={v!r} is below {floor:.3g}, the smallest the training precision {numerics.name} "
                       f"takes: a token's gradient is its ratio (up to e^{where}log_ratio_bound = {ratio:.3g}) times "
                       f"its advantage / {label}, and Adam and the gradient norm square it (overflow above "
                       f"{numerics.largest:.3g}); use the maximum response length (e.g. generation.max_new_tokens)")
    _check(v <= numerics.largest, f"{label}={v!r} is not finite in {numerics.name}")


# The settings every loss takes (the plumbing reads them: the ratio bound, the KL and entropy terms); the
# coefficients are checked after the aggregation's constant, which scales their terms too.
BOUND = (Setting("log_ratio_bound", "log_ratio_bound", _check_log_ratio_bound),)
COEFFICIENTS = (
    Setting("kl_coef", "kl_coef", _nonnegative_coef(_ratio_cap)),
    Setting("entropy_coef", "entropy_coef", _nonnegative_coef(_agg_scale)),
)
AGGREGATION = (
    Setting("loss_agg_mode", "loss_agg_mode", lambda v, values, numerics, label, where: _check(
        v in LOSS_AGG_MODES, f"{label}={v!r} is not one of {list(LOSS_AGG_MODES)}")),
    Setting("loss_agg_norm_constant", "loss_agg_norm_constant", _check_norm_constant),
)


@dataclass(frozen=True)
class ClipUnits:
    """What loss.clip_ratio_low / clip_ratio_high mean to a loss, and the check of a range in those units
    (``check(name, low, high, bound, where)``, where = "loss." or ""); ``suffix`` for LossConfig.describe."""

    name: str
    suffix: str
    check: Callable[[str, float, float, float, str], None]


def _need_bound(bound: float, need: float, where: str, low: float, high: float) -> None:
    # A bound inside the clip range would cut gradients that clipping means to keep.
    _check(bound > need, f"{where}log_ratio_bound={bound} must exceed the clip range's log-width {need:.4g} "
                         f"(clip_ratio_low={low}, clip_ratio_high={high})")


def _ratio_range(name: str, low: float, high: float, bound: float, where: str) -> None:
    _check(_finite(low) and 0 < low < 1, f"{where}clip_ratio_low must be in (0, 1), got {low}")
    _check(_finite(high) and high > 0, f"{where}clip_ratio_high must be a finite number > 0, got {high}")
    _need_bound(bound, max(math.log1p(high), -math.log1p(-low)), where, low, high)


def _weight_range(name: str, low: float, high: float, bound: float, where: str) -> None:
    _check(_finite(low) and 0 < low <= 1,
           f"{where}clip_ratio_low must be in (0, 1] ({name}: 1 = no lower bound on the weight), got {low}")
    _check(_finite(high) and high > 0, f"{where}clip_ratio_high must be a finite number > 0, got {high}")
    _need_bound(bound, max(math.log1p(high), -math.log1p(-low) if low < 1 else 0.0), where, low, high)


def _log_ratio_range(name: str, low: float, high: float, bound: float, where: str) -> None:
    for key, v in (("clip_ratio_low", low), ("clip_ratio_high", high)):
        _check(_finite(v) and v > 0, f"{where}{key} must be a finite number > 0 ({name}: a log-ratio width), got {v}")
    _check(bound > max(low, high), f"{where}log_ratio_bound={bound} must exceed {name}'s log-ratio clip range "
                                   f"(clip_ratio_low={low}, clip_ratio_high={high})")


def _probability_range(name: str, low: float, high: float, bound: float, where: str) -> None:
    # a probability moves by at most 1: a threshold of 1 or more masks nothing (DPPO without its trust region)
    for key, v in (("clip_ratio_low", low), ("clip_ratio_high", high)):
        _check(_finite(v) and 0 < v < 1,
               f"{where}{key} must be in (0, 1) ({name}: the largest change of a token's probability), got {v}")


def _divergence_range(name: str, low: float, high: float, bound: float, where: str) -> None:
    for key, v in (("clip_ratio_low", low), ("clip_ratio_high", high)):
        _check(_finite(v) and v > 0, f"{where}{key} must be a finite number > 0 ({name}: a divergence threshold), "
                                     f"got {v}")


# the ratio range [1 - low, 1 + high]; an importance weight's truncation [1 - low, 1 + high] (low = 1: none below);
# a range of each token's log-ratio, [-low, high]; DPPO's trust region on the token's probability, p - p_old in
# [-low, high] (binary total variation), or on the binary KL of (p_old, p) (at most low / high as p falls / rises)
RATIO = ClipUnits("ratio", "", _ratio_range)
WEIGHT = ClipUnits("weight truncation", " (weight truncation)", _weight_range)
LOG_RATIO = ClipUnits("log-ratio", " (log-ratio)", _log_ratio_range)
TV_DIVERGENCE = ClipUnits("binary-TV", " (probability change)", _probability_range)
KL_DIVERGENCE = ClipUnits("binary-KL", " (binary KL)", _divergence_range)


def _no_check(v, values, numerics, label, where):
    """(the clip range is checked as a pair, in the loss's units: ClipUnits.check)"""


CLIP = (Setting("clip_ratio_low", "clip_ratio_low", _no_check), Setting("clip_ratio_high", "clip_ratio_high", _no_check))


# ----------------------------------------------------------------------------------------------
# The spec
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossSpec:
    """What a loss declares beside its function.

    ratio: SEQUENCE (GSPO's s_i: routing noise averages out, no routing replay) or TOKEN (a ratio per token:
        train.routing_replay applies);
    aggregation: how per-token terms become the loss, fixed by the paper ("seq-mean-token-mean", the KL and
        entropy terms alike; "seq-mean-token-sum": sums per sequence, e.g. LUSPO's length-weighted terms) or
        CONFIGURABLE: loss.loss_agg_mode / loss.loss_agg_norm_constant (default "token-mean");
    clip: the default (clip_ratio_low, clip_ratio_high), in ``units``; None: the loss has no clip range;
    settings: its own settings beyond the shared ones (log_ratio_bound, kl_coef, entropy_coef) and the clip range;
    note: what to say when a setting it does not take is given; describe: a format of its settings for the logs
        (describe_loss; a loss with a clip range says it: "clip 0.0003 / 0.0004"); name: set when it is
        registered."""

    ratio: str
    aggregation: str
    clip: Optional[tuple[float, float]] = None
    units: ClipUnits = RATIO
    settings: tuple[Setting, ...] = ()
    note: str = ""
    describe: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        if self.ratio not in (SEQUENCE, TOKEN):
            raise ValueError(f"LossSpec.ratio must be {SEQUENCE!r} or {TOKEN!r}, got {self.ratio!r}")
        if self.aggregation not in (*LOSS_AGG_MODES, "seq-mean-token-sum", CONFIGURABLE):
            raise ValueError(f"LossSpec.aggregation={self.aggregation!r} is not a mode of {list(LOSS_AGG_MODES)}, "
                             "'seq-mean-token-sum' or CONFIGURABLE")
        fields = {f.name for f in dataclasses.fields(LossConfig)}
        for s in self.settings:
            if s.key not in fields:
                raise ValueError(f"LossSpec setting {s.arg!r} reads loss.{s.key}, which the loss section does not have")

    @property
    def all_settings(self) -> tuple[Setting, ...]:
        """Every keyword the loss function takes, in the order they are checked."""
        return (BOUND + (CLIP if self.clip is not None else ())
                + (AGGREGATION if self.aggregation == CONFIGURABLE else ()) + COEFFICIENTS + self.settings)

    def mode(self, values: Values) -> str:
        """The aggregation of a call with ``values`` (its loss_agg_mode where the loss takes one)."""
        return values["loss_agg_mode"] if self.aggregation == CONFIGURABLE else self.aggregation

    def unit(self, values: Values) -> str:
        """What the loss divides by: "token" (response tokens, "token-mean") or "sequence" (non-empty responses)."""
        return "token" if self.mode(values) == "token-mean" else "sequence"

    def defaults(self) -> Values:
        """The settings of a call that gives none: the config's defaults, the clip range the spec's."""
        fields = {f.name: f.default for f in dataclasses.fields(LossConfig)}
        values = {s.arg: fields[s.key] for s in self.all_settings if s.key in fields}
        if self.clip is not None:
            values["clip_ratio_low"], values["clip_ratio_high"] = self.clip
        return values

    def check(self, values: Values, numerics: Optional[Numerics], where: str) -> None:
        """Every setting of ``values`` (function keywords), named ``where + key`` ("loss.") or by keyword ("")."""
        for s in self.all_settings:
            s.check(values[s.arg], values, numerics, f"{where}{s.key}" if where else s.arg, where)
        if self.clip is not None:
            self.units.check(self.name, values["clip_ratio_low"], values["clip_ratio_high"],
                             values["log_ratio_bound"], where)

    def describe_values(self, values: Values) -> str:
        if self.clip is not None:
            return f"clip {values['clip_ratio_low']:g} / {values['clip_ratio_high']:g}{self.units.suffix}"
        if self.describe:
            return self.describe.format(**values)
        return ", ".join(f"{s.key} {values[s.arg]}" for s in self.settings) or "no clip range"


def resolve_settings(spec: LossSpec, given: dict, numerics: Numerics, fn_name: str) -> Values:
    """A loss function's keyword arguments -> every setting, defaults filled in and checked in ``numerics``."""
    allowed = {s.arg for s in spec.all_settings}
    for key in given:
        if key not in allowed:
            raise TypeError(f"{fn_name}() got an unexpected keyword argument {key!r}")
    values = {**spec.defaults(), **given}
    spec.check(values, numerics, "")
    return values
