"""YAML files and command-line overrides -> nested dicts -> validated dataclasses.

A job is loaded from YAML and then patched with ``section.field=value`` (or ``--section.field
value``) overrides, the way torchtitan and Hydra users expect; values are parsed as YAML scalars and
coerced to each field's annotated type, and an unknown key is refused with the closest valid names.
"""

from __future__ import annotations

import dataclasses
import difflib
import io
import os
import re
import typing
from dataclasses import fields
from typing import Any, Optional

from megatron_gspo.config.fields import not_a_string, split_optional, type_hints
from megatron_gspo.config.model import MODEL_PRESETS, ModelConfig
from megatron_gspo.errors import ConfigError
from megatron_gspo.textfile import read_text


def _coerce(value: Any, tp: Any, where: str) -> Any:
    base, optional = split_optional(tp)
    if value is None or (isinstance(value, str) and value.lower() in ("none", "null") and optional):
        if optional or base is Any:
            return None
        raise ConfigError(f"{where} may not be null")
    if dataclasses.is_dataclass(base):
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {type(value).__name__}")
        return from_dict(base, value, where)
    origin = typing.get_origin(base)
    if base is Any:
        return value
    if base is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "1", "yes", "on", "false", "0", "no", "off"):
            return value.lower() in ("true", "1", "yes", "on")
        if isinstance(value, int) and value in (0, 1):
            return bool(value)
        raise ConfigError(f"{where} must be a boolean, got {value!r}")
    if base is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        if isinstance(value, int):
            return value
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be an integer, got {value!r}") from None
        if not f.is_integer():
            raise ConfigError(f"{where} must be an integer, got {value!r}")
        return int(f)
    if base is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where} must be a number, got {value!r}")
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where} must be a number, got {value!r}") from None
    if base is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare off/on as a bool
            return "off" if value is False else "on"
        if isinstance(value, (dict, list)):
            raise ConfigError(not_a_string(where, value))
        return str(value)
    if origin in (list, tuple):
        if isinstance(value, str):
            value = [v for v in value.split(",") if v != ""]
        if not isinstance(value, (list, tuple)):
            raise ConfigError(f"{where} must be a list, got {value!r}")
        (item_t, *_) = typing.get_args(base) or (Any,)
        return [_coerce(v, item_t, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(f"{where} must be a mapping, got {value!r}")
        return dict(value)
    return value


def _unknown_key(cls: type, key: str, where: str) -> ConfigError:
    names = [f.name for f in fields(cls)]
    close = difflib.get_close_matches(key, names, n=3)
    hint = f"; did you mean {close}?" if close else f"; valid keys: {names}"
    return ConfigError(f"unknown config key {where + '.' if where else ''}{key}{hint}")


def from_dict(cls: type, data: dict, where: str = "") -> Any:
    """Build dataclass ``cls`` from a (possibly nested) dict, rejecting unknown keys by name."""
    hints = type_hints(cls)
    known = {f.name: f for f in fields(cls) if f.init}
    kwargs = {}
    # A model section names a preset ("tiny" when absent, null for none); its values are the
    # defaults the other keys override, so `model.hidden_size=128` alone tweaks the tiny model.
    if cls is ModelConfig and data.get("preset", "tiny"):
        name = data.get("preset", "tiny")
        data = {"preset": name, **data}
        if name not in MODEL_PRESETS:
            raise ConfigError(f"model.preset={name!r} is unknown; valid presets: {sorted(MODEL_PRESETS)}")
        data = {**MODEL_PRESETS[name], **data}
    for key, value in data.items():
        if key not in known:
            raise _unknown_key(cls, key, where)
        kwargs[key] = _coerce(value, hints[key], f"{where}.{key}" if where else key)
    try:
        return cls(**kwargs)
    except TypeError as e:  # pragma: no cover - defensive: a required field without default
        raise ConfigError(f"{where or cls.__name__}: {e}") from None


def to_dict(obj: Any) -> dict:
    return dataclasses.asdict(obj)


def parse_overrides(argv: list[str]) -> list[tuple[str, str]]:
    """``a.b=1``, ``--a.b=1`` and ``--a.b 1`` -> [("a.b", "1"), ...]."""
    out: list[tuple[str, str]] = []
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok.startswith("--"):
            tok = tok[2:]
            if "=" not in tok:
                if "." not in tok and (i + 1 >= len(argv) or argv[i + 1].startswith("-")):
                    raise ConfigError(f"unknown option --{tok}; settings are section.key=value, --section.key=value "
                                      "or --section.key value (e.g. train.num_steps=10)")
                if i + 1 >= len(argv):
                    raise ConfigError(f"flag --{tok} needs a value")
                out.append((tok.replace("-", "_") if "." not in tok else tok, argv[i + 1]))
                i += 2
                continue
        if "=" not in tok:
            if looks_like_a_key(tok):  # a setting without its value (train.num_steps)
                raise ConfigError(no_value_message(tok))
            raise ConfigError(f"cannot parse override {argv[i]!r}; expected section.key=value")
        k, v = tok.split("=", 1)
        out.append((k, v))
        i += 1
    return out


_DOTTED = re.compile(r"[A-Za-z_]\w*(\.[A-Za-z_]\w*)+")


def looks_like_a_key(word: str) -> bool:
    """``section.key`` (dotted names, not a file's name: no folder, no .yaml / .yml / .json end)."""
    return bool(_DOTTED.fullmatch(word)) and not word.lower().endswith((".yaml", ".yml", ".json"))


def no_value_message(word: str) -> str:
    return f"an override needs key=value: {word!r} has no value (e.g. {word}=<value>)"


def _yaml_scalar(text: str) -> Any:
    """Parse an override's value the way YAML would (numbers, bools, null, lists)."""
    import yaml

    try:
        return yaml.safe_load(text) if text != "" else ""
    except yaml.YAMLError:
        return text


def apply_overrides(data: dict, overrides: list[tuple[str, str]]) -> dict:
    """Set dotted keys in a nested dict (validation happens when the dataclasses are built)."""
    for key, raw in overrides:
        parts = key.split(".")
        node = data
        for p in parts[:-1]:
            nxt = node.setdefault(p, {})
            if not isinstance(nxt, dict):
                raise ConfigError(f"override {key}: {p} is not a section")
            node = nxt
        node[parts[-1]] = _yaml_scalar(raw)
    return data


def _repeated_key(node, path, where: str = "", seen_nodes: Optional[set] = None) -> None:
    """Refuse a mapping of the YAML node tree that gives a key twice (YAML itself keeps the last one silently):
    "job.yaml:5: section 'train' is given twice (first at line 1)". Merge keys (``<<: *anchor``) are no repeat."""
    import yaml

    seen_nodes = set() if seen_nodes is None else seen_nodes
    if id(node) in seen_nodes:  # an alias: its node was read where its anchor stands
        return
    seen_nodes.add(id(node))
    if isinstance(node, yaml.MappingNode):
        lines: dict = {}
        for key_node, value_node in node.value:
            key = key_node.value if isinstance(key_node, yaml.ScalarNode) else None
            name = f"{where}.{key}" if where else str(key)
            if key is not None and key_node.tag != "tag:yaml.org,2002:merge":
                if key in lines:
                    what = f"key {name}" if where else f"section {key!r}"
                    raise ConfigError(f"{path}:{key_node.start_mark.line + 1}: {what} is given twice (first at line "
                                      f"{lines[key]}); YAML would keep the last one silently: remove one")
                lines[key] = key_node.start_mark.line + 1
            _repeated_key(value_node, path, name, seen_nodes)
    elif isinstance(node, yaml.SequenceNode):
        for i, item in enumerate(node.value):
            _repeated_key(item, path, f"{where}[{i}]", seen_nodes)


def _null_sections(node, data: dict, path) -> None:
    """A section given as null (``train:`` with nothing under it, ``train: null``) is a mistake of the file: said
    with its line, before any override could be blamed for it."""
    for key_node, _ in node.value:
        key = getattr(key_node, "value", None)
        if key in data and data[key] is None:
            raise ConfigError(f"{path}:{key_node.start_mark.line + 1}: {key}: null; a section is a mapping of its keys "
                              f"(leave {key} out for its defaults)")


def load_yaml(path: str | os.PathLike) -> dict:
    """A job file -> its nested dict of sections. Refused, with the file and line: invalid YAML, a key given twice,
    a null section, a file with no sections at all (an empty job file is a mistake, not the defaults)."""
    import yaml

    if not os.path.isfile(path):
        raise ConfigError(f"config file not found: {path}")
    text = io.StringIO(read_text(path, ConfigError))  # a byte that is not UTF-8: file:line, not a traceback
    text.name = str(path)  # YAML's error marks name the file
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is not None:
            _repeated_key(node, path)
        data = None if node is None else loader.construct_document(node)
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: invalid YAML: {e}") from None
    finally:
        loader.dispose()
    if data is None:
        raise ConfigError(f"{path}: empty job file: write the sections it changes (model:, loss:, train:, ...), or "
                          "name no file to run the demo job")
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: top level must be a mapping, got {type(data).__name__}")
    _null_sections(node, data, path)
    return data
