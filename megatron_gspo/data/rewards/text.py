r"""What the built-in rewards read of a response: where it ends, its first line, its last ``\boxed{}``."""

from __future__ import annotations

import re
from typing import Optional, Sequence

# End-of-sequence token texts of the supported tokenizers (built-in, Qwen, Llama, SentencePiece).
EOS_MARKERS = ("<eos>", "<|im_end|>", "<|endoftext|>", "<|eot_id|>", "<|end_of_text|>", "</s>")


def cut_at_eos(response: str, extra_stops: Sequence[str] = ()) -> str:
    """The response up to its first end-of-sequence marker (the text after it was never "said")."""
    end = len(response)
    for marker in (*EOS_MARKERS, *extra_stops):
        i = response.find(marker)
        if 0 <= i < end:
            end = i
    return response[:end]


def first_line(response: str, extra_stops: Sequence[str] = ()) -> str:
    """What the built-in tasks grade: up to the first eos marker and the first newline, stripped."""
    return cut_at_eos(response, extra_stops).lstrip().split("\n", 1)[0].strip()


def after_think(text: str) -> str:
    """The answer part of a reasoning response: the text after its last ``</think>``, if it has one."""
    return text.rsplit("</think>", 1)[1] if "</think>" in text else text


def require_answer(answer: Optional[str], reward: str) -> str:
    """``answer`` as text; ValueError for an example without one (the reward compares against it)."""
    if answer is None:
        raise ValueError(f"{reward} needs a reference answer but the example has none (check data.answer_key)")
    return str(answer)


def last_boxed(text: str) -> Optional[str]:
    r"""Content of the last ``\boxed{...}`` / ``\fbox{...}`` (balanced braces), or of ``\boxed 5``."""
    start = max(text.rfind("\\boxed"), text.rfind("\\fbox"))
    if start < 0:
        return None
    i = start + (6 if text.startswith("\\boxed", start) else 5)
    while i < len(text) and text[i] == " ":
        i += 1
    if i >= len(text):
        return None
    if text[i] != "{":  # "\boxed 5": the argument runs to the next space or $
        m = re.match(r"[^\s$]+", text[i:])
        return m.group(0) if m and text[i - 1] == " " else None
    depth = 0
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i + 1: j]
    return None  # unbalanced: the response was cut off inside the box
