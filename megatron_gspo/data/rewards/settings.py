"""A reward's settings (``reward.kwargs``), declared beside the reward and checked by key at start-up.

A reward declares its settings as a dataclass whose fields carry their type, default and bounds::

    @dataclass
    class MathSettings:
        timeout_s: float = setting(10.0, gt=0)

and ``reward.kwargs`` is checked against it like every other config field (config/fields.py): an
unknown key is refused with the close matches and the known ones (``unknown config key
reward.kwargs.timeot_s; did you mean ['timeout_s']? ...``), a value of the wrong type or out of
bounds by key and bound (``reward.kwargs.timeout_s must be a finite number > 0, got -1``). The reward
is called with every declared setting, defaults filled in.

A plug-in that declares nothing is checked against its signature: the keyword parameters it names
(``def f(prompt, response, answer, *, scale=1.0)`` takes ``scale``), with their own defaults. A
``**kwargs`` in the signature does not open it to any key (a typo would vanish into it): a plug-in that
reads arbitrary settings says so, ``@reward_function(any_settings=True)``.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
from typing import Any, Optional

from megatron_gspo.config.fields import Knob, Resume, check_field, knob, knob_of, type_hints
from megatron_gspo.errors import ConfigError

# Parameters a reward's signature starts with, before its settings (by kind: registry.RewardSpec.kind).
LEADING_PARAMETERS = {"sample": 3, "batch": 1, "class": 0}
# The constructor parameter through which a class gets reward.num_workers (not a setting).
NUM_WORKERS = "num_workers"


def setting(default: Any = dataclasses.MISSING, *, default_factory: Any = dataclasses.MISSING, **bounds: Any) -> Any:
    """A field of a reward's settings dataclass: its default and bounds (``ge``, ``gt``, ``le``, ``lt``,
    ``choices``, ``finite``, ``hint``: as ``config.fields.knob``)."""
    return knob(default, resume=Resume.REFUSED, default_factory=default_factory, **bounds)


def declared_names(settings: type) -> list[str]:
    return [f.name for f in dataclasses.fields(settings)]


def signature_settings(target: Any, kind: str) -> Optional[list[str]]:
    """The settings a reward without a declaration takes: the keyword parameters of its signature past the
    leading ones (a class: its constructor's, but ``num_workers``); None when it has no readable signature."""
    try:
        params = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return None
    named = [p for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
    lead = LEADING_PARAMETERS[kind]
    return [p.name for i, p in enumerate(named) if (i >= lead or p.kind == p.KEYWORD_ONLY) and p.name != NUM_WORKERS]


def _refuse_unknown(given: dict, known: list[str], reward: str, where: str) -> None:
    for key in given:
        if key in known:
            continue
        close = difflib.get_close_matches(str(key), known, n=3)
        hint = f"; did you mean {close}?" if close else ""
        takes = f"the settings of reward {reward!r}: {known}" if known else f"reward {reward!r} takes no settings"
        raise ConfigError(f"unknown config key {where}.{key}{hint} ({takes}; a plug-in that reads any key from "
                          "**kwargs declares so: @reward_function(any_settings=True))")


def _default(f: dataclasses.Field, where: str, reward: str) -> Any:
    if f.default is not dataclasses.MISSING:
        return f.default
    if f.default_factory is not dataclasses.MISSING:
        return f.default_factory()
    raise ConfigError(f"{where}.{f.name} is required by reward {reward!r} (it has no default)")


def check_settings(spec, given: dict, where: str) -> dict:
    """The settings to call reward ``spec`` (registry.RewardSpec) with: ``given`` (``reward.kwargs``, found
    under ``where``) checked by key against what the reward declares; ConfigError naming the key."""
    given = dict(given or {})
    if spec.any_settings:
        return given
    if spec.settings is None:
        known = signature_settings(spec.target, spec.kind)
        if known is not None:
            _refuse_unknown(given, known, spec.name, where)
        return given
    fields = dataclasses.fields(spec.settings)
    _refuse_unknown(given, [f.name for f in fields], spec.name, where)
    hints = type_hints(spec.settings)
    out = {}
    for f in fields:
        value = given[f.name] if f.name in given else _default(f, where, spec.name)
        check_field(f"{where}.{f.name}", value, hints[f.name], knob_of(f) or Knob(Resume.REFUSED))
        out[f.name] = list(value) if isinstance(value, tuple) else value
    return out
