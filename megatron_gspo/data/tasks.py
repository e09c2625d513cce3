"""Built-in verifiable tasks, generated from a seed so a job runs with no dataset download.

Each task is an infinite, random-access sequence: ``task[i]`` is a pure function of ``(task name,
seed, knobs, i)``. Nothing is stored, any position can be regenerated, and a checkpoint only needs
the data position to resume on exactly the same prompts (see :mod:`megatron_gspo.data.prompts`).

Examples are ``{"prompt": str, "answer": str, "id": str}``, scored by the ``exact_match`` (or the
denser ``digit_match``) reward. Prompts stay short (about 5-15 characters with the defaults) because
the tiny model's context is 512 tokens and the response must fit after the prompt.

* ``arithmetic``: ``"12+7="`` -> ``"19"``; operands have 1..``num_digits`` digits, operators are
  drawn from ``operators`` (``+``, ``-``, ``*``). Subtraction puts the larger operand first so
  answers are never negative (a sign is one more thing a tiny model must learn for no benefit).
* ``sort``: ``"sort 3 1 2:"`` -> ``"1 2 3"``; ``min_len``..``max_len`` numbers in 0..``max_value``.
"""

from __future__ import annotations

import random
from abc import ABC, abstractmethod
from typing import Any, Iterator


class Task(ABC):
    """An infinite, deterministic, random-access sequence of ``{"prompt", "answer", "id"}`` dicts."""

    name: str = ""

    def __init__(self, seed: int = 1234) -> None:
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise ValueError(f"task seed must be an integer, got {seed!r}")
        self.seed = seed

    @abstractmethod
    def _generate(self, rng: random.Random) -> tuple[str, str]:
        """(prompt, answer) drawn with ``rng``; must use nothing but ``rng`` for randomness."""

    def __getitem__(self, index: int) -> dict[str, str]:
        if not isinstance(index, int) or index < 0:
            raise IndexError(f"{self.name} task index must be a non-negative integer, got {index!r}")
        # One generator per example, seeded from a string: Random(str) hashes it with SHA-512, so the
        # example is independent of PYTHONHASHSEED, of the Python version and of which examples were
        # generated before it (that is what makes random access and exact resume possible).
        rng = random.Random(f"{self.name}:{self.seed}:{index}")
        prompt, answer = self._generate(rng)
        return {"prompt": prompt, "answer": answer, "id": f"{self.name}-{self.seed}-{index}"}

    def __iter__(self) -> Iterator[dict[str, str]]:
        index = 0
        while True:
            yield self[index]
            index += 1


class ArithmeticTask(Task):
    """``a<op>b=`` -> the result, e.g. ``"12+7="`` -> ``"19"``."""

    name = "arithmetic"
    OPERATORS = "+-*"

    def __init__(self, seed: int = 1234, num_digits: int = 2, min_digits: int = 1, operators: str = "+") -> None:
        super().__init__(seed)
        if not (isinstance(num_digits, int) and isinstance(min_digits, int) and 1 <= min_digits <= num_digits <= 18):
            raise ValueError(
                f"arithmetic task needs 1 <= min_digits <= num_digits <= 18, got min_digits={min_digits}, "
                f"num_digits={num_digits}"
            )
        ops = "".join(operators) if not isinstance(operators, str) else operators
        bad = sorted(set(ops) - set(self.OPERATORS))
        if not ops or bad:
            raise ValueError(f"arithmetic task operators={operators!r}: each must be one of {list(self.OPERATORS)}")
        self.num_digits, self.min_digits = num_digits, min_digits
        # Deduplicate but keep the given order, so "++-" does not silently reweight the mix.
        self.operators = "".join(dict.fromkeys(ops))

    def _operand(self, rng: random.Random) -> int:
        # Digit count first, then the value: otherwise almost every operand would have the maximum
        # number of digits and the short problems a tiny model learns from first would be rare.
        d = rng.randint(self.min_digits, self.num_digits)
        return rng.randint(0 if d == 1 else 10 ** (d - 1), 10**d - 1)

    def _generate(self, rng: random.Random) -> tuple[str, str]:
        op = rng.choice(self.operators)
        a, b = self._operand(rng), self._operand(rng)
        if op == "-" and b > a:
            a, b = b, a
        result = a + b if op == "+" else a - b if op == "-" else a * b
        return f"{a}{op}{b}=", str(result)


class SortTask(Task):
    """``"sort 3 1 2:"`` -> ``"1 2 3"`` (ascending, duplicates kept)."""

    name = "sort"

    def __init__(self, seed: int = 1234, min_len: int = 3, max_len: int = 5, max_value: int = 9) -> None:
        super().__init__(seed)
        if not (isinstance(min_len, int) and isinstance(max_len, int) and 1 <= min_len <= max_len):
            raise ValueError(f"sort task needs 1 <= min_len <= max_len, got min_len={min_len}, max_len={max_len}")
        if not (isinstance(max_value, int) and max_value >= 0):
            raise ValueError(f"sort task needs max_value >= 0, got {max_value!r}")
        self.min_len, self.max_len, self.max_value = min_len, max_len, max_value

    def _generate(self, rng: random.Random) -> tuple[str, str]:
        values = [rng.randint(0, self.max_value) for _ in range(rng.randint(self.min_len, self.max_len))]
        return "sort " + " ".join(map(str, values)) + ":", " ".join(map(str, sorted(values)))


TASKS: dict[str, type[Task]] = {ArithmeticTask.name: ArithmeticTask, SortTask.name: SortTask}


def build_task(name: str, seed: int = 1234, **kwargs: Any) -> Task:
    """Instantiate a built-in task by name; ``kwargs`` are the task's knobs (see each class)."""
    if name not in TASKS:
        raise ValueError(f"unknown built-in task {name!r}; available: {sorted(TASKS)}")
    try:
        return TASKS[name](seed=seed, **kwargs)
    except TypeError as e:  # an unknown knob: name the task so the config key can be found
        raise ValueError(f"built-in task {name!r}: {e}") from None
