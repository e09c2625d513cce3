"""The environment interface users write against, and the two environments a job runs: tools, or a class.

An environment (``env.name: package.module:Class``, built with ``env.kwargs`` once per row) has two
methods, the shape NeMo-RL's ``EnvironmentInterface.step``, SkyRL-gym's and TRL's
``environment_factory`` share::

    reset(example: dict) -> str                # the first user message; example: {"id", "prompt", "answer"}
    step(response: str) -> (observation, reward, done)

``step`` gets the text of each sampled assistant turn (its stop token left out) and returns a tuple or an
object with those three attributes: ``observation`` the text said back (a user turn; None: nothing),
``reward`` a number or None (None until the end; the rewards a row gets are summed, and a row that got
none is scored by ``reward.name`` on its last response), ``done`` whether the conversation is over.

Tools are the environment that runs the calls it finds (``ToolRunner``, ``env.tools``): a response
without a tool call ends the row (``reward.name`` scores it); each call runs in the worker pool and its
result, or an error message, is the next turn's observation (a ``tool`` turn). Environments run in the
worker pool too (``ClassRunner``: each row's object lives in one worker process), so user code never runs
in a trainer rank and ``env.tool_timeout_s`` bounds every call.

Both runners work on a batch: ``reset(examples)`` and ``step(responses, rows)`` for every row still
talking, so the calls of all rows run side by side.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Callable, Optional

from megatron_gspo.data.rewards.batch import reward_number
from megatron_gspo.env.calls import parse_tool_calls
from megatron_gspo.env.pool import Reply, Request, WorkerPool, result_byte_limit
from megatron_gspo.env.tools import Tool
from megatron_gspo.errors import EnvError, clip_repr


# A reward float32 can hold (the rewards are float32 tensors; a larger one would be inf there), as for reward.name
def _settled(value):
    """``value``, or what it resolves to when it is awaitable (an ``async def`` reset / step): run to its end here."""
    if inspect.isawaitable(value):
        import asyncio

        async def result():
            return await value

        return asyncio.run(result())
    return value


def reward_value(raw) -> tuple[Optional[float], Optional[str]]:
    """(a step's reward as a float or None, None) or (None, what is wrong with it): None (no reward this step), or
    a number by the rule reward functions follow (data/rewards/batch.py ``reward_number``)."""
    if raw is None:
        return None, None
    value, problem = reward_number(raw)
    return value, None if problem is None else f"returned reward {problem}"


def check_reset(value, path: str) -> str:
    """``reset``'s return value (awaited when it is a coroutine), checked: a non-empty string."""
    value = _settled(value)
    if not isinstance(value, str) or not value:
        raise TypeError(f"{path}.reset() returned {type(value).__name__} {str(value)[:60]!r}; it must return the "
                        "first user message as a non-empty string")
    return value


def check_step(value, path: str) -> tuple[Optional[str], Optional[float], bool]:
    """``step``'s return value (awaited when it is a coroutine) as (observation, reward, done): a 3-tuple or an
    object with those attributes; the reward a finite float32 number or None (reward_value)."""
    value = _settled(value)
    if isinstance(value, (tuple, list)) and len(value) == 3:
        obs, reward, done = value
    elif all(hasattr(value, a) for a in ("observation", "reward", "done")):
        obs, reward, done = value.observation, value.reward, value.done
    else:
        raise TypeError(f"{path}.step() returned {type(value).__name__}; it must return (observation, reward, done) "
                        "or an object with those attributes")
    if obs is not None and not isinstance(obs, str):
        raise TypeError(f"{path}.step(): observation must be a string or None, got {type(obs).__name__}")
    reward, problem = reward_value(reward)
    if problem is not None:
        raise ValueError(f"{path}.step() {problem}")
    if not isinstance(done, bool) and type(done).__name__ != "bool_":  # numpy's bool too
        raise TypeError(f"{path}.step(): done must be True or False, got {done!r}")
    return obs, reward, bool(done)


@dataclass
class StepResult:
    """What one row's environment said after a turn. ``observation``: the messages to append ([{"role",
    "content"}]) or None; ``tool_calls``: [{"name", "arguments", "result" | "error"}] of the turn;
    ``tool_errors``: how many of them failed (raised, timed out, malformed, unknown); ``error``: the
    environment itself failed (its row ends), ``error_kind`` what failed (the exception's type, "timeout",
    "lost"): the log says the first error of each kind."""

    observation: Optional[list] = None
    reward: Optional[float] = None
    done: bool = False
    tool_calls: list = field(default_factory=list)
    tool_errors: int = 0
    error: Optional[str] = None
    error_kind: Optional[str] = None


def first_message(example: dict) -> str:
    """The first user message of a data example: a string prompt, or the last user message of chat messages."""
    prompt = example["prompt"]
    if isinstance(prompt, str):
        return prompt
    users = [m["content"] for m in prompt if m.get("role") == "user"]
    return users[-1] if users else prompt[-1]["content"]


def _failure(reply: Reply, what: str, timeout_s: float) -> str:
    if reply.timeout:
        return f"{what} did not answer within {timeout_s:g} s (env.tool_timeout_s)"
    if reply.lost:
        return f"{what} was lost: its worker process was killed by an earlier timeout"
    return f"{what} failed: {reply.error}"


class ToolRunner:
    """The tool environment (module doc). tools: {name: Tool}; tool_format: how calls are written
    (env/calls.py); end_on_error: a failed call ends the row (env.on_tool_error=end) instead of being
    answered with its error message."""

    def __init__(self, tools: dict[str, Tool], pool: WorkerPool, tool_format: str, timeout_s: float,
                 end_on_error: bool = False) -> None:
        self.tools, self.pool, self.tool_format = tools, pool, tool_format
        self.timeout_s, self.end_on_error = timeout_s, end_on_error
        # the plain format writes a one-parameter tool's value bare: (its name, its JSON type)
        self.single = {n: (next(iter(t.parameters["properties"].items())) if len(t.parameters["properties"]) == 1
                           else None) for n, t in tools.items()}
        self.single = {n: (p[0], p[1].get("type")) if p else None for n, p in self.single.items()}

    def schemas(self) -> list:
        return [t.schema() for t in self.tools.values()]

    def reset(self, examples: list[dict], should_stop: Optional[Callable[[], bool]] = None) -> list[str]:
        return [first_message(ex) for ex in examples]

    def step(self, responses: list[str], rows: list[int],
             should_stop: Optional[Callable[[], bool]] = None) -> list[StepResult]:
        calls = [parse_tool_calls(text, self.tool_format, self.single) for text in responses]
        requests, where = [], []
        for r, row_calls in enumerate(calls):
            for c, call in enumerate(row_calls):
                if call.error is None and call.name in self.tools:
                    requests.append(Request({"op": "call", "path": self.tools[call.name].path,
                                             "arguments": call.arguments}))
                    where.append((r, c))
        replies = dict(zip(where, self.pool.run(requests, self.timeout_s, should_stop))) if requests else {}
        return [self._result(row_calls, {c: rep for (r2, c), rep in replies.items() if r2 == r})
                for r, row_calls in enumerate(calls)]

    def _result(self, calls: list, replies: dict) -> StepResult:
        """One row's turn: no call ends it; else each call's result or error message, one tool turn each."""
        if not calls:
            return StepResult(done=True)
        out, messages, errors = [], [], 0
        for c, call in enumerate(calls):
            entry = {"name": call.name, "arguments": call.arguments}
            if call.name is not None and call.name not in self.tools:
                entry["error"] = f"there is no tool {clip_repr(call.name, 80)}; the tools are {', '.join(self.tools)}"
            elif call.error is not None:
                entry["error"] = call.error
            elif not replies[c].ok:
                entry["error"] = _failure(replies[c], f"the tool {call.name!r}", self.timeout_s)
                if replies[c].where:
                    entry["where"] = replies[c].where
            else:
                entry["result"] = replies[c].value
            errors += "error" in entry
            messages.append({"role": "tool", "content": entry.get("result", f"error: {entry.get('error')}")})
            out.append(entry)
        if errors and self.end_on_error:
            return StepResult(done=True, tool_calls=out, tool_errors=errors)
        return StepResult(observation=messages, tool_calls=out, tool_errors=errors)

    def end(self, rows: list[int]) -> None:
        pass


class ClassRunner:
    """Environments of a class (``env.name``), one object per row in a worker process (row r: worker
    r mod env.num_workers). path: ``module:Class``; kwargs: env.kwargs."""

    def __init__(self, path: str, kwargs: dict, pool: WorkerPool, timeout_s: float) -> None:
        self.path, self.kwargs, self.pool, self.timeout_s = path, dict(kwargs), pool, timeout_s
        self.generations: dict[int, int] = {}  # row -> the worker process generation holding its environment

    def schemas(self) -> list:
        return []

    def _worker(self, row: int) -> int:
        return row % len(self.pool.slots)

    def reset(self, examples: list[dict], should_stop: Optional[Callable[[], bool]] = None) -> list[str]:
        """Build every row's environment and reset it: the first messages. A constructor or a reset that fails is
        the environment's bug: EnvError, naming it (every row needs a first message)."""
        rows = list(range(len(examples)))
        made = self.pool.run([Request({"op": "new", "id": r, "path": self.path, "kwargs": self.kwargs}, self._worker(r))
                              for r in rows], self.timeout_s, should_stop)
        self.generations = {r: rep.generation for r, rep in zip(rows, made)}
        first = self.pool.run([Request({"op": "reset", "id": r, "path": self.path, "example": ex}, self._worker(r),
                                       self.generations[r]) for r, ex in zip(rows, examples)],
                              self.timeout_s, should_stop)
        for what, replies in ((f"env.name: {self.path}(**env.kwargs)", made), (f"env.name: {self.path}.reset()", first)):
            bad = next((rep for rep in replies if not rep.ok), None)
            if bad is not None:
                raise EnvError(_failure(bad, what, self.timeout_s))
        return [rep.value for rep in first]

    def step(self, responses: list[str], rows: list[int],
             should_stop: Optional[Callable[[], bool]] = None) -> list[StepResult]:
        replies = self.pool.run([Request({"op": "step", "id": r, "path": self.path, "response": text}, self._worker(r),
                                         self.generations.get(r, -1)) for text, r in zip(responses, rows)],
                                self.timeout_s, should_stop)
        out = []
        for r, rep in zip(rows, replies):
            if not rep.ok:
                kind = "timeout" if rep.timeout else "lost" if rep.lost else str(rep.error).partition(":")[0]
                where = f" (at {rep.where})" if rep.where else ""
                out.append(StepResult(done=True, error=_failure(rep, f"{self.path}.step() of row {r}", self.timeout_s)
                                      + where, error_kind=kind))
                continue
            obs, reward, done = rep.value
            out.append(StepResult(observation=None if obs is None else [{"role": "user", "content": obs}],
                                  reward=reward, done=done))
        return out

    def end(self, rows: list[int]) -> None:
        """Free the rows' environments (their workers drop them)."""
        live = [r for r in rows if r in self.generations]
        self.pool.run([Request({"op": "close", "id": r}, self._worker(r), self.generations.pop(r)) for r in live],
                      self.timeout_s)


def build_runner(env_cfg, tool_format: str):
    """The runner of ``env_cfg`` (the env section): the tool environment or env.name's class, with its worker pool.
    The tools and the class are imported here (their schemas, a clear error for a bad name at start-up)."""
    from megatron_gspo.config.env import TOOLS_ENV
    from megatron_gspo.env.tools import import_object, load_tools

    pool = WorkerPool(env_cfg.num_workers, result_byte_limit(env_cfg.max_observation_tokens))
    end = env_cfg.on_tool_error == "end"
    if env_cfg.name == TOOLS_ENV:
        return ToolRunner(load_tools(env_cfg.tools), pool, tool_format, env_cfg.tool_timeout_s, end_on_error=end)
    cls = import_object(env_cfg.name, "env.name")
    if not isinstance(cls, type) or not all(callable(getattr(cls, m, None)) for m in ("reset", "step")):
        raise EnvError(f"env.name: {env_cfg.name!r} is not a class with reset(example) and step(response) methods")
    _check_kwargs(cls, env_cfg.name, env_cfg.kwargs)
    return ClassRunner(env_cfg.name, env_cfg.kwargs, pool, env_cfg.tool_timeout_s)


def _check_kwargs(cls: type, path: str, kwargs: dict) -> None:
    """env.kwargs against the class's signature, at start-up: a misspelt or missing argument is said before the warm
    start and the first rollout, not when the first row's environment is built in a worker."""
    try:
        sig = inspect.signature(cls)
    except (TypeError, ValueError):  # no signature to read (a C extension's class): the worker will say it
        return
    try:
        sig.bind(**kwargs)
    except TypeError as e:
        params = ", ".join(str(p.replace(annotation=inspect.Parameter.empty)) for p in sig.parameters.values())
        raise EnvError(f"env.kwargs={kwargs!r} do not fit {path}({params}): {e}") from None
