"""``reasoning_gym``: the task's own verifier, for prompts of a ``data.source=reasoning_gym:<task>`` source.

The reference answer of such a prompt is a data.reasoning_gym_tasks.TaskAnswer, carrying the generated
entry and the dataset whose ``score_answer`` (in [0, 1]; many tasks give partial credit) scores the
response's answer: its last ``<answer>...</answer>`` (reasoning-gym's convention) after ``</think>``,
else its first line.
"""

from __future__ import annotations

import re
from typing import Optional, Sequence

from megatron_gspo.data.rewards.exact import MatchSettings
from megatron_gspo.data.rewards.registry import register_reward
from megatron_gspo.data.rewards.text import after_think, cut_at_eos, first_line
from megatron_gspo.errors import clip_repr


def extract_task_answer(response: str, extra_stops: Sequence[str] = ()) -> str:
    """What a response answers for a verifier: the last ``<answer>...</answer>`` after ``</think>`` if it
    has one, else its first line (cut at the first end-of-sequence marker, stripped), as the built-in
    tasks are graded."""
    text = after_think(cut_at_eos(response, extra_stops))
    tagged = re.findall(r"<answer>(.*?)</answer>", text, flags=re.S)
    return tagged[-1].strip() if tagged else first_line(text)


def task_reference_problem(answer: Optional[str]) -> Optional[str]:
    """Why reward.name=reasoning_gym cannot score against ``answer``, or None."""
    return None if hasattr(answer, "verify") else "not a reasoning_gym:<task> example (no task verifier)"


@register_reward("reasoning_gym", settings=MatchSettings, reference_check=task_reference_problem)
def reasoning_gym_reward(prompt: str, response: str, answer: Optional[str], *, stop: Sequence[str] = ()) -> float:
    """The task's own verifier (``score_answer``) on the response's answer (extract_task_answer), in [0, 1]."""
    verify = getattr(answer, "verify", None)
    if verify is None:
        raise ValueError("reward.name=reasoning_gym scores prompts of data.source=reasoning_gym:<task> only; this "
                         f"example's reference {clip_repr(answer, 40)} carries no task verifier")
    return verify(extract_task_answer(response, stop))
