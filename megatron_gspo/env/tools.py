"""Tools: plain Python functions, named ``module:function`` in ``env.tools``, described by a JSON schema.

A tool is what the field calls a function tool (OpenAI's ``tools=``, TRL's ``tools=``, verl's
``BaseTool``): a function whose signature and docstring say what it takes. ``tool_schema`` reads both
into the schema chat templates show the model (Qwen3: one ``{"type": "function", "function": {...}}``
line per tool inside ``<tools>``)::

    def calculator(expression: str) -> str:
        \"\"\"Evaluate an arithmetic expression.

        Args:
            expression: the expression, e.g. "123*456"
        \"\"\"

    -> {"type": "function", "function": {"name": "calculator", "description": "Evaluate an arithmetic
        expression.", "parameters": {"type": "object", "properties": {"expression": {"type": "string",
        "description": "the expression, e.g. \\"123*456\\""}}, "required": ["expression"]}}}

Parameter types come from the annotations (str, int, float, bool, list, dict, Optional[...]; none: any
JSON value); a parameter without a default is required; ``*args`` / ``**kwargs`` have no schema and are
refused. Descriptions come from a Google-style ``Args:`` section.

The functions run in the environment's worker processes (env/pool.py), never in the trainer: a tool
that hangs is killed at ``env.tool_timeout_s``, one that raises becomes an error message for the model.
``BUILTIN_TOOLS`` names the tools shipped with the package (``env.tools=[calculator]``).
"""

from __future__ import annotations

import inspect
import re
import typing
from dataclasses import dataclass
from typing import Any, Callable

from megatron_gspo.errors import EnvError, a_or_an

BUILTIN_TOOLS = {"calculator": "megatron_gspo.env.calculator:calculator"}

_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object",
               tuple: "array"}


@dataclass(frozen=True)
class Tool:
    """A loaded tool: ``name`` (the function's, what the model calls), ``path`` (``module:function``, what a
    worker process imports), ``description`` and ``parameters`` (a JSON-schema object)."""

    name: str
    path: str
    description: str
    parameters: dict

    def schema(self) -> dict:
        """The tool as chat templates take it (``tools=[...]``)."""
        return {"type": "function",
                "function": {"name": self.name, "description": self.description, "parameters": self.parameters}}


def resolve_path(spec: str, key: str = "env.tools") -> str:
    """``module:function`` of ``spec``: a built-in tool's name (BUILTIN_TOOLS), a ``module:function`` or a
    ``path/to/file.py:function``."""
    if spec in BUILTIN_TOOLS:
        return BUILTIN_TOOLS[spec]
    module, _, attr = spec.rpartition(":")
    if not module or not attr:
        raise EnvError(f"{key}: {spec!r} is neither a built-in tool ({', '.join(sorted(BUILTIN_TOOLS))}) nor "
                       "'package.module:function' or 'path/to/file.py:function'")
    return spec


def import_object(path: str, key: str) -> Any:
    """The object ``module:attr`` (or ``path/to/file.py:attr``) names; an EnvError naming ``key`` and the module when
    the module or the name is missing, or when the module's import fails (it raises, has a syntax error, calls
    sys.exit): the reward plug-ins' import (data/rewards/registry.py), in the trainer at start-up and in the
    worker processes."""
    from megatron_gspo.plugins import load_plugin_module

    module, _, attr = path.rpartition(":")
    obj = load_plugin_module(module, f"{key}: {path!r}", EnvError)
    for part in attr.split("."):
        if not hasattr(obj, part):
            raise EnvError(f"{key}: module {module!r} has no {attr!r} (for {path!r})")
        obj = getattr(obj, part)
    return obj


def _json_type(tp: Any) -> dict:
    """The JSON-schema fragment of an annotation ({} for none or an unknown type: any value)."""
    if tp is inspect.Parameter.empty or tp is Any:
        return {}
    origin = typing.get_origin(tp)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        return _json_type(args[0]) if len(args) == 1 else {}
    base = origin or tp
    return {"type": _JSON_TYPES[base]} if base in _JSON_TYPES else {}


def _arg_docs(doc: str) -> dict[str, str]:
    """Google-style ``Args:`` entries of a docstring: {name: description} (continuation lines joined)."""
    out: dict[str, str] = {}
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() in ("Args:", "Arguments:", "Parameters:"))
    except StopIteration:
        return out
    indent, current = None, None
    for line in lines[start + 1:]:
        if not line.strip():
            continue
        width = len(line) - len(line.lstrip())
        indent = width if indent is None else indent
        if width < indent:
            break  # the section ended (Returns:, ...)
        m = re.match(r"\s*(\w+)\s*(\([^)]*\))?\s*:\s*(.*)", line) if width == indent else None
        if m:
            current = m.group(1)
            out[current] = m.group(3).strip()
        elif current is not None:
            out[current] = (out[current] + " " + line.strip()).strip()
    return out


def tool_schema(fn: Callable, name: str) -> tuple[str, dict]:
    """(description, parameters schema) of the function ``fn`` (module doc); ``name`` for errors."""
    try:
        sig = inspect.signature(fn)
        hints = typing.get_type_hints(fn)
    except (TypeError, ValueError, NameError) as e:
        raise EnvError(f"env.tools: cannot read the signature of {name}: {e}") from None
    doc = inspect.getdoc(fn) or ""
    described = _arg_docs(doc)
    props, required = {}, []
    for p in sig.parameters.values():
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            raise EnvError(f"env.tools: {name} takes {'*' if p.kind is p.VAR_POSITIONAL else '**'}{p.name}; a tool's "
                           "parameters must be named (its JSON schema lists them)")
        prop = _json_type(hints.get(p.name, p.annotation))
        if p.name in described:
            prop["description"] = described[p.name]
        props[p.name] = prop
        if p.default is p.empty:
            required.append(p.name)
    summary = doc.split("\n\n")[0].replace("\n", " ").strip() if doc else ""
    return summary, {"type": "object", "properties": props, "required": required}


def load_tool(spec: str) -> Tool:
    """The tool ``spec`` names (a built-in name or ``module:function``), its schema read from the function."""
    path = resolve_path(spec)
    fn = import_object(path, "env.tools")
    if not callable(fn) or inspect.isclass(fn):
        raise EnvError(f"env.tools: {path!r} is {a_or_an(type(fn).__name__)}, not a function")
    name = path.rpartition(":")[2].split(".")[-1]
    description, parameters = tool_schema(fn, path)
    return Tool(name=name, path=path, description=description, parameters=parameters)


def load_tools(specs: list[str]) -> dict[str, Tool]:
    """{name: Tool} of ``env.tools``; two tools of one name are refused (the model calls them by name)."""
    tools: dict[str, Tool] = {}
    for spec in specs:
        tool = load_tool(spec)
        if tool.name in tools:
            raise EnvError(f"env.tools: {tools[tool.name].path!r} and {tool.path!r} are both named {tool.name!r}; the "
                           "model calls a tool by its function's name")
        tools[tool.name] = tool
    return tools


def bind_arguments(fn: Callable, arguments: dict) -> inspect.BoundArguments:
    """The call ``fn(**arguments)`` bound to the signature: TypeError (its message names the parameter)
    when an argument is missing or unknown."""
    return inspect.signature(fn).bind(**arguments)
