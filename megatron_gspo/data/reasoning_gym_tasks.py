"""reasoning-gym's procedurally generated tasks as prompt sources, scored by their own verifiers.

``data.source=reasoning_gym:<task>`` (e.g. ``reasoning_gym:chain_sum``) draws prompts from the
reasoning-gym package (``pip install -e .[tasks]``; 100+ tasks, offline): ``data.task_kwargs`` are
the task's own config fields (``{min_terms: 2, max_terms: 2, max_digits: 1}``), ``data.seed`` its
seed, ``data.task_num_examples`` the length of one epoch. Like the built-in tasks (tasks.py) an
example is a pure function of (task, config, seed, index): reasoning-gym generates item ``i`` from
``Random(seed + i)``, so the sampler's two integers resume a run on exactly the same prompts, and the
held-out split is the indices just past the training epoch (data.split_holdout).

Each example's reference answer is a :class:`TaskAnswer`: the task's answer string (what the SFT warm
start learns and ``exact_match`` compares), carrying the generated entry and the dataset, so that
``reward.name=reasoning_gym`` (data/rewards/reasoning_gym.py) scores a response with the task's own ``score_answer``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from megatron_gspo.errors import DataError
from megatron_gspo.data.tasks import Task

PREFIX = "reasoning_gym:"


class TaskAnswer(str):
    """A reference answer that can verify a response: the task's answer text (a ``str`` for every other
    consumer), with the reasoning-gym entry it came from and the dataset whose verifier scores it."""

    entry: dict
    dataset: Any

    def __new__(cls, text: str, entry: dict, dataset: Any) -> "TaskAnswer":
        obj = super().__new__(cls, text)
        obj.entry, obj.dataset = entry, dataset
        return obj

    def __reduce__(self):  # pickles with its entry and dataset (async rollouts, copies)
        return TaskAnswer, (str(self), self.entry, self.dataset)

    def verify(self, answer: Optional[str]) -> float:
        """The task's score for ``answer`` (the text a response gives as its answer), in [0, 1]."""
        return float(self.dataset.score_answer(answer=answer, entry=self.entry))


def _require_reasoning_gym(source: str):
    try:
        import reasoning_gym
    except ImportError:
        raise DataError(f"data.source={source!r} needs the reasoning-gym package: pip install -e .[tasks] "
                        "(or pip install reasoning-gym)") from None
    return reasoning_gym


class ReasoningGymTask(Task):
    """A reasoning-gym dataset as an infinite, random-access :class:`Task` (prompt = the question)."""

    def __init__(self, task: str, seed: int = 1234, size: int = 100_000, **task_kwargs: Any) -> None:
        super().__init__(seed)
        source = PREFIX + task
        rg = _require_reasoning_gym(source)
        from reasoning_gym.factory import DATASETS

        if task not in DATASETS:
            raise DataError(f"data.source={source!r}: reasoning-gym has no task {task!r}; its tasks: "
                            f"{', '.join(sorted(DATASETS))}")
        self.name, self.task_kwargs = task, dict(task_kwargs)
        config_cls = DATASETS[task][1]
        fields = [f.name for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")]
        unknown = sorted(set(task_kwargs) - set(fields))
        if unknown:
            raise DataError(f"data.task_kwargs: {unknown} are not settings of reasoning-gym's {task!r} task; its "
                            f"settings: {fields}")
        try:
            # size bounds the indices the dataset serves: the training epoch plus any held-out examples past it
            self.dataset = rg.create_dataset(task, seed=seed, size=size, **task_kwargs)
        except (AssertionError, ValueError, TypeError) as e:  # the task's own config validation
            raise DataError(f"data.task_kwargs={task_kwargs!r} for reasoning-gym's {task!r} task: {e}") from None

    def _generate(self, rng):  # pragma: no cover - __getitem__ is overridden: reasoning-gym draws itself
        raise NotImplementedError

    def __getitem__(self, index: int) -> dict:
        if not isinstance(index, int) or index < 0:
            raise IndexError(f"{self.name} task index must be a non-negative integer, got {index!r}")
        if index >= len(self.dataset):
            raise IndexError(f"{PREFIX}{self.name}: index {index} is past the {len(self.dataset)} examples the "
                             "dataset was built for")
        entry = self.dataset[index]
        return {"prompt": entry["question"], "answer": TaskAnswer(str(entry["answer"]), entry, self.dataset),
                "id": f"{self.name}-{self.seed}-{index}"}


def build_reasoning_gym_task(source: str, seed: int, num_examples: int, task_kwargs: dict) -> ReasoningGymTask:
    """The task ``data.source=reasoning_gym:<task>`` names; room for one epoch and as many held-out examples."""
    task = source[len(PREFIX):]
    if not task:
        raise DataError(f"data.source={source!r}: name a task, e.g. reasoning_gym:chain_sum")
    return ReasoningGymTask(task, seed=seed, size=2 * num_examples, **task_kwargs)
