"""``digit_match``: the share of positions at which the response's first line agrees with the answer."""

from __future__ import annotations

from typing import Optional, Sequence

from megatron_gspo.data.rewards.exact import MatchSettings
from megatron_gspo.data.rewards.registry import register_reward
from megatron_gspo.data.rewards.text import first_line, require_answer


@register_reward("digit_match", settings=MatchSettings, parallel=False)
def digit_match(prompt: str, response: str, answer: Optional[str], *, stop: Sequence[str] = ()) -> float:
    """The fraction of character positions (left-aligned) at which the first line (as exact_match reads it)
    agrees with the answer, over the longer of the two: a denser signal than exact_match for tiny models
    that rarely hit an exact answer early on ("18" for "19" earns 0.5 instead of 0)."""
    got, want = first_line(response, stop), require_answer(answer, "digit_match").strip()
    if not got and not want:
        return 1.0
    return sum(a == b for a, b in zip(got, want)) / max(len(got), len(want))
