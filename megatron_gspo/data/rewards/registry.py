"""The reward registry: ``reward.name`` -> a :class:`RewardSpec`, built-ins by name, plug-ins by import path.

A reward has one of three shapes (``RewardSpec.kind``):

* ``"sample"``: ``fn(prompt, response, answer, **settings) -> float``, one sample at a time (the
  simple case; every built-in but ``math``). The trainer scores a batch with it in this process, or
  in ``reward.num_workers`` worker processes when the reward allows (``parallel=True``, the default).
* ``"batch"``: ``fn(batch: RewardBatch, **settings) -> rewards`` (one per row, in row order), declared
  with ``@reward_function(batch=True)``: for a reward that is cheaper per batch (a remote service, a
  model).
* ``"class"``: a class built once with its settings (and ``num_workers=reward.num_workers`` if its
  constructor takes that name) whose ``score(batch) -> rewards`` scores each batch and whose
  ``close()`` (optional) frees what it holds: a reward model, a pool of verifiers (``math``).

``register_reward("name", ...)`` adds a reward under a name (verl's ``register``); ``reward.name`` may
also be ``package.module:function`` or ``path/to/file.py:function`` (a function or a class), whose
declaration (``@reward_function(...)``) or signature says its shape and settings (settings.py).
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from typing import Any, Callable, Optional

from megatron_gspo.errors import ConfigError, a_or_an
from megatron_gspo.plugins import load_plugin_module

KINDS = ("sample", "batch", "class")
# The modules of the built-in rewards: each registers its reward when imported (on the first lookup).
BUILTIN_MODULES = ("exact", "digits", "math", "format", "reasoning_gym")
_DECLARATION = "__reward_declaration__"


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """What the trainer needs to know of a reward: ``target`` (the function or class), ``name`` (how
    messages name it), ``kind`` (module doc), ``settings`` (its settings dataclass, or None: read from
    the signature), ``any_settings`` (takes any key), ``parallel`` (a per-sample reward that worker
    processes may score), ``reference_check`` (``problem(answer) -> why it cannot be read, or None``:
    references checked before training)."""

    target: Any
    name: str
    kind: str
    settings: Optional[type] = None
    any_settings: bool = False
    parallel: bool = True
    reference_check: Optional[Callable[[Any], Optional[str]]] = None


_REGISTRY: dict[str, RewardSpec] = {}


def reward_function(*, settings: Optional[type] = None, batch: bool = False, any_settings: bool = False,
                    parallel: bool = True, reference_check: Optional[Callable] = None) -> Callable:
    """Decorator: declare a reward's shape and settings (for a plug-in named by import path; built-ins use
    :func:`register_reward`, which declares and names). ``settings``: a dataclass of ``setting(...)``
    fields; ``batch``: a function of a RewardBatch; ``any_settings``: reward.kwargs passed unchecked;
    ``parallel=False``: a per-sample reward to score in this process only (cheap, or not importable
    in a fresh process)."""
    if settings is not None and not dataclasses.is_dataclass(settings):
        raise TypeError(f"reward_function(settings=...) takes a dataclass, got {settings!r}")

    def wrap(target: Any) -> Any:
        setattr(target, _DECLARATION, dict(settings=settings, batch=batch, any_settings=any_settings,
                                           parallel=parallel, reference_check=reference_check))
        return target

    return wrap


def spec_of(target: Any, name: str) -> RewardSpec:
    """The RewardSpec of a function or class: its declaration if it has one, else a per-sample function
    (or a class) whose settings its signature names."""
    decl = dict(getattr(target, _DECLARATION, None) or {})
    batch = decl.pop("batch", False)
    kind = "class" if inspect.isclass(target) else "batch" if batch else "sample"
    return RewardSpec(target=target, name=name, kind=kind, **decl)


def register_reward(name: str, **declaration: Any) -> Callable:
    """Decorator: make a reward available as ``reward.name=<name>``; ``declaration``: as reward_function."""

    def wrap(target: Any) -> Any:
        reward_function(**declaration)(target)
        if name in _REGISTRY and _REGISTRY[name].target is not target:
            raise ValueError(f"reward {name!r} is already registered (by {_REGISTRY[name].target.__module__})")
        _REGISTRY[name] = spec_of(target, name)
        return target

    return wrap


def _load_builtins() -> None:
    for module in BUILTIN_MODULES:
        importlib.import_module(f"{__package__}.{module}")


def registered_rewards() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def registered_spec(name: str) -> Optional[RewardSpec]:
    """The registered reward ``name``, or None (a plug-in path is not imported here)."""
    _load_builtins()
    return _REGISTRY.get(name)


def resolve_reward(name_or_path: str) -> RewardSpec:
    """A registered reward by name, or ``module.path:function`` / ``file.py:function`` (a function or a
    class). A name that resolves to nothing is a configuration mistake: ConfigError (one line, exit 2)."""
    spec = registered_spec(name_or_path)
    if spec is not None:
        return spec
    where = f"reward {name_or_path!r} (reward.name)"
    if ":" not in name_or_path:
        raise ConfigError(f"unknown reward {name_or_path!r} (reward.name); registered: {registered_rewards()}, "
                          "or give your own as 'package.module:function'")
    module_name, _, fn_name = name_or_path.rpartition(":")
    if not module_name or not fn_name:
        missing = "the function after ':'" if module_name else "the module before ':'"
        raise ConfigError(f"{where}: expected 'package.module:function' (or 'path/to/file.py:function'); "
                          f"{missing} is missing")
    module = load_plugin_module(module_name, where)
    target = getattr(module, fn_name, None)
    if target is None:
        raise ConfigError(f"{where}: module {module_name!r} has no attribute {fn_name!r}")
    if not callable(target):
        raise ConfigError(f"{where}: {module_name}.{fn_name} is {a_or_an(type(target).__name__)}, not a function")
    spec = spec_of(target, name_or_path)
    if spec.kind == "class" and not callable(getattr(target, "score", None)):
        raise ConfigError(f"{where}: class {fn_name} has no score(batch) method (a reward class scores a batch)")
    return spec


def check_signature(spec: RewardSpec, settings: dict) -> None:
    """Refuse a reward that cannot take what the trainer passes: a per-sample function prompt, response and
    answer, a batch function the batch, each with its ``settings``."""
    if spec.kind == "class":
        return
    try:
        sig = inspect.signature(spec.target)
    except (TypeError, ValueError):
        return  # a callable without a readable signature: its first call says
    args = (None,) * (3 if spec.kind == "sample" else 1)
    try:
        sig.bind(*args, **settings)
    except TypeError as e:
        takes = "(prompt, response, answer, ...)" if spec.kind == "sample" else "(batch, ...)"
        raise ConfigError(f"reward {spec.name!r} (reward.name): a {spec.kind} reward is called as "
                          f"fn{takes}, but its signature is {getattr(spec.target, '__name__', 'fn')}{sig}: {e}") from None
