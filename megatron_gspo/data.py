"""Prompt data: datasets (built-in tasks, JSONL, Parquet) and a resumable batch sampler.

RL post-training consumes prompts, not token streams: each step takes P prompts, samples G responses
for each, and scores them against the prompt's reference answer. So a data source here is a list of
``(prompt, answer)`` examples, and :class:`PromptSampler` hands out P of them per step.

Resuming must continue with exactly the prompts the interrupted run would have seen next, or a
resumed run is a different experiment. The sampler's whole state is therefore two integers
(``epoch``, ``position`` in that epoch's order) plus counters: the order of an epoch is a pure
function of ``(seed, epoch)``, built-in tasks regenerate any example from its index, and file
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
import os
import random
from dataclasses import dataclass
from typing import Any, Iterator, Optional, Sequence, Union

from megatron_gspo.config import DataConfig
from megatron_gspo.errors import DataError, TokenizerError
from megatron_gspo.tasks import Task, build_task
from megatron_gspo.tokenizer import Tokenizer

BUILTIN_PREFIX = "builtin:"


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

    def __init__(self, examples: Union[Sequence[PromptExample], Task], source: str, size: Optional[int] = None) -> None:
        if isinstance(examples, Task):
            if size is None or size <= 0:
                raise DataError(f"{source}: a built-in task needs a positive number of examples per epoch, got {size}")
            self._task: Optional[Task] = examples
            self._examples: Sequence[PromptExample] = ()
            self._size = size
        else:
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
            ex = self._task[index]
            return PromptExample(id=ex["id"], prompt=ex["prompt"], answer=ex["answer"], where=f"{self.source}[{index}]")
        return self._examples[index]

    # -- constructors ---------------------------------------------------------------------------

    @classmethod
    def from_task(cls, task: Task, num_examples: int) -> "PromptDataset":
        return cls(task, source=f"{BUILTIN_PREFIX}{task.name}", size=num_examples)

    @classmethod
    def from_jsonl(cls, path: str, prompt_key: str = "prompt", answer_key: Optional[str] = "answer") -> "PromptDataset":
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data file not found: {path}")
        examples = []
        with open(path, encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue  # blank lines (a trailing newline, hand-edited files) are not records
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as e:
                    raise DataError(f"{where}: invalid JSON ({e.msg} at column {e.colno})") from None
                examples.append(_to_example(record, where, f"{os.path.basename(path)}:{lineno}", prompt_key, answer_key))
        return cls(examples, source=path)

    @classmethod
    def from_parquet(cls, path: str, prompt_key: str = "prompt", answer_key: Optional[str] = "answer") -> "PromptDataset":
        if not os.path.isfile(path):
            raise FileNotFoundError(f"data file not found: {path}")
        try:
            import pyarrow.parquet as pq
        except ImportError:
            raise DataError(f"{path}: reading Parquet needs pyarrow (pip install pyarrow), or convert it to .jsonl") from None
        table = pq.read_table(path)
        for key in (prompt_key, answer_key):
            if key is not None and key.split(".")[0] not in table.column_names:
                raise DataError(f"{path}: no column {key.split('.')[0]!r} (for {key!r}); columns: {table.column_names}")
        examples = [
            _to_example(record, f"{path}: row {row}", f"{os.path.basename(path)}:{row}", prompt_key, answer_key)
            for row, record in enumerate(table.to_pylist())
        ]
        return cls(examples, source=path)

    @classmethod
    def from_config(cls, cfg: DataConfig) -> "PromptDataset":
        src = cfg.source
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
                raise DataError(f"data.source={src!r}: {e} (set by the data.task_* options)") from None
            return cls.from_task(task, cfg.task_num_examples)
        if src.endswith(".jsonl"):
            return cls.from_jsonl(src, cfg.prompt_key, cfg.answer_key)
        if src.endswith(".parquet"):
            return cls.from_parquet(src, cfg.prompt_key, cfg.answer_key)
        raise DataError(
            f"data.source={src!r}: expected builtin:<task> (arithmetic, sort) or a path ending in .jsonl or .parquet"
        )


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
    if not found or prompt is None:
        raise DataError(f"{where}: missing field {prompt_key!r} (data.prompt_key); fields: {sorted(record)}")
    if isinstance(prompt, list):
        if not prompt or not all(isinstance(m, dict) and "role" in m and "content" in m for m in prompt):
            raise DataError(f"{where}: field {prompt_key!r} is a list but not chat messages [{{'role', 'content'}}, ...]")
    elif not isinstance(prompt, str):
        raise DataError(f"{where}: field {prompt_key!r} must be a string or a list of chat messages, "
                        f"got {type(prompt).__name__}")
    answer: Optional[str] = None
    if answer_key:
        found, value = _lookup(record, answer_key)
        if not found or value is None:
            raise DataError(f"{where}: missing field {answer_key!r} (data.answer_key; set it to null for data "
                            f"without answers); fields: {sorted(record)}")
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
    tokens, left-truncated when ``truncated``. Reward functions get ``text`` and ``answer``.
    """

    id: str
    text: str
    ids: list[int]
    answer: Optional[str]
    truncated: bool = False


class PromptSampler:
    """Yields batches of ``batch_size`` tokenized prompts, epoch after epoch, resumably."""

    def __init__(self, dataset: PromptDataset, tokenizer: Tokenizer, cfg: DataConfig, batch_size: int) -> None:
        if not isinstance(batch_size, int) or batch_size <= 0:
            raise DataError(f"prompts per batch must be a positive integer, got {batch_size!r}")
        self.dataset, self.tokenizer, self.cfg, self.batch_size = dataset, tokenizer, cfg, batch_size
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
        limit = cfg.max_prompt_length
        if len(ids) <= limit:
            return Prompt(id=example.id, text=text, ids=ids, answer=example.answer)
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
        return Prompt(id=example.id, text=text, ids=ids, answer=example.answer, truncated=True)

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

    def load_state_dict(self, state: dict[str, Any], strict: bool = True) -> None:
        """Continue where ``state`` was taken. ``strict=False`` accepts a changed dataset/seed."""
        if strict:
            for key, now in (("dataset_size", len(self.dataset)), ("seed", self.cfg.seed), ("shuffle", self.cfg.shuffle)):
                if key in state and state[key] != now:
                    raise DataError(
                        f"data sampler state has {key}={state[key]!r} but the current data has {key}={now!r}; "
                        "resuming would draw different prompts (load with strict=False to accept that)"
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

    A built-in task keeps its whole training epoch and holds out the examples just past it (indices
    len .. len + num - 1: generated from their index like the others, never drawn for training). A
    file gives up its last ``num`` records, which training then never sees."""
    if dataset._task is not None:
        held = [dataset._task[i] for i in range(len(dataset), len(dataset) + num)]
        return dataset, PromptDataset(
            [PromptExample(id=ex["id"], prompt=ex["prompt"], answer=ex["answer"], where=f"{dataset.source}[{i}]")
             for i, ex in zip(range(len(dataset), len(dataset) + num), held)],
            source=f"{dataset.source} (held out)")
    if num >= len(dataset):
        raise DataError(f"{dataset.source}: eval.num_prompts={num} held-out records leave none of its {len(dataset)} "
                        "for training; lower eval.num_prompts or give eval.source its own file")
    examples = list(dataset._examples)
    return (PromptDataset(examples[:-num], source=dataset.source),
            PromptDataset(examples[-num:], source=f"{dataset.source} (last {num} records, held out)"))


def build_prompt_sampler(cfg: DataConfig, tokenizer: Tokenizer, batch_size: int, holdout: int = 0) -> PromptSampler:
    """Dataset + sampler for a ``data:`` section; ``batch_size`` is prompts per step (P); ``holdout``:
    examples kept out of training for evaluation (split_holdout)."""
    dataset = PromptDataset.from_config(cfg)
    if holdout:
        dataset, _ = split_holdout(dataset, holdout)
    return PromptSampler(dataset, tokenizer, cfg, batch_size)


def build_eval_prompts(cfg: DataConfig, source: Optional[str], num: int, tokenizer: Tokenizer) -> list[Prompt]:
    """The held-out prompts of an evaluation: the first ``num`` of ``source`` (a file or builtin task,
    read like data.source), or, with source None, data.source's held-out split. Rendered and
    tokenized like training prompts (chat template, data.max_prompt_length policy: dropped ones are
    not replaced)."""
    if source is None:
        _, held = split_holdout(PromptDataset.from_config(cfg), num)
    else:
        import dataclasses

        full = PromptDataset.from_config(dataclasses.replace(cfg, source=source))
        held = PromptDataset([full[i] for i in range(min(num, len(full)))], source=source)
    encoder = PromptSampler(held, tokenizer, cfg, 1)
    return [p for p in (encoder.encode(held[i]) for i in range(len(held))) if p is not None]
