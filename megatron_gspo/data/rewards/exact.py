"""``exact_match``: 1.0 when the response's first line equals the reference answer (the built-in tasks' reward)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

from megatron_gspo.data.rewards.registry import register_reward
from megatron_gspo.data.rewards.settings import setting
from megatron_gspo.data.rewards.text import first_line, require_answer


@dataclass
class MatchSettings:
    """stop: strings that end the response besides the end-of-sequence markers (text.EOS_MARKERS)."""

    stop: list[str] = setting(default_factory=list)


@register_reward("exact_match", settings=MatchSettings, parallel=False)  # microseconds: no worker pays off
def exact_match(prompt: str, response: str, answer: Optional[str], *, stop: Sequence[str] = ()) -> float:
    """1.0 if the response's first line (leading whitespace stripped, cut at the first end-of-sequence
    marker or ``stop`` string) equals ``answer.strip()``, else 0.0."""
    return float(first_line(response, stop) == require_answer(answer, "exact_match").strip())
