"""The environment worker pool: ``env.num_workers`` child processes (env/worker.py) that run tool calls and
environment steps side by side, each request with a deadline, all of them interruptible by a stop signal.

``run(requests, timeout_s, should_stop)`` hands every request to a worker (a request naming a worker,
``Request.worker``, waits for that one: an environment lives in the process that built it) and collects
the replies, one ``wait`` over the busy workers' pipes at a time:

* a request older than ``timeout_s`` is answered ``Reply(timeout=True)`` and its worker killed (a Python
  timer cannot stop a C call; the parent's clock can); the next request for that slot starts another
  process, and the environments the killed one held are gone (``Reply(lost=True)`` for them after);
* ``should_stop()`` is read at least every ``POLL_S`` seconds: once true, every busy worker is killed
  and ``run`` raises ``PoolStopped`` (the rollout then leaves the step: StepAbandoned), within a fraction
  of a second of the signal whatever a tool is doing;
* a worker that dies (a crash, ``os._exit``) answers its request with an error and is started again.

Workers start on first use and live for the job (``close()``, also at exit); their ``PYTHONPATH`` is this
process's ``sys.path``, so a tool module the trainer can import, they can import.
"""

from __future__ import annotations

import atexit
import json
import os
import subprocess
import sys
import time
from dataclasses import dataclass
from multiprocessing.connection import wait  # poll(2): no FD_SETSIZE limit, unlike select(2)
from typing import Callable, Optional

POLL_S = 0.1
# How long a new worker may take to start (a loaded 2-core machine: seconds); its first request's deadline
# starts after it.
STARTUP_TIMEOUT_S = 120.0


class PoolStopped(Exception):
    """A stop signal arrived while requests were running; every busy worker was killed."""


class WorkerStartError(RuntimeError):
    """A worker process did not start."""


@dataclass
class Request:
    """One request (env/worker.py's protocol); ``worker``: the slot that must run it, or None for any;
    ``generation``: for a pinned request other than "new", the process generation its environment was built
    in (``Reply.generation`` of that "new")."""

    payload: dict
    worker: Optional[int] = None
    generation: int = 0


@dataclass
class Reply:
    """``value`` (the request's ``ok``), or ``error`` (its message), ``timeout`` (killed at the deadline) or
    ``lost`` (its environment's worker was killed before); ``generation``: the answering process's."""

    value: object = None
    error: Optional[str] = None
    timeout: bool = False
    lost: bool = False
    generation: int = 0
    where: Optional[str] = None  # file:line of the user code that raised

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timeout and not self.lost


class _Slot:
    """One worker process and what it holds."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.generation = 0  # bumped at every start: environments built in an older process are lost
        self.busy: Optional[tuple[int, float]] = None  # (request index, its start time)


class WorkerPool:
    """``num_workers`` environment worker processes (module doc)."""

    def __init__(self, num_workers: int) -> None:
        if num_workers < 1:
            raise ValueError(f"WorkerPool needs at least one worker, got {num_workers}")
        self.slots = [_Slot() for _ in range(num_workers)]
        self.num_kills = 0
        atexit.register(self.close)

    # -- processes --------------------------------------------------------------------------------
    def _start(self, slot: _Slot) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path),
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "megatron_gspo.env.worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=None, env=env, text=True, bufsize=1,
                                start_new_session=True)
        ready = wait([proc.stdout], STARTUP_TIMEOUT_S)
        line = proc.stdout.readline() if ready else ""
        if line.strip() != json.dumps({"ready": True}):
            self._kill_proc(proc)
            raise WorkerStartError(f"an environment worker process did not start within {STARTUP_TIMEOUT_S:g} s "
                                   f"(it said {line.strip()[:200]!r})")
        slot.proc = proc
        slot.generation += 1

    @staticmethod
    def _kill_proc(proc: subprocess.Popen) -> None:
        proc.kill()
        proc.wait()

    def _kill(self, slot: _Slot) -> None:
        if slot.proc is not None:
            self._kill_proc(slot.proc)
            self.num_kills += 1
        slot.proc, slot.busy = None, None

    def close(self) -> None:
        for slot in self.slots:
            if slot.proc is not None and slot.proc.poll() is None:
                slot.proc.stdin.close()  # the worker exits at the end of its input
                try:
                    slot.proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._kill_proc(slot.proc)
            slot.proc, slot.busy = None, None

    # -- requests ---------------------------------------------------------------------------------
    def _dispatch(self, requests: list[Request], queue: list[int], replies: list) -> None:
        """Hand queued requests to idle workers (a pinned request only to its own, and only while the process
        that built its environment lives)."""
        for i in list(queue):
            req, want = requests[i], requests[i].worker
            if want is not None and req.payload["op"] != "new":
                slot = self.slots[want]
                if slot.proc is None or slot.proc.poll() is not None or slot.generation != req.generation:
                    replies[i] = Reply(lost=True)  # its environment lived in a process that is gone
                    queue.remove(i)
                    continue
            idle = [w for w, s in enumerate(self.slots) if s.busy is None and (want is None or w == want)]
            if not idle:
                continue
            slot = self.slots[idle[0]]
            if slot.proc is None or slot.proc.poll() is not None:
                self._start(slot)
            slot.proc.stdin.write(json.dumps(req.payload, ensure_ascii=False) + "\n")
            slot.proc.stdin.flush()
            slot.busy = (i, time.monotonic())
            queue.remove(i)

    def _collect(self, replies: list, timeout_s: float) -> None:
        """Read the replies that are ready (waiting at most POLL_S); answer and kill past their deadline."""
        busy = [s for s in self.slots if s.busy is not None]
        if not busy:
            return
        now = time.monotonic()
        timeout = max(0.0, min(POLL_S, min(s.busy[1] + timeout_s - now for s in busy)))
        ready = wait([s.proc.stdout for s in busy], timeout)
        for slot in busy:
            i, t0 = slot.busy
            if slot.proc.stdout in ready:
                line = slot.proc.stdout.readline()
                if not line:  # the worker died
                    code = slot.proc.wait()
                    replies[i] = Reply(error=f"the environment worker process exited (status {code})")
                    slot.proc, slot.busy = None, None
                    continue
                msg = json.loads(line)
                replies[i] = Reply(value=msg.get("ok"), error=msg.get("error"), where=msg.get("where"),
                                   generation=slot.generation)
                slot.busy = None
            elif time.monotonic() - t0 >= timeout_s:
                replies[i] = Reply(timeout=True)
                self._kill(slot)

    def run(self, requests: list[Request], timeout_s: float,
            should_stop: Optional[Callable[[], bool]] = None) -> list[Reply]:
        """The replies to ``requests``, in order (module doc); PoolStopped when ``should_stop()`` turns true."""
        replies: list[Optional[Reply]] = [None] * len(requests)
        queue = list(range(len(requests)))
        while queue or any(s.busy is not None for s in self.slots):
            if should_stop is not None and should_stop():
                for slot in self.slots:
                    if slot.busy is not None:
                        self._kill(slot)
                raise PoolStopped()
            self._dispatch(requests, queue, replies)
            self._collect(replies, timeout_s)
        return replies
