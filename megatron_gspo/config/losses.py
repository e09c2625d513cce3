"""The losses a job can name, and its loss section read through its loss's spec, once.

``loss.name`` names a built-in loss (its spec below: ``LOSS_SPECS``, in order; its formula is algorithms/losses.py's
function registered under the same name), one registered in code (``losses.register_policy_loss(name, LossSpec)``
adds its spec here) or a plug-in, ``package.module:function`` or ``path/to/file.py:function``: a function made with
``@losses.policy_loss(LossSpec(...))`` in a module of the user's, loaded once per process (``plugin``).

What reads a loss section through its spec:

    the job's rules   config/rules.py: every loss.* key against the spec, by key, when the job is loaded, then the
                      bounds in the training precision, and routing replay against the ratio kind
    the objective     ``loss_settings``: the section resolved once per job (algorithms/objective.py) into frozen
                      values the loss reads on every micro-batch, unchecked there
    the logs          describe_loss; clip_range, the clip range a LossConfig resolves to
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Callable, Mapping, Optional

from megatron_gspo.config.checks import check, finite
from megatron_gspo.config.loss_spec import (
    CONFIGURABLE,
    KL_DIVERGENCE,
    LOG_RATIO,
    SEQUENCE,
    TOKEN,
    TV_DIVERGENCE,
    VALUE_ROUNDING,
    WEIGHT,
    LossSpec,
    Numerics,
    Setting,
    Values,
    _nonnegative_coef,
    _ratio_cap,
)
from megatron_gspo.errors import ConfigError

# ----------------------------------------------------------------------------------------------
# The built-in losses' specs (their formulas: algorithms/losses.py, registered under these names)
# ----------------------------------------------------------------------------------------------


def _check_dual_clip(v, values, numerics, label, where):
    check(v is None or finite(v) and v > 1, f"{label} must be a finite number > 1 or null, got {v}")


def _check_gate_temperature(v, values, numerics, label, where):
    """SAPO's tau: finite and > 0; in the loss's own arithmetic (numerics.loss, fp32 in every precision) at most
    the square root of its range (tau (r - 1) and 4 / tau stay inside it), and at least where the value's
    constant part, 2 A / tau, carries at most VALUE_ROUNDING of a unit advantage in rounding."""
    check(finite(v) and v > 0, f"{label} must be a finite number > 0, got {v}")
    if numerics is None:
        return
    top, floor = numerics.loss_largest ** 0.5, 2 * numerics.loss_roundoff / VALUE_ROUNDING
    check(v <= top, f"{label}={v!r} exceeds {top:.3g}, the largest SAPO's gate takes in {numerics.loss} (the loss's "
                    f"arithmetic): tau (r - 1) and 4 / tau must stay inside {numerics.loss}, or every update is "
                    "non-finite")
    check(v >= floor, f"{label}={v!r} is below {floor:.3g}, the smallest SAPO's loss resolves in {numerics.loss}: its "
                      f"value holds 2 A / tau, whose rounding (2 / tau x {numerics.loss_roundoff:.2g} per unit "
                      "advantage) then outweighs the policy term; at a tau this small the gate is open everywhere "
                      "(the unclipped policy gradient: loss.name=grpo with a wide clip range gives it)")


# VESPO's log sequence weight is bounded below here before phi (TRL's and the paper code's log(1e-8)): a response
# whose ratio underflowed keeps a finite, negligible weight instead of log 0
VESPO_LOG_W_FLOOR = math.log(1e-8)


def _check_vespo_power(v, values, numerics, label, where):
    check(finite(v) and v >= 0, f"{label} must be a finite number >= 0, got {v}")


def _vespo_peak(k: float, lam: float, bound: float) -> float:
    """The largest log phi(w) = lambda + k log w - lambda w over the weights VESPO can see, log w in
    [VESPO_LOG_W_FLOOR, bound]: at w = k / lambda (phi's maximum) where that is inside, else at an end."""
    lo, hi = VESPO_LOG_W_FLOOR, bound
    log_w = min(max(math.log(k / lam), lo), hi) if k > 0 else lo
    return lam + k * log_w - lam * math.exp(log_w)


def _vespo_decay(sign: str) -> Callable:
    def check_decay(v, values, numerics, label, where):
        """VESPO's lambda: finite and > 0; in the training precision, phi's peak (a response's gradient weight)
        within the largest weight its square holds."""
        check(finite(v) and v > 0, f"{label} must be a finite number > 0, got {v}")
        k = values[f"k_{sign}"]
        if numerics is None or not (finite(k) and k >= 0):
            return
        peak = _vespo_peak(k, v, values["log_ratio_bound"])
        limit = math.log(numerics.weight_limit)
        check(peak <= limit, f"{label}={v!r} with {where}vespo_k_{sign}={k!r} gives a sequence weight phi up to "
                             f"e^{peak:.4g}, above e^{limit:.4g}, the largest {numerics.name} takes: phi scales a "
                             "response's gradient, which Adam and the gradient norm square; raise lambda or lower k")
    return check_decay


def _named(**specs: LossSpec) -> dict[str, LossSpec]:
    return {name: dataclasses.replace(spec, name=name) for name, spec in specs.items()}


# name -> spec, in registration order (these, then any registered in code); the papers' defaults: GSPO §5.1,
# DAPO's clip-higher for GRPO (0.2 / 0.28 on request), CISPO without a lower bound and ScaleRL's cap of 5,
# GMPO's symmetric log-ratio range (§4), LUSPO §5.1, SAPO's temperatures 1.0 / 1.05, VESPO's k / lambda 2 / 3 for
# A >= 0 and 3 / 2 for A < 0 (TRL 1.16's), DPPO's delta 0.2 / 0.2 for binary TV and 0.05 / 0.05 for binary KL (its
# paper's, as SkyRL's and prime-rl's). VESPO's ratio is a product over the response's tokens (routing noise adds
# up, it does not average out): a per-token ratio for routing replay's purposes.
_DPPO_TAU = (Setting("kl_tau", "dppo_kl_tau", _nonnegative_coef(_ratio_cap)),)
LOSS_SPECS: dict[str, LossSpec] = _named(
    gspo=LossSpec(ratio=SEQUENCE, aggregation="seq-mean-token-mean", clip=(3e-4, 4e-4)),
    gspo_token=LossSpec(ratio=SEQUENCE, aggregation="seq-mean-token-mean", clip=(3e-4, 4e-4)),
    grpo=LossSpec(ratio=TOKEN, aggregation=CONFIGURABLE, clip=(0.2, 0.2),
                  settings=(Setting("dual_clip_c", "dual_clip_c", _check_dual_clip),)),
    sapo=LossSpec(ratio=TOKEN, aggregation="seq-mean-token-mean", describe="gate tau {tau_pos:g} / {tau_neg:g}",
                  note="SAPO has no clip range, its soft gate is set by loss.sapo_tau_pos / loss.sapo_tau_neg",
                  settings=(Setting("tau_pos", "sapo_tau_pos", _check_gate_temperature),
                            Setting("tau_neg", "sapo_tau_neg", _check_gate_temperature))),
    cispo=LossSpec(ratio=TOKEN, aggregation=CONFIGURABLE, clip=(1.0, 4.0), units=WEIGHT),
    gmpo=LossSpec(ratio=TOKEN, aggregation="seq-mean-token-mean", clip=(0.4, 0.4), units=LOG_RATIO),
    luspo=LossSpec(ratio=SEQUENCE, aggregation="seq-mean-token-sum", clip=(2e-3, 2.5e-3)),
    vespo=LossSpec(ratio=TOKEN, aggregation="token-mean",
                   describe="phi k / lambda {k_pos:g} / {lambda_pos:g} (A >= 0), {k_neg:g} / {lambda_neg:g} (A < 0)",
                   note="VESPO has no clip range, its sequence weight is set by loss.vespo_k_* / loss.vespo_lambda_*",
                   settings=(Setting("k_pos", "vespo_k_pos", _check_vespo_power),
                             Setting("k_neg", "vespo_k_neg", _check_vespo_power),
                             Setting("lambda_pos", "vespo_lambda_pos", _vespo_decay("pos")),
                             Setting("lambda_neg", "vespo_lambda_neg", _vespo_decay("neg")))),
    dppo_tv=LossSpec(ratio=TOKEN, aggregation=CONFIGURABLE, clip=(0.2, 0.2), units=TV_DIVERGENCE, settings=_DPPO_TAU),
    dppo_kl=LossSpec(ratio=TOKEN, aggregation=CONFIGURABLE, clip=(0.05, 0.05), units=KL_DIVERGENCE,
                     settings=_DPPO_TAU),
)


def register_spec(name: str, spec: LossSpec) -> LossSpec:
    """Add the spec of a loss registered in code under ``name`` (the built-ins' are here already)."""
    spec = dataclasses.replace(spec, name=name)
    if LOSS_SPECS.setdefault(name, spec) != spec:
        raise ValueError(f"policy loss {name!r} is registered twice, with two specs")
    return LOSS_SPECS[name]


# ----------------------------------------------------------------------------------------------
# Plug-ins: package.module:function / file.py:function
# ----------------------------------------------------------------------------------------------

_PLUGINS: dict[str, Callable] = {}  # loss.name -> the plug-in it names, loaded once per process


def _load_plugin(name: str) -> Callable:
    where = f"loss.name={name!r}"
    module_name, _, attr = name.rpartition(":")
    if not module_name or not attr:
        raise ConfigError(f"{where}: expected 'package.module:function' or 'path/to/file.py:function'")
    from megatron_gspo.plugins import load_plugin_module  # only when a job names a plug-in: config stays a leaf

    module = load_plugin_module(module_name, where)
    fn = getattr(module, attr, None)
    if fn is None:
        raise ConfigError(f"{where}: {module_name} has no attribute {attr!r}")
    if not isinstance(getattr(fn, "spec", None), LossSpec):
        raise ConfigError(f"{where}: {module_name}:{attr} is not a policy loss: make it with "
                          "@megatron_gspo.algorithms.losses.policy_loss(LossSpec(...)) (docs/algorithms.md)")
    return fn


def plugin(name: str) -> Optional[Callable]:
    """The plug-in loss ``name`` (``module:function``) names, loaded on first use; None for a name without ':'."""
    if ":" not in name:
        return None
    if name not in _PLUGINS:
        _PLUGINS[name] = _load_plugin(name)
    return _PLUGINS[name]


def loss_spec(name: str) -> LossSpec:
    """The spec of the loss ``name`` names (ConfigError by key for a name that names none)."""
    if name in LOSS_SPECS:
        return LOSS_SPECS[name]
    fn = plugin(name)
    if fn is None:
        raise ConfigError(f"loss.name={name!r} is not one of {list(LOSS_SPECS)}; or name your own loss as "
                          "'package.module:function' or 'path/to/file.py:function'")
    return fn.spec


def losses_where(predicate: Callable[[LossSpec], bool]) -> list[str]:
    """The registered losses whose spec satisfies ``predicate`` (for messages: "applies to loss.name in [...]")."""
    return [n for n, spec in LOSS_SPECS.items() if predicate(spec)]


# ----------------------------------------------------------------------------------------------
# A LossConfig read through its loss's spec: its settings, their check, its clip range, its description
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class LossSettings:
    """A loss section resolved through its loss's spec and checked, once per job: what the loss reads on every
    micro-batch. ``values``: the loss function's keywords (clip range defaults filled in); ``mode``: its
    aggregation; ``unit``: what it divides by, "token" (response tokens, "token-mean") or "sequence"."""

    name: str  # loss.name
    spec: LossSpec
    values: Mapping[str, Any]
    mode: str
    unit: str


def config_values(cfg, spec: Optional[LossSpec] = None) -> Values:
    """The settings of ``cfg.name``'s loss from a LossConfig, as its function's keywords (the clip range resolved
    to the loss's default where null)."""
    spec = spec or loss_spec(cfg.name)
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
        check(spec.clip is not None or key not in given,
              f"loss.{key}={given.get(key)} does not apply to loss.name={name!r}" + (f": {spec.note}" if spec.note else ""))
    if spec.aggregation != CONFIGURABLE:
        check("loss_agg_mode" not in given,
              f"loss.loss_agg_mode={cfg.loss_agg_mode!r} applies to "
              f"{_who(losses_where(lambda s: s.aggregation == CONFIGURABLE))} only; {name} always aggregates as its "
              "paper does (leave loss_agg_mode at 'token-mean')")
    check(cfg.loss_agg_norm_constant is None or cfg.loss_agg_mode == "seq-mean-token-sum-norm",
          "loss.loss_agg_norm_constant is only used with loss.loss_agg_mode='seq-mean-token-sum-norm', "
          f"got loss_agg_mode={cfg.loss_agg_mode!r}")
    own = {s.key for s in spec.settings}
    owners: dict[str, list[str]] = {}  # another loss's own key -> the losses that take it
    for other, other_spec in LOSS_SPECS.items():
        for s in other_spec.settings:
            if s.key not in own:
                owners.setdefault(s.key, []).append(other)
    for key in [k for k in owners if k in given]:
        keys = [k for k in owners if owners[k] == owners[key]]
        shown = (f"loss.{key} applies" if len(keys) == 1 else
                 f"{' / '.join('loss.' + k for k in keys)} ({' / '.join(str(getattr(cfg, k)) for k in keys)}) apply")
        raise ConfigError(f"{shown} to {_who(owners[key])} only, got name={name!r}")


def loss_settings(cfg, numerics: Optional[Numerics] = None) -> LossSettings:
    """A LossConfig checked against its loss's spec, by key, and resolved: the name names a loss, every key given
    is one the loss reads, every value is within its bounds (in ``numerics``, where given: the training
    precision's for the job's rules, the loss inputs' for the objective)."""
    spec = loss_spec(cfg.name)
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
    given = {k: getattr(cfg, k) for k in defaults if k != "name" and getattr(cfg, k) != defaults[k]}
    _refuse_what_it_does_not_take(cfg, spec, given)
    values = config_values(cfg, spec)
    spec.check(values, numerics, "loss.")
    return LossSettings(cfg.name, spec, MappingProxyType(values), spec.mode(values), spec.unit(values))


def check_loss_config(cfg, numerics: Optional[Numerics] = None) -> None:
    """Refuse a LossConfig its loss cannot take (loss_settings), by key."""
    loss_settings(cfg, numerics)


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
