"""An environment worker process (``python -m megatron_gspo.env.worker``): runs tools and environments.

User code (a tool function, an environment class) runs here, never in a trainer rank: the parent
(env/pool.py) kills this process when a request outlives ``env.tool_timeout_s`` or when a stop signal
asks the trainer to leave the step, and a crash here is an error message, not a dead rank. The process
ignores the stop signals (the trainer decides), runs in its own session and exits at the end of its
input, however the parent ends.

Protocol: one JSON object per line. The first line out is ``{"ready": true}``. Requests and replies::

    {"op": "call", "path": "module:function", "arguments": {...}}   -> {"ok": "<result as text>"}
    {"op": "new", "id": k, "path": "module:Class", "kwargs": {...}} -> {"ok": null}
    {"op": "reset", "id": k, "example": {...}}                      -> {"ok": "<first user message>"}
    {"op": "step", "id": k, "response": "..."}                      -> {"ok": [observation, reward, done]}
    {"op": "close", "id": k}                                        -> {"ok": null}

or ``{"error": "<type>: <message>", "where": "<file>:<line>"}`` when the user code raised or returned something else than the
protocol says (env/protocol.py checks a step's result).
"""

from __future__ import annotations

import json
import signal
import sys
import traceback


def _result_text(value) -> str:
    """A tool's return value as the text the model reads: a string as it is, anything else as JSON."""
    if isinstance(value, str):
        return value
    try:
        return json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        return str(value)


class Worker:
    """The objects this process holds: imported tools by path, environments by id."""

    def __init__(self) -> None:
        self.functions: dict = {}
        self.envs: dict = {}

    def _function(self, path: str):
        from megatron_gspo.env.tools import import_object

        if path not in self.functions:
            self.functions[path] = import_object(path, "env.tools")
        return self.functions[path]

    def handle(self, req: dict):
        from megatron_gspo.env.protocol import check_reset, check_step
        from megatron_gspo.env.tools import bind_arguments, import_object

        op = req["op"]
        if op == "call":
            fn = self._function(req["path"])
            bound = bind_arguments(fn, req["arguments"])
            return _result_text(fn(*bound.args, **bound.kwargs))
        if op == "new":
            cls = import_object(req["path"], "env.name")
            self.envs[req["id"]] = cls(**req["kwargs"])
            return None
        if op == "reset":
            return check_reset(self.envs[req["id"]].reset(req["example"]), req["path"])
        if op == "step":
            return list(check_step(self.envs[req["id"]].step(req["response"]), req["path"]))
        if op == "close":
            self.envs.pop(req["id"], None)
            return None
        raise ValueError(f"unknown request {op!r}")


def _error_reply(e: BaseException) -> dict:
    """``{"error": "Type: message", "where": file:line}``: where in the user's code it was raised (the last frame
    outside this package; the model reads the message, the rollout record keeps both)."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if "megatron_gspo/env/" not in f.filename.replace("\\", "/")]
    return {"error": f"{type(e).__name__}: {e}", "where": f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None}


def main() -> None:
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    worker = Worker()
    out = sys.stdout
    sys.stdout = sys.stderr  # a tool that prints must not write into the protocol
    print(json.dumps({"ready": True}), file=out, flush=True)
    for line in sys.stdin:
        try:
            reply = {"ok": worker.handle(json.loads(line))}
        except BaseException as e:  # noqa: BLE001 (user code: SystemExit and all, reported to the parent)
            reply = _error_reply(e)
        try:
            text = json.dumps(reply, ensure_ascii=False)
        except (TypeError, ValueError) as e:
            text = json.dumps({"error": f"the reply cannot be sent as JSON: {e}"})
        print(text, file=out, flush=True)


if __name__ == "__main__":
    main()
