"""A multi-turn environment that is not a tool: the answer guessed over turns, with feedback.

``GuessWithFeedback`` (``env.name: megatron_gspo.env.games:GuessWithFeedback``) asks the example's prompt
and reads a number in each response: the right one ends the conversation with reward ``discount ** (turn
- 1)`` (1 at the first try), a wrong one is answered ``higher`` or ``lower`` (a user turn) and the policy
tries again; a response without a number is answered ``a number, please``. A row that never gets it
(env.max_turns) scores 0 from the reward function, like any row without an environment reward
(``reward.name`` on its last response: exact_match gives 0 to a wrong number). With a built-in task's
numeric answers (``builtin:arithmetic``) it is a task the policy can learn to solve over turns: a first
guess, then a search steered by the feedback.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?\d+")


class GuessWithFeedback:
    """reset(example) -> the example's prompt; step(response) -> (feedback, reward, done) (module doc)."""

    def __init__(self, discount: float = 0.5) -> None:
        if not 0 < discount <= 1:
            raise ValueError(f"GuessWithFeedback: discount must be in (0, 1], got {discount}")
        self.discount = discount
        self.target: int = 0
        self.turn = 0

    def reset(self, example: dict) -> str:
        self.target, self.turn = int(str(example["answer"]).strip()), 0
        prompt = example["prompt"]
        return prompt if isinstance(prompt, str) else prompt[-1]["content"]

    def step(self, response: str):
        self.turn += 1
        found = _NUMBER.findall(response)
        if not found:
            return "a number, please", None, False
        guess = int(found[0])
        if guess == self.target:
            return None, self.discount ** (self.turn - 1), True
        return ("higher" if guess < self.target else "lower"), None, False
