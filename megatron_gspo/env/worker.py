"""The environment handler of the worker pool (runtime/workers.py): runs tools and environments.

User code (a tool function, an environment class) runs in a worker process, never in a trainer rank: the
pool kills the worker's process group when a request outlives ``env.tool_timeout_s`` or when a stop signal
asks the trainer to leave the step, and a crash there is an error message, not a dead rank.

Requests (payloads) and what ``handle`` returns::

    {"op": "call", "path": "module:function", "arguments": {...}}   -> "<result as text>"
    {"op": "new", "id": k, "path": "module:Class", "kwargs": {...}} -> None
    {"op": "reset", "id": k, "example": {...}}                      -> "<first user message>"
    {"op": "step", "id": k, "response": "..."}                      -> [observation, reward, done]
    {"op": "close", "id": k}                                        -> None

or the pool's error reply when the user code raised or returned something else than the protocol says
(env/protocol.py checks a step's result). A tool's result and a step's observation are cut at
``max_result_bytes`` (env/pool.py: result_byte_limit) here, before they cross the pipe: a tool that returns 20 MB sends
at most that, and the rollout cuts it again to ``env.max_observation_tokens``, which the policy reads and
the dump stores.
"""

from __future__ import annotations

import json

from megatron_gspo.env.pool import MIN_RESULT_BYTES

def cut_text(text: str, max_bytes: int) -> str:
    """``text``'s first ``max_bytes`` bytes of UTF-8 (a character split by the cut left out)."""
    raw = text.encode("utf-8", errors="surrogatepass")
    if len(raw) <= max_bytes:
        return text
    return raw[:max_bytes].decode("utf-8", errors="ignore")


def _result_text(value) -> str:
    """A tool's return value as the text the model reads: a string as it is, anything else as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


class EnvHandler:
    """The objects a worker process holds: imported tools by path, environments by id."""

    def __init__(self, max_result_bytes: int = MIN_RESULT_BYTES) -> None:
        self.max_bytes = int(max_result_bytes)
        self.functions: dict = {}
        self.envs: dict = {}

    def _function(self, path: str):
        from megatron_gspo.env.tools import import_object

        if path not in self.functions:
            self.functions[path] = import_object(path, "env.tools")
        return self.functions[path]

    def __call__(self, req: dict, note=None):
        from megatron_gspo.env.protocol import check_reset, check_step
        from megatron_gspo.env.tools import bind_arguments, import_object

        op = req["op"]
        if op == "call":
            fn = self._function(req["path"])
            bound = bind_arguments(fn, req["arguments"])
            return cut_text(_result_text(fn(*bound.args, **bound.kwargs)), self.max_bytes)
        if op == "new":
            cls = import_object(req["path"], "env.name")
            self.envs[req["id"]] = cls(**req["kwargs"])
            return None
        if op == "reset":
            return check_reset(self.envs[req["id"]].reset(req["example"]), req["path"])
        if op == "step":
            obs, reward, done = check_step(self.envs[req["id"]].step(req["response"]), req["path"])
            return [None if obs is None else cut_text(obs, self.max_bytes), reward, done]
        if op == "close":
            self.envs.pop(req["id"], None)
            return None
        raise ValueError(f"unknown request {op!r}")
