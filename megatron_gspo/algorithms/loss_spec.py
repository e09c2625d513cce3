"""What a policy loss declares beside its function, and the one check of its settings.

A loss is one spec and one function (losses.py: ``@register_policy_loss(name, LossSpec(...))``; a plug-in:
``@losses.policy_loss(LossSpec(...))`` in a module of its own, named by ``loss.name=package.module:function`` or
``path/to/file.py:function``). The spec says which importance ratio the loss uses (per sequence or per token: routing
replay applies to the second), its clip range's default and units, how it aggregates (fixed by its paper, or
``loss.loss_agg_mode``), its own settings and their bounds. Everything that depends on which loss runs reads it:

    the config     the job's rules (config/rules.py) check every loss.* key against the spec when the job is
                   loaded, by key, then the bounds that depend on the training precision (check_loss_config),
                   and routing replay against the ratio kind; the LossConfig itself is plain data
    the function   the same checks of its keyword arguments, in the precision of its inputs (resolve_settings)
    the objective  the config checked by key (losses.loss_kwargs), the unit the loss divides by (tokens or
                   sequences: LossSpec.unit), the settings it is handed
    the logs       describe_loss; clip_range, the clip range a LossConfig resolves to

Bounds in the training precision. A token's gradient is at most its ratio, e^log_ratio_bound, times its advantage
(the KL term's, kl_coef times as much), divided by loss_agg_norm_constant under "seq-mean-token-sum-norm"; Adam's
second moment and the gradient norm square it, so that weight must stay below the square root of the largest
number of the training precision's format (fp32 and bf16 alike: 1.84e19). SAPO's arithmetic is the loss's own
(fp32 in every precision): its temperature must keep the gate's product chain (tau (r - 1), 4 / tau) inside
fp32, and its loss value holds 2 A / tau, whose fp32 rounding must not outweigh the policy term.

Nothing here imports torch (the config reads it); the built-in losses register when losses.py is imported, which
``loss_function`` does on first use.
"""

from __future__ import annotations

import dataclasses
import importlib
import importlib.util
import math
import os
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_gspo.config.checks import check as _check
from megatron_gspo.config.checks import finite as _finite
from megatron_gspo.config.sections import LOSS_AGG_MODES, LossConfig
from megatron_gspo.errors import ConfigError

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


# the ratio range [1 - low, 1 + high]; an importance weight's truncation [1 - low, 1 + high] (low = 1: none below);
# a range of each token's log-ratio, [-low, high]
RATIO = ClipUnits("ratio", "", _ratio_range)
WEIGHT = ClipUnits("weight truncation", " (weight truncation)", _weight_range)
LOG_RATIO = ClipUnits("log-ratio", " (log-ratio)", _log_ratio_range)


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


# ----------------------------------------------------------------------------------------------
# The registry: built-in losses by name, plug-ins by package.module:function / file.py:function
# ----------------------------------------------------------------------------------------------

PolicyLoss = Callable[..., Any]
# name -> loss function, in registration order (losses.py's, then any registered in code)
POLICY_LOSSES: dict[str, PolicyLoss] = {}
_PLUGINS: dict[str, PolicyLoss] = {}  # loss.name -> the plug-in it names, loaded once per process


def register(name: str, fn: PolicyLoss) -> PolicyLoss:
    """Register ``fn`` under ``name`` (losses.register_policy_loss)."""
    if name in POLICY_LOSSES:
        raise ValueError(f"policy loss {name!r} is registered twice ({POLICY_LOSSES[name].__qualname__} and "
                         f"{fn.__qualname__})")
    POLICY_LOSSES[name] = fn
    return fn


def _builtins() -> dict[str, PolicyLoss]:
    importlib.import_module("megatron_gspo.algorithms.losses")  # registers the built-in losses
    return POLICY_LOSSES


def _load_plugin(name: str) -> PolicyLoss:
    where = f"loss.name={name!r}"
    module_name, _, attr = name.rpartition(":")
    if not module_name or not attr:
        raise ConfigError(f"{where}: expected 'package.module:function' or 'path/to/file.py:function'")
    try:
        if module_name.endswith(".py"):
            if not os.path.isfile(module_name):
                raise ConfigError(f"{where}: file {module_name} not found")
            spec = importlib.util.spec_from_file_location(
                "_loss_plugin_" + re.sub(r"\W", "_", os.path.abspath(module_name)), module_name)
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except ConfigError:
        raise
    except (Exception, SystemExit) as e:  # the plug-in's own code failed (an import, a syntax error, an exit)
        raise ConfigError(f"{where}: loading {module_name} failed: {type(e).__name__}: {e}") from e
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{where}: {module_name} has no attribute {attr!r}")
    if not isinstance(getattr(fn, "spec", None), LossSpec):
        raise ConfigError(f"{where}: {module_name}:{attr} is not a policy loss: make it with "
                          "@megatron_gspo.algorithms.losses.policy_loss(LossSpec(...)) (docs/algorithms.md)")
    return fn


def find_loss(name: str) -> Optional[PolicyLoss]:
    """The loss ``name`` names: a registered one, or the plug-in ``module:function`` (loaded on first use);
    None for an unknown name without ':'."""
    if name in _builtins():
        return POLICY_LOSSES[name]
    if ":" not in name:
        return None
    if name not in _PLUGINS:
        _PLUGINS[name] = _load_plugin(name)
    return _PLUGINS[name]


def get_policy_loss(name: str) -> PolicyLoss:
    """The loss registered under ``name``, or the plug-in it names."""
    fn = find_loss(name)
    if fn is None:
        raise ValueError(f"unknown policy loss {name!r}; valid names: {list(POLICY_LOSSES)}")
    return fn


def loss_spec(name: str) -> LossSpec:
    """The spec of the loss ``name`` names (ConfigError by key for a name that names none, or a loss without one)."""
    fn = find_loss(name)
    if fn is None:
        raise ConfigError(f"loss.name={name!r} is not one of {list(POLICY_LOSSES)}; or name your own loss as "
                          "'package.module:function' or 'path/to/file.py:function'")
    spec = getattr(fn, "spec", None)
    if not isinstance(spec, LossSpec):
        raise ConfigError(f"loss.name={name!r} is registered without a spec (register_policy_loss(name, LossSpec(...)))"
                          ": its settings cannot be checked")
    return spec


def losses_where(predicate: Callable[[LossSpec], bool]) -> list[str]:
    """The registered losses whose spec satisfies ``predicate`` (for messages: "applies to loss.name in [...]")."""
    return [n for n, fn in _builtins().items() if isinstance(getattr(fn, "spec", None), LossSpec)
            and predicate(fn.spec)]


# ----------------------------------------------------------------------------------------------
# A LossConfig read through its loss's spec: its settings, their check, its clip range, its description
# ----------------------------------------------------------------------------------------------


def config_values(cfg) -> Values:
    """The settings of ``cfg.name``'s loss from a LossConfig, as its function's keywords (the clip range resolved
    to the loss's default where null)."""
    spec = loss_spec(cfg.name)
    values = {s.arg: getattr(cfg, s.key) for s in spec.all_settings}
    if spec.clip is not None:
        for key, default in zip(("clip_ratio_low", "clip_ratio_high"), spec.clip):
            values[key] = default if values[key] is None else values[key]
    return values


def _who(names: list[str]) -> str:
    return f"loss.name={names[0]!r}" if len(names) == 1 else f"loss.name in {names}"


def _refuse_what_it_does_not_take(cfg, spec: LossSpec, given: dict) -> None:
    """A key given (not at its default) that the loss does not read is a mistake: refused, by kind."""
    name = cfg.name
    for key in ("clip_ratio_low", "clip_ratio_high"):
        _check(spec.clip is not None or key not in given,
               f"loss.{key}={given.get(key)} does not apply to loss.name={name!r}" + (f": {spec.note}" if spec.note else ""))
    if spec.aggregation != CONFIGURABLE:
        _check("loss_agg_mode" not in given,
               f"loss.loss_agg_mode={cfg.loss_agg_mode!r} applies to "
               f"{_who(losses_where(lambda s: s.aggregation == CONFIGURABLE))} only; {name} always aggregates as its "
               "paper does (leave loss_agg_mode at 'token-mean')")
    _check(cfg.loss_agg_norm_constant is None or cfg.loss_agg_mode == "seq-mean-token-sum-norm",
           "loss.loss_agg_norm_constant is only used with loss.loss_agg_mode='seq-mean-token-sum-norm', "
           f"got loss_agg_mode={cfg.loss_agg_mode!r}")
    own = {s.key for s in spec.settings}
    owners: dict[str, list[str]] = {}  # another loss's own key -> the losses that take it
    for other in losses_where(lambda s: True):
        for s in loss_spec(other).settings:
            if s.key not in own:
                owners.setdefault(s.key, []).append(other)
    for key in [k for k in owners if k in given]:
        keys = [k for k in owners if owners[k] == owners[key]]
        shown = (f"loss.{key} applies" if len(keys) == 1 else
                 f"{' / '.join('loss.' + k for k in keys)} ({' / '.join(str(getattr(cfg, k)) for k in keys)}) apply")
        raise ConfigError(f"{shown} to {_who(owners[key])} only, got name={name!r}")


def check_loss_config(cfg, numerics: Optional[Numerics] = None) -> None:
    """Check a LossConfig against its loss's spec, by key: the name names a loss, every key given is one the loss
    reads, every value is within its bounds (in ``numerics``, the training precision's, where given: rules.py)."""
    spec = loss_spec(cfg.name)
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    given = {k: getattr(cfg, k) for k in defaults if k != "name" and getattr(cfg, k) != defaults[k]}
    _refuse_what_it_does_not_take(cfg, spec, given)
    spec.check(config_values(cfg), numerics, "loss.")


def clip_range(cfg) -> Optional[tuple[float, float]]:
    """A LossConfig's (clip_ratio_low, clip_ratio_high), None resolved to its loss's default; None for a loss
    without a clip range (sapo)."""
    if loss_spec(cfg.name).clip is None:
        return None
    values = config_values(cfg)
    return values["clip_ratio_low"], values["clip_ratio_high"]


def describe_loss(cfg) -> str:
    """A LossConfig's settings in one phrase, for logs: "clip 0.0003 / 0.0004", "gate tau 1 / 1.05"."""
    return loss_spec(cfg.name).describe_values(config_values(cfg))
