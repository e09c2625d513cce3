"""Prompt data: datasets (built-in tasks, reasoning-gym tasks, JSONL, Parquet) and a resumable batch sampler.

RL post-training consumes prompts, not token streams: each step takes P prompts, samples G responses
for each, and scores them against the prompt's reference answer. So a data source here is a list of
``(prompt, answer)`` examples, and :class:`PromptSampler` hands out P of them per step.

Resuming must continue with exactly the prompts the interrupted run would have seen next, or a
resumed run is a different experiment. The sampler's whole state is therefore two integers
(``epoch``, ``position`` in that epoch's order) plus counters: the order of an epoch is a pure
function of ``(seed, epoch)``, built-in and reasoning-gym tasks regenerate any example from its index, and file
datasets are read in full (their order is the file's). Every data-parallel rank builds the same
sampler and gets the same batches; the trainer slices its share.

Tokenization happens when a prompt is drawn (not at load time), so a large file does not need a
tokenizer pass before step 1, and prompts longer than ``max_prompt_length`` are handled by
``overlong_prompt_policy``: "drop" skips them (counted in ``num_dropped``), "truncate_left" keeps the
last tokens (the question and the generation prompt sit at the end; counted in ``num_truncated``),
"error" stops the job naming the example.
"""

from __future__ import annotations

import json
import logging
import os
import random
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Optional, Sequence, Union

from megatron_gspo.config import DataConfig
from megatron_gspo.errors import DataError, TokenizerError
from megatron_gspo.data.reasoning_gym_tasks import PREFIX as RG_PREFIX
from megatron_gspo.data.reasoning_gym_tasks import build_reasoning_gym_task
from megatron_gspo.data.tasks import TASKS, Task, build_task
from megatron_gspo.textfile import decode_line
from megatron_gspo.data.tokenizer import Tokenizer

BUILTIN_PREFIX = "builtin:"
# The examples of a task source checked before training (its reference answers): its first ones, this many
REFERENCE_SAMPLE = 1000
log = logging.getLogger("megatron_gspo")


# ----------------------------------------------------------------------------------------------
# Datasets
# ----------------------------------------------------------------------------------------------

Messages = list[dict[str, Any]]


@dataclass(frozen=True)
class PromptExample:
    """One raw example. ``where`` locates it for error messages (``file.jsonl:12``)."""

    id: str
    prompt: Union[str, Messages]
    answer: Optional[str]
    where: str


class PromptDataset(Sequence[PromptExample]):
    """A finite, indexable list of examples: loaded from a file, or a window of a built-in task."""

    def __init__(self, examples: Union[Sequence[PromptExample], Task], source: str, size: Optional[int] = None,
                 offset: int = 0) -> None:
        if isinstance(examples, Task):
            if size is None or size <= 0:
                raise DataError(f"{source}: a built-in task needs a positive number of examples per epoch, got {size}")
            self._task: Optional[Task] = examples
            self._examples: Sequence[PromptExample] = ()
            self._size = size
            # a window of the task: examples offset .. offset + size - 1 (a held-out set past the training epoch)
            self.offset, self._where = offset, source
        else:
            self.offset = 0
            self._task = None
            self._examples = list(examples)
            self._size = len(self._examples)
        self.source = source
        if self._size == 0:
            raise DataError(f"{source}: the dataset contains no examples")

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index: int) -> PromptExample:  # type: ignore[override]
        if not 0 <= index < self._size:
            raise IndexError(f"{self.source}: index {index} out of range for {self._size} examples")
        if self._task is not None:
            ex = self._task[self.offset + index]
            return PromptExample(id=ex["id"], prompt=ex["prompt"], answer=ex["answer"],
                                 where=f"{self._where}[{self.offset + index}]")
        return self._examples[index]

    @property
    def task(self) -> Optional[Task]:
        """The task a task source draws from (None for a file)."""
        return self._task

    def task_indices(self, limit: Optional[int] = None) -> range:
        """The task indices this dataset covers (its first ``limit``); empty for a file."""
        if self._task is None:
            return range(0)
        n = self._size if limit is None else min(self._size, limit)
        return range(self.offset, self.offset + n)

    def references(self, task_limit: int = REFERENCE_SAMPLE) -> list[tuple[str, Optional[str]]]:
        """(where, reference answer) of every record of a file, or of a built-in task's first
        ``task_limit`` examples (generated by the same code as the rest), for a check before training."""
        n = len(self) if self._task is None else min(len(self), task_limit)
        return [(ex.where, ex.answer) for ex in (self[i] for i in range(n))]

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_task(cls, task: Task, num_examples: int) -> "PromptDataset":
        return cls(task, source=f"{BUILTIN_PREFIX}{task.name}", size=num_examples)

    @classmethod
    def from_jsonl(cls, path: str, prompt_key: str = "prompt", answer_key: Optional[str] = "answer",
                   key: str = "data.source") -> "PromptDataset":
        _check_file(path, key)
        examples = []
        # Binary, line by line: a record ends at "\n" only (a "\r" inside one is JSON whitespace, not a
        # line break), and a byte that is not UTF-8 is reported with its line, not as a traceback.
        with open(path, "rb") as f:
            for lineno, raw in enumerate(f, start=1):
                line = decode_line(raw, path, lineno, DataError).rstrip("\r\n")
                if not line.strip():
                    continue  # blank lines (a trailing newline, hand-edited files) are not records
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:  # the line alone, without its newline: the column is the line's
                    raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
                examples.append(_to_example(record, where, f"{os.path.basename(path)}:{lineno}", prompt_key, answer_key))
        return cls(examples, source=path)

    @classmethod
    def from_parquet(cls, path: str, prompt_key: str = "prompt", answer_key: Optional[str] = "answer",
                     key: str = "data.source") -> "PromptDataset":
        _check_file(path, key)
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), or convert it to .jsonl") from None
        import pyarrow as pa

        try:  # a damaged, truncated or empty file (ArrowInvalid), or one pyarrow cannot read (OSError)
            table = pq.read_table(path)
            for name in (prompt_key, answer_key):
                if name is not None and name.split(".")[0] not in table.column_names:
                    raise DataError(f"{path}: no column {name.split('.')[0]!r} (for {name!r}); columns: "
                                    f"{table.column_names}")
            records = table.to_pylist()
        except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
            why = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise DataError(f"{path}: not a readable Parquet file ({why}); write it again (a file cut short, e.g. by an "
                            "interrupted copy, has no footer) or give a .jsonl") from None
        examples = [
            _to_example(record, f"{path}: row {row}", f"{os.path.basename(path)}:{row}", prompt_key, answer_key)
            for row, record in enumerate(records)
        ]
        return cls(examples, source=path)

    @classmethod
    def from_config(cls, cfg: DataConfig, source: Optional[str] = None, key: str = "data.source", holdout: int = 0,
                    task_kwargs: Optional[dict] = None) -> "PromptDataset":
        """The examples of ``source`` (default: data.source), read with the data section's keys and task
        knobs; errors name ``key``, the setting the source came from (eval.source for a held-out file).
        A reasoning-gym task has room for ``holdout`` examples past its epoch and takes ``task_kwargs``
        (default: data.task_kwargs)."""
        src = cfg.source if source is None else source
        if src.startswith(BUILTIN_PREFIX):
            name = src[len(BUILTIN_PREFIX):]
            knobs: dict[str, dict[str, Any]] = {
                "arithmetic": dict(num_digits=cfg.task_num_digits, operators=cfg.task_operators),
                "sort": dict(min_len=cfg.task_sort_min_len, max_len=cfg.task_sort_max_len,
                             max_value=cfg.task_sort_max_value),
            }
            try:
                task = build_task(name, seed=cfg.seed, **knobs.get(name, {}))
            except ValueError as e:  # name the config section, not only the task's own argument
                knob = " (set by the data.task_* options)" if name in TASKS else ""
                raise DataError(f"{key}={src!r}: {e}{knob}") from None
            return cls.from_task(task, cfg.task_num_examples)
        if src.startswith(RG_PREFIX):
            own = task_kwargs is not None and key != "data.source"
            task = build_reasoning_gym_task(src, cfg.seed, cfg.task_num_examples,
                                            cfg.task_kwargs if task_kwargs is None else task_kwargs, holdout=holdout,
                                            key="eval.task_kwargs" if own else "data.task_kwargs")
            return cls(task, source=src, size=cfg.task_num_examples)
        if src.endswith(".jsonl"):
            return cls.from_jsonl(src, cfg.prompt_key, cfg.answer_key, key=key)
        if src.endswith(".parquet"):
            return cls.from_parquet(src, cfg.prompt_key, cfg.answer_key, key=key)
        if os.path.isdir(src):
            raise DataError(f"{key}={src!r} is a directory; give a .jsonl or .parquet file, builtin:<task> "
                            f"({', '.join(sorted(TASKS))}) or reasoning_gym:<task>")
        raise DataError(
            f"{key}={src!r}: expected builtin:<task> ({', '.join(sorted(TASKS))}), reasoning_gym:<task> or a path "
            "ending in .jsonl or .parquet"
        )


def _check_file(path: str, key: str) -> None:
    if os.path.isdir(path):
        raise DataError(f"{key}={path!r} is a directory, not a data file")
    if not os.path.isfile(path):
        raise FileNotFoundError(f"data file not found: {path}" if key == "data.source" else
                                f"{key}: data file not found: {path}")


def _lookup(record: dict[str, Any], key: str) -> tuple[bool, Any]:
    """(found, value) for ``key``, following dots into nested objects when the flat key is absent."""
    if key in record:
        return True, record[key]
    node: Any = record
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return False, None
        node = node[part]
    return True, node


def _to_example(record: Any, where: str, default_id: str, prompt_key: str,
                answer_key: Optional[str]) -> PromptExample:
    if not isinstance(record, dict):
        raise DataError(f"{where}: expected a JSON object per record, got {type(record).__name__}")
    found, prompt = _lookup(record, prompt_key)
    if not found:
        raise DataError(f"{where}: missing field {prompt_key!r} (data.prompt_key); fields: {sorted(record)}")
    if prompt is None:
        raise DataError(f"{where}: field {prompt_key!r} (data.prompt_key) is null; every record needs a prompt "
                        "(remove or fix this record)")
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            raise DataError(f"{where}: field {prompt_key!r} is a list but not chat messages [{{'role', 'content'}}, ...]")
    elif not isinstance(prompt, str):
        raise DataError(f"{where}: field {prompt_key!r} must be a string or a list of chat messages, "
                        f"got {type(prompt).__name__}")
    elif not prompt.strip():  # nothing to condition on: refused here, not as an empty prompt at generation
        raise DataError(f"{where}: field {prompt_key!r} (data.prompt_key) is {'empty' if not prompt else 'only whitespace'}; "
                        "every record needs a prompt (remove or fix this record)")
    answer: Optional[str] = None
    if answer_key:
        found, value = _lookup(record, answer_key)
        if not found:
            raise DataError(f"{where}: missing field {answer_key!r} (data.answer_key; set it to null for data "
                            f"without answers); fields: {sorted(record)}")
        if value is None:
            raise DataError(f"{where}: field {answer_key!r} (data.answer_key) is null: the record has no reference "
                            "answer; give it one or remove the record (data.answer_key=null reads no answers at all, "
                            "for rewards that need none)")
        if isinstance(value, bool) or not isinstance(value, (str, int, float)):
            raise DataError(f"{where}: field {answer_key!r} must be a string or a number, got {type(value).__name__}")
        answer = value if isinstance(value, str) else str(value)
    rid = record.get("id")
    return PromptExample(id=str(rid) if isinstance(rid, (str, int)) else default_id, prompt=prompt,
                         answer=answer, where=where)


# ----------------------------------------------------------------------------------------------
# Sampler
# ----------------------------------------------------------------------------------------------


@dataclass
class Prompt:
    """A drawn, tokenized prompt.

    ``text`` is what the model is conditioned on (after the chat template), in full; ``ids`` are its
    tokens, left-truncated when ``truncated``. Reward functions get ``text`` and ``answer``. ``raw``: the
    example's prompt as the data gave it (a string or chat messages), what an environment's reset reads.
    """

    id: str
    text: str
    ids: list[int]
    answer: Optional[str]
    truncated: bool = False
    raw: Union[str, Messages, None] = None


class PromptSampler:
    """Yields batches of ``batch_size`` tokenized prompts, epoch after epoch, resumably."""

    def __init__(self, dataset: PromptDataset, tokenizer: Tokenizer, cfg: DataConfig, batch_size: int) -> None:
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise DataError(f"prompts per batch must be a positive integer, got {batch_size!r}")
        self.dataset, self.tokenizer, self.cfg, self.batch_size = dataset, tokenizer, cfg, batch_size
        if cfg.apply_chat_template:  # a missing or broken template is found now, not at the first prompt
            tokenizer.check_chat_template(required=True)
        self.epoch = 0
        self.position = 0
        self.num_prompts = 0  # prompts handed out
        self.num_dropped = 0
        self.num_truncated = 0
        self._order_cache: tuple[int, list[int]] = (-1, [])

    def _order(self, epoch: int) -> list[int]:
        if self._order_cache[0] != epoch:
            order = list(range(len(self.dataset)))
            if self.cfg.shuffle:
                # Seeded by a string (SHA-512 in Random): independent of PYTHONHASHSEED and of every
                # previous draw, so epoch e's order is known without replaying epochs 0..e-1.
                random.Random(f"data-shuffle:{self.cfg.seed}:{epoch}").shuffle(order)
            self._order_cache = (epoch, order)
        return self._order_cache[1]

    def encode(self, example: PromptExample) -> Optional[Prompt]:
        """Render and tokenize one example; None when the overlong policy drops it."""
        cfg, tok = self.cfg, self.tokenizer
        if not cfg.apply_chat_template and isinstance(example.prompt, list):
            raise DataError(f"{example.where}: the prompt is a list of chat messages; set data.apply_chat_template=true")
        try:
            if cfg.apply_chat_template:
                messages = (example.prompt if isinstance(example.prompt, list)
                            else [{"role": "user", "content": example.prompt}])
                text = tok.apply_chat_template(messages, add_generation_prompt=True, **cfg.chat_template_kwargs)
                ids = tok.encode(text, add_special_tokens=False)  # the template spells its own markers
            else:
                text = example.prompt
                ids = tok.encode(text, add_special_tokens=cfg.add_special_tokens)
        except TokenizerError as e:  # e.g. a character the built-in tokenizer lacks: say which example
            raise DataError(f"{example.where} (id {example.id}): {e}") from None
        if not ids:  # a tokenizer that maps the whole text to nothing: the model would have nothing to answer
            raise DataError(f"{example.where} (id {example.id}): the prompt {example.prompt!r:.60} tokenizes to no "
                            f"tokens ({type(tok).__name__}, data.add_special_tokens={cfg.add_special_tokens}); remove "
                            "or fix this record")
        limit = cfg.max_prompt_length
        if len(ids) <= limit:
            return Prompt(id=example.id, text=text, ids=ids, answer=example.answer, raw=example.prompt)
        if cfg.overlong_prompt_policy == "drop":
            self.num_dropped += 1
            return None
        if cfg.overlong_prompt_policy == "error":
            raise DataError(
                f"{example.where} (id {example.id}): prompt has {len(ids)} tokens > data.max_prompt_length={limit}; "
                "raise the limit or set data.overlong_prompt_policy to 'drop' or 'truncate_left'"
            )
        self.num_truncated += 1
        # Keep a leading BOS: models trained with one behave badly without it.
        keep_bos = tok.bos_id is not None and ids[0] == tok.bos_id and limit > 1
        ids = ([ids[0]] + ids[len(ids) - limit + 1:]) if keep_bos else ids[len(ids) - limit:]
        return Prompt(id=example.id, text=text, ids=ids, answer=example.answer, truncated=True, raw=example.prompt)

    def next_batch(self) -> list[Prompt]:
        batch: list[Prompt] = []
        dropped_in_a_row = 0
        while len(batch) < self.batch_size:
            order = self._order(self.epoch)
            example = self.dataset[order[self.position]]
            self.position += 1
            if self.position == len(order):
                self.epoch, self.position = self.epoch + 1, 0
            prompt = self.encode(example)
            if prompt is None:
                dropped_in_a_row += 1
                if dropped_in_a_row >= len(self.dataset):
                    raise DataError(
                        f"{self.dataset.source}: every example is longer than data.max_prompt_length="
                        f"{self.cfg.max_prompt_length} tokens and was dropped; raise the limit or use "
                        "data.overlong_prompt_policy=truncate_left"
                    )
                continue
            dropped_in_a_row = 0
            batch.append(prompt)
        self.num_prompts += len(batch)
        return batch

    def __iter__(self) -> Iterator[list[Prompt]]:
        while True:
            yield self.next_batch()

    def counters(self) -> dict[str, int]:
        """For logging: progress through the data and how many prompts the length policy touched."""
        return {"epoch": self.epoch, "position": self.position, "num_prompts": self.num_prompts,
                "num_dropped": self.num_dropped, "num_truncated": self.num_truncated}

    def state_dict(self) -> dict[str, Any]:
        # The dataset identity (size, seed, shuffle) is saved to refuse a resume that would silently
        # draw different prompts; the counters so logged totals continue instead of restarting.
        return {**self.counters(), "dataset_size": len(self.dataset), "seed": self.cfg.seed, "shuffle": self.cfg.shuffle}

    def load_state_dict(self, state: dict[str, Any], strict: bool = True,
                        accept: Callable[[str], bool] = lambda key: False) -> None:
        """Continue where ``state`` was taken. ``strict=False`` accepts a changed dataset/seed; ``accept``
        says which config keys (data.source for the dataset, data.seed, data.shuffle) may have changed
        (the trainer's: checkpoint.allow_config_change)."""
        if strict:
            for key, now, setting in (("dataset_size", len(self.dataset), "data.source"),
                                      ("seed", self.cfg.seed, "data.seed"), ("shuffle", self.cfg.shuffle, "data.shuffle")):
                if key in state and state[key] != now and not accept(setting):
                    raise DataError(
                        f"data sampler state has {key}={state[key]!r} but the current data has {key}={now!r}; "
                        "resuming would draw different prompts: resume with the data the checkpoint was written "
                        f"with, or accept the change with checkpoint.allow_config_change=[{setting}]"
                    )
        position, epoch = int(state["position"]), int(state["epoch"])
        if not 0 <= position < len(self.dataset) or epoch < 0:
            raise DataError(f"data sampler state epoch={epoch}, position={position} is out of range for "
                            f"{len(self.dataset)} examples")
        self.epoch, self.position = epoch, position
        self.num_prompts = int(state.get("num_prompts", 0))
        self.num_dropped = int(state.get("num_dropped", 0))
        self.num_truncated = int(state.get("num_truncated", 0))


def split_holdout(dataset: PromptDataset, num: int) -> tuple[PromptDataset, PromptDataset]:
    """(training set, ``num`` held-out examples) of one data source.

    A built-in or reasoning-gym task keeps its whole training epoch and holds out the examples just past it (indices
    len .. len + num - 1: generated from their index like the others, never drawn for training; whether their
    prompts differ from the training ones is another matter, checked by training_overlap). A file gives up its
    last ``num`` records, which training then never sees."""
    if dataset.task is not None:
        held = PromptDataset(dataset.task, source=f"{dataset.source} (past the training epoch)", size=num,
                             offset=dataset.offset + len(dataset))
        held._where = dataset._where
        return dataset, held
    if num >= len(dataset):
        raise DataError(f"{dataset.source}: eval.num_prompts={num} held-out records leave none of its {len(dataset)} "
                        "for training; lower eval.num_prompts or give eval.source its own file")
    examples = list(dataset._examples)
    return (PromptDataset(examples[:-num], source=dataset.source),
            PromptDataset(examples[-num:], source=f"{dataset.source} (last {num} records, held out)"))


def same_task(source: str, other: str) -> bool:
    """``source`` and ``other`` name the same task (``builtin:<task>`` or ``reasoning_gym:<task>``)."""
    return source == other and source.startswith((BUILTIN_PREFIX, RG_PREFIX))


def eval_task_kwargs(cfg: DataConfig, source: str, task_kwargs: Optional[dict]) -> Optional[dict]:
    """The settings of a ``reasoning_gym:<task>`` eval.source: eval.task_kwargs (``task_kwargs``); when that is
    null, data.task_kwargs for data.source's own task, the task's defaults for another. None for other sources."""
    if not source.startswith(RG_PREFIX):
        return None
    if task_kwargs is not None:
        return dict(task_kwargs)
    return dict(cfg.task_kwargs) if source == cfg.source else {}


def held_out_split(cfg: DataConfig, train: PromptDataset, source: Optional[str], num: int,
                   task_kwargs: Optional[dict] = None) -> tuple[PromptDataset, PromptDataset]:
    """(training set, the evaluation's ``num`` prompts) for eval.source ``source`` (eval.task_kwargs:
    ``task_kwargs``), ``train`` being data.source's dataset.

    * null: data.source's held-out split (split_holdout);
    * data.source's own task: its examples past the training epoch, never its first ones (which are the training
      epoch's first ones); with settings of its own (eval.task_kwargs), the same indices of that variant;
    * another task, or a file: its first ``num`` examples (a task's drawn with data.seed)."""
    if source is None:
        return split_holdout(train, num)
    kwargs = eval_task_kwargs(cfg, source, task_kwargs)
    if same_task(source, cfg.source) and (kwargs is None or kwargs == cfg.task_kwargs):
        return split_holdout(train, num)
    full = PromptDataset.from_config(cfg, source, key="eval.source", holdout=num, task_kwargs=kwargs)
    if full.task is None:
        return train, PromptDataset([full[i] for i in range(min(num, len(full)))], source=source)
    past = same_task(source, cfg.source)
    held = PromptDataset(full.task, source=f"{source} (past the training epoch)" if past else source, size=num,
                         offset=len(train) if past else 0)
    held._where = source
    return train, held


def build_prompt_sampler(cfg: DataConfig, tokenizer: Tokenizer, batch_size: int, holdout: int = 0) -> PromptSampler:
    """Dataset + sampler for a ``data:`` section; ``batch_size`` is prompts per step (P); ``holdout``:
    examples kept out of training for evaluation (split_holdout)."""
    dataset = PromptDataset.from_config(cfg, holdout=holdout)
    if holdout:
        dataset, _ = split_holdout(dataset, holdout)
    return PromptSampler(dataset, tokenizer, cfg, batch_size)


def _prompt_key(prompt: Union[str, Messages]) -> str:
    return prompt if isinstance(prompt, str) else json.dumps(prompt, sort_keys=True)


def training_overlap(train: PromptDataset, prompts: Sequence[Union[str, Messages]]) -> tuple[int, int]:
    """(how many of ``prompts`` are training prompts, how many training examples that covers): every record of a
    file, every example of a built-in task's epoch (made again, until each of ``prompts`` is found: a second
    for 100,000), and of a reasoning-gym task the examples made at start-up (its first data.task_num_examples
    or REFERENCE_SAMPLE: making them all could take hours)."""
    wanted = {_prompt_key(p) for p in prompts}
    task, made = train.task, getattr(train.task, "made", None)
    if task is None:
        seen, compared = {_prompt_key(ex.prompt) for ex in train._examples} & wanted, len(train)
    elif made is not None:  # reasoning-gym
        idx = train.task_indices()
        keys = [i for i in made if i in idx]
        seen, compared = {made[i]["question"] for i in keys} & wanted, len(keys)
    else:
        seen, compared = set(), len(train)
        for i in train.task_indices():
            if (key := _prompt_key(task[i]["prompt"])) in wanted:
                seen.add(key)
                if len(seen) == len(wanted):
                    break
    return sum(_prompt_key(p) in seen for p in prompts), compared


@dataclass
class HeldOutPrompts:
    """An evaluation's prompts, and how data.overlong_prompt_policy treated its records (counted like
    training prompts; the evaluator reports the counts with every evaluation). ``in_training``: how many of
    ``num_records`` are training prompts too, among the ``compared`` training examples of ``training``
    (training_overlap): such an evaluation does not measure held-out problems, and the log says so."""

    prompts: list[Prompt]
    source: str
    num_records: int  # held-out records read
    num_dropped: int
    num_truncated: int
    in_training: int = 0
    compared: int = 0
    training: int = 0

    def describe(self) -> str:
        """``64 held-out prompts from ...`` or, when some are training prompts, what they are instead."""
        n = len(self.prompts)
        if not self.in_training:
            return f"{n} held-out prompts from {self.source} (none among {self._compared()})"
        return f"{n} prompts from {self.source} ({self.in_training} of them training prompts too: not held out)"

    def _compared(self) -> str:
        if self.compared == self.training:
            return f"the {self.training} training examples"
        return f"the first {self.compared} of the {self.training} training examples, those made at start-up"


def encode_held_out(cfg: DataConfig, train: PromptDataset, held: PromptDataset, tokenizer: Tokenizer,
                    warn: bool = True) -> HeldOutPrompts:
    """``held`` rendered and tokenized like training prompts (chat template, data.max_prompt_length policy:
    dropped ones are not replaced, but counted and logged, and a set left empty is refused), and compared with
    ``train``'s prompts (training_overlap): those among them counted, and said (``warn``: by this rank)."""
    encoder = PromptSampler(held, tokenizer, cfg, 1)
    examples = [held[i] for i in range(len(held))]
    prompts = [p for p in (encoder.encode(ex) for ex in examples) if p is not None]
    overlap, compared = training_overlap(train, [ex.prompt for ex in examples])
    out = HeldOutPrompts(prompts, held.source, len(held), encoder.num_dropped, encoder.num_truncated,
                         overlap, compared, len(train))
    if not prompts:
        raise DataError(f"{held.source}: every one of the {len(held)} held-out prompts is longer than "
                        f"data.max_prompt_length={cfg.max_prompt_length} tokens and was dropped; raise the limit, use "
                        "data.overlong_prompt_policy=truncate_left, or give eval.source shorter prompts")
    if warn and (out.num_dropped or out.num_truncated):
        log.warning("evaluation: %d of %d held-out prompts dropped and %d left-truncated for exceeding "
                    "data.max_prompt_length=%d tokens (data.overlong_prompt_policy=%s); evaluating %d "
                    "(eval/dropped_prompts, eval/truncated_prompts)", out.num_dropped, len(held), out.num_truncated,
                    cfg.max_prompt_length, cfg.overlong_prompt_policy, len(prompts))
    if warn and overlap:
        log.warning("evaluation: %d of the %d prompts from %s are training prompts too (among %s): eval/* measures "
                    "problems the policy trains on, not held-out ones; give eval.source prompts of its own (a file, "
                    "or a task with more distinct problems)", overlap, len(held), held.source, out._compared())
    return out


def build_eval_prompts(cfg: DataConfig, source: Optional[str], num: int, tokenizer: Tokenizer,
                       task_kwargs: Optional[dict] = None) -> HeldOutPrompts:
    """The prompts of an evaluation: ``num`` of eval.source ``source`` (eval.task_kwargs: ``task_kwargs``), or of
    data.source's held-out split (held_out_split), encoded and compared with the training prompts
    (encode_held_out). (The trainer builds them with its training data: data/job_data.py.)"""
    train = PromptDataset.from_config(cfg, holdout=num)
    train, held = held_out_split(cfg, train, source, num, task_kwargs)
    return encode_held_out(cfg, train, held, tokenizer)
