r"""``math``: 1.0 when math-verify (the checker of TRL and open-r1) finds the response's answer equal to
the reference's final answer.

The reference may be a ``\boxed{}`` solution (its last box is the final answer), a GSM8K
``... #### 72`` (what follows ``####``) or the answer itself (math_reference.py says which references
it can read); the response is read after ``</think>`` if it has one, cut at its end-of-sequence
marker, by math-verify's own extraction (its last ``\boxed{}`` first, then LaTeX and plain
expressions). math-verify runs in child processes (math_verify_worker.py), ``reward.num_workers`` of
them checking a batch's responses in parallel, with a CPU-time limit per side of a check
(``timeout_s``) and a wall-clock backstop (``wall_timeout_s``); past either the response scores 0
and a warning names the side that took the time: the response, or the reference (then every
response to it scores 0, and it is said once).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Optional

from megatron_gspo.data.rewards.batch import BatchReward, RewardBatch, SampleFailed
from megatron_gspo.data.rewards.math_reference import math_reference_problem, reference_final_answer
from megatron_gspo.data.rewards.registry import register_reward
from megatron_gspo.data.rewards.settings import setting
from megatron_gspo.data.rewards.text import after_think, cut_at_eos, require_answer
from megatron_gspo.errors import clip_repr
from megatron_gspo.runtime.stop import Cancelled

log = logging.getLogger("megatron_gspo")

# A math-verify check's limits: the CPU time each side may use (load-independent; a normal answer needs
# milliseconds to a second), and a wall-clock backstop for what no Python-level timer interrupts
# (generous: on a shared machine a second of CPU can take a minute).
MATH_VERIFY_CPU_TIMEOUT_S = 10.0
MATH_VERIFY_WALL_TIMEOUT_S = 600.0


@dataclass
class MathSettings:
    """timeout_s: the CPU time math-verify may spend on each side of a check (parsing the reference;
    parsing the response and comparing); wall_timeout_s: the longest wait for a verdict, a backstop for
    what no timer interrupts (the checker process is then killed and replaced)."""

    timeout_s: float = setting(MATH_VERIFY_CPU_TIMEOUT_S, gt=0)
    wall_timeout_s: float = setting(MATH_VERIFY_WALL_TIMEOUT_S, gt=0)


def math_sides(response: str, answer: Optional[str]) -> Optional[tuple[str, str]]:
    """(the response's answer part, the reference's final answer) that math-verify compares, or None when
    either is empty (a 0 without a check). ValueError for an example without a reference."""
    gold, _ = reference_final_answer(require_answer(answer, "math"))
    text = after_think(cut_at_eos(response))
    if not gold.strip() or not text.strip():
        return None
    return text, gold.strip()


def _say_timeout(e, text: str, gold: str) -> None:
    what = ("the reference answer", gold) if e.side == "reference" else ("the response", text)
    also = ", as every response to this reference" if e.side == "reference" else ""
    log.warning("math reward: %s (scored 0%s); %s starts %s", e, also, what[0], clip_repr(what[1], 80))


def check(checker, sides: tuple[str, str], settings: dict, should_stop: Optional[Callable[[], bool]] = None) -> float:
    """1.0 / 0.0: math-verify's verdict on ``sides`` (math_sides) from ``checker`` (a
    math_verify_worker.MathVerifyPool); 0.0 with a warning naming the side past a limit."""
    from megatron_gspo.data.rewards.math_verify_worker import MathVerifyTimeout

    text, gold = sides
    try:
        return float(checker.equal(text, gold, settings["timeout_s"], settings["wall_timeout_s"], should_stop))
    except MathVerifyTimeout as e:
        _say_timeout(e, text, gold)
        return 0.0


def math_reward(prompt: str, response: str, answer: Optional[str], *, timeout_s: float = MATH_VERIFY_CPU_TIMEOUT_S,
                wall_timeout_s: float = MATH_VERIFY_WALL_TIMEOUT_S) -> float:
    """The math reward of one response (module doc), on this process's shared checker: for a plug-in that
    builds on it (``reward.name=math`` scores a batch with MathVerifyReward)."""
    from megatron_gspo.data.rewards.math_verify_worker import process_checker

    sides = math_sides(response, answer)
    if sides is None:
        return 0.0
    return check(process_checker(), sides, {"timeout_s": timeout_s, "wall_timeout_s": wall_timeout_s})


@register_reward("math", settings=MathSettings, reference_check=math_reference_problem)
class MathVerifyReward(BatchReward):
    """The math reward of a batch (module doc): ``num_workers`` math-verify processes check its responses in
    parallel (math_verify_worker.MathVerifyPool), each stop of the job honoured within 0.1 s."""

    def __init__(self, *, timeout_s: float = MATH_VERIFY_CPU_TIMEOUT_S,
                 wall_timeout_s: float = MATH_VERIFY_WALL_TIMEOUT_S, num_workers: int = 1) -> None:
        from megatron_gspo.data.rewards.math_verify_worker import MathVerifyPool

        self.settings = {"timeout_s": timeout_s, "wall_timeout_s": wall_timeout_s}
        self.pool = MathVerifyPool(num_workers)
        self.bad_references: set[str] = set()  # references that took a whole limit: said once, not checked again

    def score(self, batch: RewardBatch) -> list:
        from megatron_gspo.data.rewards.math_verify_worker import MathVerifyTimeout

        out: list[Any] = []
        for _, response, answer in batch.rows():
            try:
                sides = math_sides(response, answer)
            except ValueError as e:  # no reference answer: the RewardError names the row
                sides = SampleFailed(f"raised ValueError: {e}")
            out.append(0.0 if sides is None else sides)
        if batch.should_stop():
            raise Cancelled("while scoring")
        todo = [i for i, v in enumerate(out) if isinstance(v, tuple)]
        pairs = [out[i] for i in todo]

        def arrived(j: int, verdict) -> None:  # before the next pair is handed out: a bad reference is said once
            if isinstance(verdict, MathVerifyTimeout):
                if verdict.side == "reference":
                    self.bad_references.add(pairs[j][1])
                _say_timeout(verdict, *pairs[j])

        verdicts = self.pool.verdicts(pairs, self.settings["timeout_s"], self.settings["wall_timeout_s"],
                                      batch.should_stop, skip=self.bad_references.__contains__, on_verdict=arrived)
        for i, verdict in zip(todo, verdicts):
            if verdict is None or isinstance(verdict, MathVerifyTimeout):  # skipped (a bad reference), or past a limit
                out[i] = 0.0
            elif isinstance(verdict, Exception):  # the checker failed: the RewardError names the row
                out[i] = SampleFailed(f"raised {type(verdict).__name__}: {verdict}")
            else:
                out[i] = float(verdict)
        return out

    def close(self) -> None:
        self.pool.close()
