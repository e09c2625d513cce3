r"""``format``: 1.0 when the response has the required shape (``<think>`` block, ``\boxed{}``), else 0.0.

Mostly used as an additive shaping term (``reward.format_weight``, with ``reward.format_kwargs``).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_gspo.data.rewards.registry import register_reward
from megatron_gspo.data.rewards.settings import setting
from megatron_gspo.data.rewards.text import cut_at_eos, last_boxed

FORMAT_REQUIREMENTS = ("think", "boxed", "think+boxed")


@dataclass
class FormatSettings:
    """require: "think" (one ``<think>...</think>`` block with non-empty reasoning, at the start, then a
    non-empty answer; a prompt that ends in ``<think>`` opened the block), "boxed" (the answer part holds a
    ``\\boxed{}``) or "think+boxed" (both). stop: strings that end the response besides the
    end-of-sequence markers."""

    require: str = setting("think", choices=FORMAT_REQUIREMENTS)
    stop: list[str] = setting(default_factory=list)


@register_reward("format", settings=FormatSettings, parallel=False)
def format_reward(prompt: str, response: str, answer: Optional[str] = None, *, require: str = "think",
                  stop: Sequence[str] = ()) -> float:
    """1.0 if the response has the shape ``require`` asks for (FormatSettings), else 0.0."""
    if require not in FORMAT_REQUIREMENTS:
        raise ValueError(f"format reward: require={require!r} is not one of {list(FORMAT_REQUIREMENTS)}")
    text = cut_at_eos(response, stop)
    if prompt.rstrip().endswith("<think>"):  # the generation prompt opened the block for the model
        text = "<think>" + text
    answer_part = text
    if "think" in require:
        m = re.fullmatch(r"\s*<think>(.*?)</think>(.*)", text, flags=re.S)
        if m is None or not m.group(1).strip() or not m.group(2).strip():
            return 0.0
        if "<think>" in m.group(2) or "</think>" in m.group(2):
            return 0.0  # a second block: the model is not following the format
        answer_part = m.group(2)
    if "boxed" in require and last_boxed(answer_part) is None:
        return 0.0
    return 1.0
