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
``reward.name=reasoning_gym`` (data/rewards/reasoning_gym.py) scores a response with the task's own ``score_answer``. Some
tasks have no reference answer at all (``answer: None``: graph_color, boxnet, rubiks_cube, ...; only
their verifier can score): their TaskAnswer is the empty string with ``missing`` set, and the job's
data checks (data/job_data.py) refuse them for the warm start and for rewards that read the reference.

A task's settings are checked when it is built: unknown keys and a list given where the task takes a
value (or the other way round) are refused by key; a failure of the task itself, when it is built or
when it makes an example, is one line naming the task and its settings, never a traceback.
"""

from __future__ import annotations

import dataclasses
import re
import types
import typing
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

    @property
    def missing(self) -> bool:
        """The task gives no reference answer for this example (``answer: None``): only its verifier scores."""
        return self.entry.get("answer") is None

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


def reasoning_gym_version() -> str:
    import reasoning_gym

    return str(getattr(reasoning_gym, "__version__", "unknown"))


def _source_key(settings_key: str) -> str:
    """eval.source for an evaluation's own task (its settings: eval.task_kwargs), else data.source."""
    return settings_key.split(".")[0] + ".source"


def _one_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0]}" if text else type(e).__name__


# ----------------------------------------------------------------------------------------------
# The task's settings, checked against its reasoning-gym config class
# ----------------------------------------------------------------------------------------------


def _kind(tp: Any) -> Optional[str]:
    """"list", "mapping" or "value" for a config field's annotation; None when it says nothing usable."""
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in typing.get_args(tp) if a is not type(None)]
        return _kind(rest[0]) if len(rest) == 1 else None
    if tp in (list, tuple) or origin in (list, tuple) or getattr(origin, "__name__", "") == "Sequence":
        return "list"
    if tp is dict or origin is dict:
        return "mapping"
    if tp in (int, float, str, bool):
        return "value"
    return None


def _value_kind(value: Any) -> str:
    return "list" if isinstance(value, (list, tuple)) else "mapping" if isinstance(value, dict) else "value"


def _type_text(tp: Any) -> str:
    """An annotation for a message: ``int``, ``list[DatasetSpec], each a mapping of name, weight, config``."""
    if isinstance(tp, type):
        return tp.__name__
    text = re.sub(r"\b(?:[A-Za-z_]\w*\.)+([A-Za-z_]\w*)", r"\1", str(tp))
    (item,) = typing.get_args(tp)[:1] or (None,)
    if typing.get_origin(tp) is list and dataclasses.is_dataclass(item):
        text += f", each a mapping of {', '.join(f.name for f in dataclasses.fields(item))}"
    return text


def _spec_list(value: Any, tp: Any) -> Any:
    """A list of mappings for a ``list[<dataclass>]`` field (composite's ``datasets``) as those dataclasses:
    YAML has no other way to give them."""
    (item,) = typing.get_args(tp) or (None,)
    if typing.get_origin(tp) is list and dataclasses.is_dataclass(item) and isinstance(value, list):
        return [item(**v) if isinstance(v, dict) else v for v in value]
    return value


def task_settings(task: str, config_cls: type, settings: dict, key: str) -> dict:
    """``settings`` (``key``: data.task_kwargs / eval.task_kwargs) as reasoning-gym's ``config_cls`` takes
    them; a key it lacks, or a list where it takes a value (or the reverse), refused by name."""
    fields = {f.name: f for f in dataclasses.fields(config_cls) if f.name not in ("seed", "size")}
    unknown = sorted(set(settings) - set(fields))
    if unknown:
        raise DataError(f"{key}: {unknown} are not settings of reasoning-gym's {task!r} task; its "
                        f"settings: {list(fields)}")
    try:
        hints = typing.get_type_hints(config_cls)
    except Exception:  # an annotation that does not resolve: the task's own validation is all there is
        hints = {}
    out = {}
    for name, value in settings.items():
        tp, field = hints.get(name), fields[name]
        want = _kind(tp)
        default = field.default if field.default is not dataclasses.MISSING else None
        # (a task whose own default does not fit its annotation gets no such check for that field)
        if want and value is not None and _value_kind(value) != want and (default is None or _value_kind(default) == want):
            what = {"list": "a list", "mapping": "a mapping", "value": "a single value, not a list or mapping"}[want]
            raise DataError(f"{key}.{name}={value!r}: reasoning-gym's {task!r} task takes {what} there "
                            f"({config_cls.__name__}.{name}: {_type_text(tp)})")
        try:
            out[name] = _spec_list(value, tp)
        except TypeError as e:
            raise DataError(f"{key}.{name}={value!r}: reasoning-gym's {task!r} task cannot read it: "
                            f"{_one_line(e)}") from None
    return out


# ----------------------------------------------------------------------------------------------
# The task
# ----------------------------------------------------------------------------------------------


class ReasoningGymTask(Task):
    """A reasoning-gym dataset as a random-access :class:`Task` (prompt = the question) of ``size`` examples.

    ``key``: the setting its ``task_kwargs`` came from (data.task_kwargs, or eval.task_kwargs for an
    evaluation's own task), named by its errors. Examples made ahead (``made``: by the start-up's
    example cache, data/example_cache.py) are served from memory; the rest are made when asked for."""

    def __init__(self, task: str, seed: int = 1234, size: int = 100_000, key: str = "data.task_kwargs",
                 **task_kwargs: Any) -> None:
        super().__init__(seed)
        source = PREFIX + task
        rg = _require_reasoning_gym(source)
        from reasoning_gym.factory import DATASETS

        if task not in DATASETS:
            raise DataError(f"{_source_key(key)}={source!r}: reasoning-gym has no task {task!r}; its tasks: "
                            f"{', '.join(sorted(DATASETS))}")
        self.name, self.task_kwargs, self.key, self.size = task, dict(task_kwargs), key, size
        settings = task_settings(task, DATASETS[task][1], self.task_kwargs, key)
        try:
            # size bounds the indices the dataset serves: the training epoch plus any held-out examples past it
            self.dataset = rg.create_dataset(task, seed=seed, size=size, **settings)
        except (AssertionError, ValueError, TypeError) as e:  # the task's own config validation
            raise DataError(f"{key}={task_kwargs!r} for reasoning-gym's {task!r} task: {e}") from None
        except Exception as e:  # anything else the task raises on these settings: still one line, naming them
            raise DataError(f"{key}={task_kwargs!r} for reasoning-gym's {task!r} task: building it failed with "
                            f"{_one_line(e)}") from None
        self.made: dict[int, dict] = {}

    def _generate(self, rng):  # pragma: no cover - __getitem__ is overridden: reasoning-gym draws itself
        raise NotImplementedError

    @property
    def source(self) -> str:
        return PREFIX + self.name

    def identity(self) -> dict:
        """What the examples are a function of: the key of their cache file (data/example_cache.py)."""
        return {"task": self.name, "task_kwargs": self.task_kwargs, "seed": self.seed, "size": self.size,
                "reasoning_gym": reasoning_gym_version()}

    def make(self, index: int) -> dict:
        """reasoning-gym's entry ``index``, made now; a failure of the task is one line naming its settings."""
        try:
            return self.dataset[index]
        except Exception as e:
            raise DataError(f"{self.source}: making example {index} failed with {self.key}={self.task_kwargs!r}: "
                            f"{_one_line(e)}") from None

    def entry(self, index: int) -> dict:
        if not isinstance(index, int) or index < 0:
            raise IndexError(f"{self.name} task index must be a non-negative integer, got {index!r}")
        if index >= len(self.dataset):
            raise IndexError(f"{self.source}: index {index} is past the {len(self.dataset)} examples the "
                             "dataset was built for")
        made = self.made.get(index)
        return made if made is not None else self.make(index)

    def __getitem__(self, index: int) -> dict:
        entry = self.entry(index)
        answer = entry.get("answer")
        return {"prompt": entry["question"],
                "answer": TaskAnswer("" if answer is None else str(answer), entry, self.dataset),
                "id": f"{self.name}-{self.seed}-{index}"}


def build_reasoning_gym_task(source: str, seed: int, num_examples: int, task_kwargs: dict, holdout: int = 0,
                             key: str = "data.task_kwargs") -> ReasoningGymTask:
    """The task ``source`` (``reasoning_gym:<task>``) names; room for one epoch of ``num_examples`` and
    ``holdout`` held-out examples past it (at least as many as the epoch)."""
    task = source[len(PREFIX):]
    if not task:
        raise DataError(f"{_source_key(key)}={source!r}: name a task, e.g. reasoning_gym:chain_sum")
    return ReasoningGymTask(task, seed=seed, size=num_examples + max(num_examples, holdout), key=key, **task_kwargs)
