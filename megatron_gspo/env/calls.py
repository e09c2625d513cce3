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
never the job. The text is the policy's, so anything may come: JSON nested thousands deep (Python's
parser recurses), an integer of 5,000 digits (past Python's int-string limit), an escaped lone surrogate
(no UTF-8 for the worker's pipe or the dump). Each is a malformed call; no text makes ``parse_tool_calls``
raise (tests/test_env.py fuzzes it).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Optional

from megatron_gspo.errors import EnvError, clip_repr

TOOL_FORMATS = ("qwen3", "plain")

_TAGS = {"qwen3": ("<tool_call>", "</tool_call>"), "plain": ("<call>", "</call>")}

# Nesting a call's JSON may have: no tool's arguments need more, and every JSON encoder after the parser (the
# worker pipe, the TP broadcast, the dump) recurses too, deeper into the stack than the parser was.
MAX_DEPTH = 32


def _depth_over(value, limit: int) -> bool:
    """Whether ``value`` (parsed JSON) nests containers deeper than ``limit`` (walked without recursion)."""
    stack = [(value, 1)]
    while stack:
        v, d = stack.pop()
        if isinstance(v, (dict, list)):
            if d > limit:
                return True
            stack.extend((c, d + 1) for c in (v.values() if isinstance(v, dict) else v))
    return False


def _loads(text: str):
    """(the JSON value of ``text``, None) or (None, why it is not one): whatever the text, it never raises."""
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        return None, f"not valid JSON ({e.msg} at column {e.colno})"
    except RecursionError:
        return None, "not valid JSON (nested too deep to read)"
    except ValueError as e:  # an integer past Python's int-string limit (sys.get_int_max_str_digits)
        return None, f"not valid JSON ({str(e).split(':')[0]})"
    if _depth_over(value, MAX_DEPTH):
        return None, f"JSON nested deeper than {MAX_DEPTH} levels"
    try:
        json.dumps(value, ensure_ascii=False).encode("utf-8")
    except (UnicodeEncodeError, ValueError) as e:  # a lone surrogate ("\\ud800"): no UTF-8 for the pipe
        return None, f"JSON that cannot be sent as UTF-8 ({type(e).__name__})"
    return value, None


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
        parsed, problem = _loads(raw)
        if isinstance(parsed, dict):
            return parsed, None
        if single is not None:  # the bare value, as it is (a tool of one parameter)
            return {single[0]: _bare(raw, single[1])}, None
        if problem is not None:
            return {}, f"the arguments of {clip_repr(name, 80)} are {problem}"
    return {}, f"the arguments of {clip_repr(name, 80)} are not a JSON object: {clip_repr(str(raw), 80)}"


def _parse_qwen3(body: str) -> ToolCall:
    obj, problem = _loads(body)
    if problem is not None:
        return ToolCall(None, error=f"the tool call is {problem}")
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return ToolCall(None, error='the tool call names no tool: expected {"name": ..., "arguments": {...}}')
    args, err = _arguments(obj["name"], obj.get("arguments", {}), None)
    return ToolCall(obj["name"], args, error=err)


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


def _parse_plain(body: str, single_params: dict[str, Optional[tuple]]) -> ToolCall:
    name, _, rest = body.strip().partition(" ")
    if not name:
        return ToolCall(None, error="the tool call names no tool: expected <call>NAME ARGUMENTS</call>")
    if not _utf8(body):
        return ToolCall(None, error="the tool call holds text that cannot be sent as UTF-8 (a lone surrogate)")
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
