"""Reading the text files a job names (config YAML, JSON Lines data, tokenizer and model JSON, chat
templates) as UTF-8: a byte that is not UTF-8 is reported as ``file:line: not UTF-8 ...`` with its
column, as the caller's error type (ConfigError, DataError, TokenizerError), instead of a
UnicodeDecodeError traceback that names neither the file nor the line.

A leading byte-order mark (what some Windows editors write) is accepted and dropped, as
``utf-8-sig`` does. A leaf module: it imports nothing of megatron_gspo.
"""

from __future__ import annotations

import codecs
import json
import os
from typing import Any, Callable, Union

__all__ = ["decode_line", "not_utf8_message", "read_json_object", "read_text"]

PathLike = Union[str, "os.PathLike[str]"]


def not_utf8_message(path: PathLike, data: bytes, error: UnicodeDecodeError, first_line: int = 1) -> str:
    """``path:line: not UTF-8 (byte 0x.. at column c) ...`` for a decoding ``error`` of ``data``, the
    bytes of ``path`` from line ``first_line`` on (the whole file, or one line of it). The column
    counts characters, like an editor's."""
    pos = error.start
    line = first_line + data.count(b"\n", 0, pos)
    start = data.rfind(b"\n", 0, pos) + 1
    column = len(data[start:pos].decode("utf-8", errors="replace")) + 1
    return (f"{path}:{line}: not UTF-8 text (byte 0x{data[pos]:02x} at column {column}); save the file as UTF-8 "
            "(e.g. iconv -f latin1 -t utf-8)")


def decode_line(raw: bytes, path: PathLike, lineno: int, error: Callable[[str], Exception]) -> str:
    """Line ``lineno`` of ``path`` (read in binary) as text; a BOM is dropped on line 1."""
    if lineno == 1 and raw.startswith(codecs.BOM_UTF8):
        raw = raw[len(codecs.BOM_UTF8):]
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(not_utf8_message(path, raw, e, first_line=lineno)) from None


def read_text(path: PathLike, error: Callable[[str], Exception]) -> str:
    """The whole file as text (``error(message)`` is raised for bytes that are not UTF-8)."""
    with open(path, "rb") as f:
        data = f.read()
    if data.startswith(codecs.BOM_UTF8):
        data = data[len(codecs.BOM_UTF8):]
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise error(not_utf8_message(path, data, e)) from None


def read_json_object(path: PathLike, error: Callable[[str], Exception]) -> dict[str, Any]:
    """A JSON file holding one object (a config.json, tokenizer_config.json, ...); bytes that are not
    UTF-8, invalid JSON or another top-level value are ``error(message)`` naming the file."""
    try:
        data = json.loads(read_text(path, error))
    except json.JSONDecodeError as e:
        raise error(f"{path}: invalid JSON ({e})") from None
    if not isinstance(data, dict):
        raise error(f"{path}: expected a JSON object, got {type(data).__name__}")
    return data
