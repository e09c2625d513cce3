"""Tool calls in a sampled response: found, parsed, and written (for demonstrations), in two formats.

``qwen3`` (``env.tool_format=qwen3``): Qwen3's (and Hermes') format, what its chat template tells the
model in the system prompt::

    <tool_call>
    {"name": "calculator", "arguments": {"expression": "123*456"}}
    </tool_call>

``plain`` (the built-in character tokenizer, whose tiny models must learn every character): one call is
``<call>NAME ARGUMENTS</call>``, ARGUMENTS a JSON object, or for a tool of one parameter its value as it
is: ``<call>calculator 123*456</call>``.

A response may hold several calls (they run in order). A call that cannot be read (an unclosed tag,
JSON that does not parse, no tool name, arguments that are not an object) is a ``ToolCall`` with
``error`` set: the environment answers it with an error message (or ends the row: env.on_tool_error),
never the job.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Optional

from megatron_gspo.errors import EnvError

TOOL_FORMATS = ("qwen3", "plain")

_TAGS = {"qwen3": ("<tool_call>", "</tool_call>"), "plain": ("<call>", "</call>")}


@dataclass
class ToolCall:
    """One call found in a response: ``name`` and ``arguments``, or ``error`` (why it cannot be read) with
    what could be read; ``text``: the call as written."""

    name: Optional[str]
    arguments: dict = field(default_factory=dict)
    text: str = ""
    error: Optional[str] = None


def _bare(raw: str, json_type: Optional[str]):
    """A plain-format bare value as its parameter's JSON type (integer, number, boolean), else the text."""
    try:
        if json_type == "integer":
            return int(raw)
        if json_type == "number":
            return float(raw)
        if json_type == "boolean" and raw in ("true", "false"):
            return raw == "true"
    except ValueError:
        pass
    return raw


def _arguments(name: str, raw, single: Optional[tuple]) -> tuple[dict, Optional[str]]:
    """(arguments, error) of a call's argument part: a dict, a JSON string of one, or (plain format, a
    tool of one parameter: ``single`` = (its name, its JSON type)) the bare value."""
    if isinstance(raw, dict):
        return raw, None
    if isinstance(raw, str):
        try:
            parsed = json.loads(raw)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, dict):
            return parsed, None
        if single is not None:
            return {single[0]: _bare(raw, single[1])}, None
    return {}, f"the arguments of {name!r} are not a JSON object: {str(raw)[:80]!r}"


def _parse_qwen3(body: str) -> ToolCall:
    try:
        obj = json.loads(body)
    except json.JSONDecodeError as e:
        return ToolCall(None, error=f"the tool call is not valid JSON ({e.msg} at column {e.colno})")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall(None, error='the tool call names no tool: expected {"name": ..., "arguments": {...}}')
    args, err = _arguments(obj["name"], obj.get("arguments", {}), None)
    return ToolCall(obj["name"], args, error=err)


def _parse_plain(body: str, single_params: dict[str, Optional[tuple]]) -> ToolCall:
    name, _, rest = body.strip().partition(" ")
    if not name:
        return ToolCall(None, error="the tool call names no tool: expected <call>NAME ARGUMENTS</call>")
    rest = rest.strip()
    if not rest:
        return ToolCall(name, {})
    args, err = _arguments(name, rest, single_params.get(name))
    return ToolCall(name, args, error=err)


def parse_tool_calls(text: str, fmt: str, single_params: Optional[dict[str, Optional[tuple]]] = None) -> list[ToolCall]:
    """Every call in ``text``, in order (module doc). ``single_params``: {tool name: (its one parameter's name,
    JSON type), or None}, for the plain format's bare values."""
    if fmt not in _TAGS:
        raise EnvError(f"env.tool_format={fmt!r} is not one of {list(TOOL_FORMATS)}")
    open_tag, close_tag = _TAGS[fmt]
    calls, at = [], 0
    while True:
        start = text.find(open_tag, at)
        if start < 0:
            return calls
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            calls.append(ToolCall(None, text=text[start:], error=f"{open_tag} is never closed by {close_tag}"))
            return calls
        body = text[start + len(open_tag):end]
        call = _parse_qwen3(body) if fmt == "qwen3" else _parse_plain(body, single_params or {})
        call.text = text[start:end + len(close_tag)]
        calls.append(call)
        at = end + len(close_tag)


def format_call(name: str, arguments: dict, fmt: str, single: Optional[str] = None) -> str:
    """A call as the model writes it in format ``fmt`` (demonstrations, tests); ``single``: the tool's one
    parameter (plain format: its value is written bare)."""
    if fmt == "qwen3":
        return "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"
    if fmt == "plain":
        if single is not None and set(arguments) == {single} and isinstance(arguments[single], str):
            return f"<call>{name} {arguments[single]}</call>"
        return f"<call>{name} {json.dumps(arguments, ensure_ascii=False)}</call>"
    raise EnvError(f"env.tool_format={fmt!r} is not one of {list(TOOL_FORMATS)}")
