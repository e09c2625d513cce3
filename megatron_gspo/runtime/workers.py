"""The one pool of worker processes that runs user code outside the trainer: reward functions
(data/rewards/per_sample.py), the math checker (data/rewards/math_verify_worker.py), tools and environments
(env/pool.py). Each user plugs in a *handler* and the pool does the rest: spawn, deadline, restart, stop.

A handler is named ``"module:factory"``; in the worker, ``factory(**init)`` is called once and returns
``handle(request, note) -> value``: ``request`` is a ``Request.payload``, the value is the reply;
``note(value)`` says something before the reply (the math checker says which side it has done, so that a
timeout names the side). Whatever ``handle`` raises (SystemExit included) is the request's ``Reply.error``.

``run(requests, timeout_s, should_stop)`` gives every request to a worker and returns the replies in order:

* a free worker takes the next request; a request naming a worker (``Request.worker``) waits for that one
  (an environment lives in the process that built it; ``Request.generation``: the process it needs, else
  ``Reply(lost=True)``);
* a request older than ``timeout_s`` (counted from when its worker took it, not from a worker's start) is
  answered ``Reply(timeout=True)`` and its worker's whole process group killed: the children a tool
  started go with it (a Python timer cannot stop a C call; the parent's clock and SIGKILL can);
* ``should_stop()`` is read at least every ``POLL_S`` seconds while requests are out: once true every
  worker is killed and ``run`` raises ``runtime.stop.Cancelled``, within a fraction of a second whatever the
  user code is doing; the next ``run`` starts new workers;
* a worker that dies answers its request with an error (``Reply.exit_status``) and the next request it
  gets starts another process; a handler that cannot be built raises :class:`HandlerLoadError`.

The protocol runs over two pipes of the worker's own (``pass_fds``; pickled messages), never over file
descriptor 1: the worker points its fd 1 at its stderr first, so what user code or its child processes
write there (``print``, ``os.write(1, ...)``, a C library, a subprocess) goes to the job's log and can
never be read as a reply. A worker ignores the stop signals (the trainer decides when to stop), runs in
a session of its own (its process group is what the pool kills), gets this process's ``sys.path`` (a
plug-in the trainer can import, it can import) and kills its own process group when its input ends or
its parent is gone, so no child of user code outlives the job.

Not pebble or loky: their pools fork or spawn workers through multiprocessing (a spawned worker imports the
trainer's ``__main__``: torch, megatron), kill a worker's process only, not its process group, and give a
task to any free worker, while an environment's requests must go to the process that holds it.
"""

from __future__ import annotations

import atexit
import os
import signal
import subprocess
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait  # poll(2): no FD_SETSIZE limit, unlike select(2)
from typing import Callable, Optional

from megatron_gspo.runtime.stop import Cancelled  # standard library only, as this module

POLL_S = 0.1  # how often the stop flag is read while requests are out
ERROR_CHARS = 4000  # an error message from user code is cut here (it is logged and dumped)
PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # megatron_gspo/
STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP)


class WorkerStartError(RuntimeError):
    """A worker process did not start (it died or took longer than its start-up limit)."""


class HandlerLoadError(WorkerStartError):
    """The handler could not be built in the worker (an import error, a bad plug-in): the message says why."""


@dataclass
class Request:
    """One request: ``payload`` goes to the handler; ``worker``: the slot that must run it (None: any);
    ``generation``: the slot's process it needs (``Reply.generation`` of an earlier request), None: any;
    ``skip``: read when a worker could take it, True answers ``Reply(skipped=True)`` without running it."""

    payload: object
    worker: Optional[int] = None
    generation: Optional[int] = None
    skip: Optional[Callable[[], bool]] = None


@dataclass
class Reply:
    """``value`` (what the handler returned), or ``error`` (what it raised: "Type: message", ``where``: the
    file:line of the user code that raised), ``timeout`` (killed at the deadline), ``lost`` (the process
    the request needed is gone), ``exit_status`` (the worker died on it: its status), ``skipped``;
    ``generation``: the answering process's; ``notes``: what the handler said before."""

    value: object = None
    error: Optional[str] = None
    where: Optional[str] = None
    timeout: bool = False
    lost: bool = False
    exit_status: Optional[int] = None
    skipped: bool = False
    generation: int = 0
    notes: list = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return self.error is None and not self.timeout and not self.lost and not self.skipped


class _Slot:
    """One worker process, its pipes, and the request it runs."""

    def __init__(self) -> None:
        self.proc: Optional[subprocess.Popen] = None
        self.tasks: Optional[Connection] = None  # requests out
        self.results: Optional[Connection] = None  # replies in
        self.ready = False
        self.started = 0.0
        self.generation = 0  # bumped at every start: what an older process held is lost
        self.task: Optional[int] = None  # the request's index
        self.pending: object = None  # the request's payload, until the new worker is ready
        self.sent: Optional[float] = None  # when it was sent (its deadline's start); None: waiting for "ready"
        self.notes: list = []

    @property
    def alive(self) -> bool:
        return self.proc is not None and _running(self.proc)


class WorkerPool:
    """``size`` worker processes running ``handler`` (``"module:factory"``, built with ``init``) (module doc).
    ``name`` names them in messages; ``startup_timeout_s``: how long a new worker may take to build its
    handler (a loaded 2-core machine: tens of seconds)."""

    def __init__(self, size: int, handler: str, init: Optional[dict] = None, name: str = "worker",
                 startup_timeout_s: float = 120.0) -> None:
        if size < 1:
            raise ValueError(f"a worker pool needs at least one worker, got {size}")
        self.handler, self.init, self.name = handler, dict(init or {}), name
        self.startup_timeout_s = startup_timeout_s
        self.slots = [_Slot() for _ in range(int(size))]
        self.num_starts = self.num_kills = self.num_timeouts = 0
        atexit.register(self.close)

    @property
    def pids(self) -> list[int]:
        """The live workers' process ids."""
        return [s.proc.pid for s in self.slots if s.alive]

    # -- processes --------------------------------------------------------------------------------
    def _start(self, slot: _Slot) -> None:
        self._end(slot)
        task_r, task_w = os.pipe()
        result_r, result_w = os.pipe()
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(p or os.getcwd() for p in sys.path),
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}  # N workers: no thread pool each
        try:
            slot.proc = subprocess.Popen([sys.executable, "-m", "megatron_gspo.runtime.workers", str(task_r),
                                          str(result_w)], pass_fds=(task_r, result_w), stdin=subprocess.DEVNULL,
                                         env=env, start_new_session=True)
        finally:
            os.close(task_r)
            os.close(result_w)
        slot.tasks, slot.results = Connection(task_w, readable=False), Connection(result_r, writable=False)
        slot.ready, slot.started, slot.sent, slot.notes = False, time.monotonic(), None, []
        slot.generation += 1
        self.num_starts += 1
        slot.tasks.send(("init", self.handler, self.init, list(sys.path)))

    def _end(self, slot: _Slot) -> Optional[int]:
        """Kill the worker's process group (the worker and every child of user code), reap it: its status."""
        status = None
        if slot.proc is not None:
            if _running(slot.proc):
                self.num_kills += 1
            status = _kill_group(slot.proc)
        for conn in (slot.tasks, slot.results):
            if conn is not None:
                conn.close()
        slot.proc = slot.tasks = slot.results = None
        slot.ready, slot.task, slot.pending, slot.sent, slot.notes = False, None, None, None, []
        return status

    def kill(self) -> None:
        """End every worker now (a stop); the next ``run`` starts new ones."""
        for slot in self.slots:
            self._end(slot)

    def close(self) -> None:
        """End the workers: each exits at the end of its input (killing its group), or is killed after 5 s."""
        for slot in self.slots:
            if slot.alive:
                slot.tasks.close()
                slot.tasks = None
                deadline = time.monotonic() + 5.0
                while _running(slot.proc) and time.monotonic() < deadline:
                    time.sleep(0.01)
            self._end(slot)

    # -- requests ---------------------------------------------------------------------------------
    def run(self, requests: list[Request], timeout_s: Optional[float] = None,
            should_stop: Optional[Callable[[], bool]] = None,
            on_reply: Optional[Callable[[int, Reply], None]] = None) -> list[Reply]:
        """The replies to ``requests``, in order (module doc); ``timeout_s``: each request's deadline (None:
        none); ``on_reply(i, reply)`` is called as each arrives. Cancelled when ``should_stop()`` turns true."""
        replies: list[Optional[Reply]] = [None] * len(requests)

        def answer(i: int, reply: Reply) -> None:
            replies[i] = reply
            if on_reply is not None:
                on_reply(i, reply)

        queue = list(range(len(requests)))
        try:
            while queue or any(s.task is not None for s in self.slots):
                if should_stop is not None and should_stop():
                    self.kill()
                    raise Cancelled("while the worker pool ran requests")
                self._dispatch(requests, queue, answer)
                self._collect(timeout_s, answer)
        except BaseException:
            for slot in self.slots:  # a request left running would answer into the next run
                if slot.task is not None:
                    self._end(slot)
            raise
        return replies

    def _dispatch(self, requests: list[Request], queue: list[int], answer) -> None:
        """Hand queued requests to free workers: a ready one first, then one starting, then a new process."""
        for i in list(queue):
            req = requests[i]
            if req.worker is not None and req.generation is not None:
                slot = self.slots[req.worker]
                if not slot.alive or slot.generation != req.generation:
                    queue.remove(i)
                    answer(i, Reply(lost=True))  # what it needs lived in a process that is gone
                    continue
            free = [s for w, s in enumerate(self.slots) if s.task is None and req.worker in (None, w)]
            if not free:
                continue
            queue.remove(i)
            if req.skip is not None and req.skip():
                answer(i, Reply(skipped=True))
                continue
            slot = min(free, key=lambda s: 0 if s.alive and s.ready else 1 if s.alive else 2)
            if not slot.alive:
                self._start(slot)
            slot.task, slot.pending, slot.notes = i, req.payload, []
            if slot.ready:
                self._send(slot)

    def _send(self, slot: _Slot) -> None:
        payload, slot.pending = slot.pending, None
        try:
            slot.tasks.send(payload)
        except OSError:  # it died since its last answer (BrokenPipeError): _collect sees it
            pass
        slot.sent = time.monotonic()

    def _collect(self, timeout_s: Optional[float], answer) -> None:
        """Read what the workers said (waiting at most POLL_S); answer and kill past the deadlines."""
        watched = [s for s in self.slots if s.proc is not None and (s.task is not None or not s.ready)]
        if not watched:
            return
        now = time.monotonic()
        ends = [s.sent + timeout_s for s in watched if s.sent is not None and timeout_s is not None]
        ends += [s.started + self.startup_timeout_s for s in watched if not s.ready]
        ready = wait([s.results for s in watched], max(0.0, min([POLL_S] + [e - now for e in ends])))
        for slot in watched:
            if slot.results in ready or (not _running(slot.proc) and slot.results.poll(0)):
                self._receive(slot, answer)
            elif not _running(slot.proc):  # died, its pipe held open by a child it forked
                self._died(slot, answer)
            elif not slot.ready and time.monotonic() - slot.started >= self.startup_timeout_s:
                self.kill()
                raise WorkerStartError(f"a {self.name} worker process did not start within "
                                       f"{self.startup_timeout_s:g} s")
            elif slot.sent is not None and timeout_s is not None and time.monotonic() - slot.sent >= timeout_s:
                i, notes = slot.task, slot.notes
                self._end(slot)
                self.num_timeouts += 1
                answer(i, Reply(timeout=True, notes=notes))

    def _receive(self, slot: _Slot, answer) -> None:
        try:
            msg = slot.results.recv()
        except (EOFError, OSError):
            self._died(slot, answer)
            return
        kind = msg[0]
        if kind == "ready":
            slot.ready = True
            if slot.task is not None:
                self._send(slot)
        elif kind == "failed":
            self.kill()
            raise HandlerLoadError(msg[1])
        elif kind == "note":
            slot.notes.append(msg[1])
        else:  # ("ok", value) or ("error", message, where)
            i, slot.task, slot.sent = slot.task, None, None
            reply = Reply(value=msg[1]) if kind == "ok" else Reply(error=msg[1], where=msg[2])
            reply.generation, reply.notes, slot.notes = slot.generation, slot.notes, []
            answer(i, reply)

    def _died(self, slot: _Slot, answer) -> None:
        deadline = time.monotonic() + 1.0  # its pipe closed: it is exiting
        while _running(slot.proc) and time.monotonic() < deadline:
            time.sleep(0.01)
        i, ready = slot.task, slot.ready
        status = self._end(slot)
        if not ready:
            self.kill()
            raise WorkerStartError(f"a {self.name} worker process exited (status {status}) before it was ready")
        if i is not None:
            answer(i, Reply(error=f"the {self.name} worker process exited (status {status})", exit_status=status))


def _running(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` has not exited, without reaping it (see _kill_group)."""
    if proc.returncode is not None:
        return False
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is None
    except ChildProcessError:
        return False


def _kill_group(proc: subprocess.Popen) -> Optional[int]:
    """SIGKILL the process group ``proc`` leads (start_new_session: its id is proc's), then reap ``proc``: its
    exit status. Signalled before the reap: while proc is unreaped its id cannot name another group."""
    if proc.returncode is None:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return proc.wait()


# ----------------------------------------------------------------------------------------------
# The worker process: python -m megatron_gspo.runtime.workers IN OUT
# ----------------------------------------------------------------------------------------------

def error_text(e: BaseException) -> str:
    """``"Type: message"``, cut at ERROR_CHARS."""
    text = f"{type(e).__name__}: {e}"
    return text if len(text) <= ERROR_CHARS else text[:ERROR_CHARS] + f"... ({len(text)} characters)"


def user_frame(e: BaseException) -> Optional[str]:
    """``file:line`` of the last frame of ``e``'s traceback outside this package: where the user's code raised."""
    frames = [f for f in traceback.extract_tb(e.__traceback__) if not os.path.abspath(f.filename).startswith(PACKAGE_DIR)]
    return f"{frames[-1].filename}:{frames[-1].lineno}" if frames else None


def _orphan_watch(parent: int) -> None:
    """Kill this process group when the parent is gone (it died without closing our input: SIGKILL, OOM)."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os.killpg(0, signal.SIGKILL)


def _import_handler(path: str):
    import importlib

    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def serve(tasks: Connection, results: Connection) -> None:
    _, handler, init, path = tasks.recv()
    sys.path[:] = path  # a plug-in importable in the trainer is importable here
    try:
        handle = _import_handler(handler)(**init)
    except BaseException as e:  # noqa: BLE001 (said to the parent, which names what failed)
        results.send(("failed", error_text(e)))
        return
    results.send(("ready",))

    def note(value) -> None:
        results.send(("note", value))

    while True:
        try:
            request = tasks.recv()
        except EOFError:
            return
        try:
            reply = ("ok", handle(request, note))
        except BaseException as e:  # noqa: BLE001 (user code: SystemExit and all, reported to the parent)
            reply = ("error", error_text(e), user_frame(e))
        try:
            results.send(reply)
        except Exception as e:  # noqa: BLE001 (the value does not pickle: nothing was written yet)
            results.send(("error", f"the reply cannot be sent to the trainer: {error_text(e)}", None))


def main(argv: list[str]) -> None:
    fd_in, fd_out = int(argv[0]), int(argv[1])
    for fd in (fd_in, fd_out):
        os.set_inheritable(fd, False)  # a program user code runs does not get the protocol's pipes
    try:
        os.dup2(2, 1)  # fd 1 is the log: nothing user code writes there can reach the protocol
    except OSError:  # no stderr (a parent that closed it): fd 1 goes nowhere, still not to the protocol
        os.dup2(os.open(os.devnull, os.O_WRONLY), 1)
    for sig in STOP_SIGNALS:
        signal.signal(sig, signal.SIG_IGN)
    threading.Thread(target=_orphan_watch, args=(os.getppid(),), daemon=True).start()
    try:
        serve(Connection(fd_in, writable=False), Connection(fd_out, readable=False))
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.killpg(0, signal.SIGKILL)  # the end of input: this worker and whatever user code left running


if __name__ == "__main__":
    main(sys.argv[1:])
