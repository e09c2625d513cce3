"""A config field and its constraints, declared once: ``knob(default, ge=..., choices=..., resume=...)``.

Every field of every section is declared with ``knob``: its bounds, its allowed values and its resume
policy (``Resume``) sit next to it, and ``validate(section, "name")`` (one function, called first by each
section's ``__post_init__``) checks them all: the annotated type (bool is never an int; ``Optional``
allows null; ``list[int]`` / ``list[str]`` / ``dict``), then the bounds and the choices. The messages
name the key: ``train.num_steps must be an integer >= 1, got 0``, ``train.old_logprobs='x' is not one
of [...]``. A rule that spans fields stays with its section (or, across sections, in config/rules.py).

The YAML / command-line loader (config/loader.py) turns text into the annotated type before this runs;
``validate`` is what a dataclass built in code gets too.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import math
import types
import typing
from dataclasses import MISSING
from typing import Any, Optional

from megatron_gspo.errors import ConfigError


class Resume(enum.Enum):
    """What a resume does when the field differs from the checkpoint's job (checkpoint/config_change.py)."""

    # only how or how long the same run goes on (length, logging, saving, evaluation, speed, rounding)
    MAY_CHANGE = "may change"
    # the parallel layout: a checkpoint resumes under any TP / EP / DP (behaves as MAY_CHANGE)
    LAYOUT = "layout"
    # the supervised warm start's own settings: may change, except while the checkpoint is an unfinished
    # warm start (it then continues with the checkpoint's)
    MAY_CHANGE_AFTER_WARM_START = "may change after the warm start"
    # changes the training trajectory: refused unless checkpoint.allow_config_change names it
    REFUSED = "changes the trajectory"


@dataclasses.dataclass(frozen=True)
class Knob:
    """The declared constraints of one field (``dataclasses.Field.metadata["knob"]``)."""

    resume: Resume
    ge: Optional[float] = None
    gt: Optional[float] = None
    le: Optional[float] = None
    lt: Optional[float] = None
    choices: Optional[tuple] = None
    finite: bool = True
    hint: str = ""  # appended to the range in the message: "(0 = off)"


def knob(default: Any = MISSING, *, resume: Resume, ge: Optional[float] = None, gt: Optional[float] = None,
         le: Optional[float] = None, lt: Optional[float] = None, choices: Optional[tuple] = None,
         finite: bool = True, hint: str = "", default_factory: Any = MISSING) -> Any:
    """A dataclass field with its constraints and resume policy in ``metadata["knob"]``. Bounds apply to a
    number, or to every item of a list of numbers; ``choices`` to the value (None among them allows null)."""
    if not isinstance(resume, Resume):
        raise TypeError(f"knob(resume=...) takes a Resume, got {resume!r}")
    meta = {"knob": Knob(resume, ge, gt, le, lt, tuple(choices) if choices is not None else None, finite, hint)}
    if default_factory is not MISSING:
        return dataclasses.field(default_factory=default_factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def knob_of(f: dataclasses.Field) -> Optional[Knob]:
    return f.metadata.get("knob")


@functools.cache
def type_hints(cls: type) -> dict[str, Any]:
    """The resolved annotations of ``cls`` (the sections use ``from __future__ import annotations``)."""
    return typing.get_type_hints(cls)


def split_optional(tp: Any) -> tuple[Any, bool]:
    """(the base type, whether null is allowed) of a field annotation (``Optional[int]`` -> (int, True))."""
    if typing.get_origin(tp) in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return (args[0] if len(args) == 1 else Any), True
    return tp, False


def _fmt(x: float) -> str:
    return str(int(x)) if isinstance(x, float) and x.is_integer() else str(x)


def _range_phrase(k: Knob) -> str:
    """"in [0, 1)", ">= 1", "> 0", "" from the declared bounds."""
    lo = ("[", k.ge) if k.ge is not None else ("(", k.gt) if k.gt is not None else None
    hi = ("]", k.le) if k.le is not None else (")", k.lt) if k.lt is not None else None
    if lo and hi:
        return f"in {lo[0]}{_fmt(lo[1])}, {_fmt(hi[1])}{hi[0]}"
    if lo:
        return f"{'>=' if lo[0] == '[' else '>'} {_fmt(lo[1])}"
    if hi:
        return f"{'<=' if hi[0] == ']' else '<'} {_fmt(hi[1])}"
    return ""


def _expected(base: Any, k: Knob) -> str:
    """What the field must be, in words: "an integer >= 1", "a positive integer", "in (0, 1]"."""
    rng = _range_phrase(k)
    if base is int:
        if k.gt == 0 and k.le is None and k.lt is None:
            return "a positive integer"
        return f"an integer {rng}".rstrip()
    if base is float:
        if rng.startswith("in "):
            return rng
        return f"a finite number {rng}".rstrip() if k.finite else f"a number {rng}".rstrip()
    if base is bool:
        return "true or false"
    if base is str:
        return "a string"
    if typing.get_origin(base) is list:
        (item,) = typing.get_args(base) or (Any,)
        noun = {int: "integers", str: "strings", float: "numbers"}.get(item, "values")
        return f"a list of {noun} {rng}".rstrip()
    if base is dict or typing.get_origin(base) is dict:
        return "a mapping"
    return f"a {getattr(base, '__name__', base)}"


def _is_type(v: Any, base: Any) -> bool:
    if base is Any:
        return True
    if base is bool:
        return isinstance(v, bool)
    if base is int:
        return isinstance(v, int) and not isinstance(v, bool)
    if base is float:
        return isinstance(v, (int, float)) and not isinstance(v, bool)
    if base is str:
        return isinstance(v, str)
    if base is dict or typing.get_origin(base) is dict:
        return isinstance(v, dict)
    if typing.get_origin(base) in (list, tuple):
        (item, *_) = typing.get_args(base) or (Any,)
        return isinstance(v, (list, tuple)) and all(_is_type(x, item) for x in v)
    return isinstance(v, base) if isinstance(base, type) else True


def not_a_string(name: str, value: Any) -> str:
    """Why ``value`` (a mapping or list from YAML) is no string for field ``name``, and what to write instead.

    YAML reads a word that ends in a colon (``reasoning_gym:``, ``mod:``), or a colon before a space, as a
    mapping's key; the loader gets ``{'reasoning_gym': None}`` where the user meant text."""
    if isinstance(value, dict) and len(value) == 1:
        ((key, val),) = value.items()
        text = f"{key}:" if val is None else f"{key}: {val}"
        read = (f"{text} (a colon at the end) as a key with no value; write what follows the colon "
                f"({key}:<...>)" if val is None else
                f"{text!r} (a colon before a space) as a key and its value; drop the space ({key}:{val})")
        return (f"{name} must be a string, got a mapping: YAML read {read}, or quote the value to keep it as written: "
                f"{name}=\"'{text}'\" on the command line, '{text}' in a YAML file")
    return f"{name} must be a string, got {type(value).__name__}"


def _in_bounds(x: float, k: Knob) -> bool:
    if isinstance(x, float) and k.finite and not math.isfinite(x):
        return False
    return not ((k.ge is not None and not x >= k.ge) or (k.gt is not None and not x > k.gt)
                or (k.le is not None and not x <= k.le) or (k.lt is not None and not x < k.lt))


def check_field(name: str, value: Any, tp: Any, k: Knob) -> None:
    """Raise ConfigError naming ``name`` unless ``value`` is of type ``tp`` and within ``k``'s constraints."""
    base, optional = split_optional(tp)
    if value is None:
        if optional or (k.choices is not None and None in k.choices):
            return
        raise ConfigError(f"{name} may not be null")
    if k.choices is not None:
        if value not in k.choices:
            raise ConfigError(f"{name}={value!r} is not one of {list(k.choices)}")
        return
    ok = _is_type(value, base)
    if ok and base in (int, float):
        ok = _in_bounds(value, k)
    elif ok and typing.get_origin(base) in (list, tuple):
        ok = all(_in_bounds(x, k) for x in value if isinstance(x, (int, float)))
    if not ok:
        if base is str and isinstance(value, (dict, list)):  # YAML's reading of "mod:" (the loader says the same)
            raise ConfigError(not_a_string(name, value))
        hint = f" {k.hint}" if k.hint else ""
        null = " or null" if optional else ""
        raise ConfigError(f"{name} must be {_expected(base, k)}{hint}{null}, got {value!r}")


def validate(section: Any, where: str) -> None:
    """Check every declared field of the dataclass ``section`` against its annotation and its knob; a list
    field given as a tuple is stored as a list."""
    hints = type_hints(type(section))
    for f in dataclasses.fields(section):
        k = knob_of(f)
        if k is None:
            continue
        value = getattr(section, f.name)
        check_field(f"{where}.{f.name}", value, hints[f.name], k)
        if isinstance(value, tuple) and typing.get_origin(split_optional(hints[f.name])[0]) is list:
            setattr(section, f.name, list(value))


def walk_knobs(cls: type, prefix: str = "") -> list[tuple[str, Optional[Knob]]]:
    """[("section.key", its Knob or None)] of every leaf field under the dataclass ``cls`` (nested sections
    walked); the test that every field declares a resume policy reads it."""
    out: list[tuple[str, Optional[Knob]]] = []
    hints = type_hints(cls)
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        if dataclasses.is_dataclass(tp):
            out += walk_knobs(tp, f"{prefix}{f.name}.")
        else:
            out.append((f"{prefix}{f.name}", knob_of(f)))
    return out
