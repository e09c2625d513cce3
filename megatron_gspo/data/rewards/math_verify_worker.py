"""math-verify in a child process: the math reward's checker, with a timeout that works in every process.

math-verify (the checker of TRL and open-r1) bounds its sympy work with ``signal.alarm``: that
works only in the main thread of the main interpreter (anywhere else it raises ValueError), there is
one alarm per process (its ``alarm(0)`` cancels any other alarm a job set, e.g. a reward plug-in's or
pytest-timeout's), its handler raises an exception into whatever code runs when the alarm fires, and a
C-level computation (a huge integer power) is not interrupted at all. The trainer's ranks also own
their signal handling (runtime.stop.PreemptionFlag: SIGTERM / SIGUSR1 mean "save and stop").

So the checking runs in a child process (``python -m megatron_gspo.data.rewards.math_verify_worker``),
started on first use and kept until closed, and touches no signal of the trainer. A check has two
sides, each parsed under its own limit so that a timeout names the side that caused it: the reference
(parsed once per child and kept: the G responses to a prompt share it) and the response (parsed, then
compared with the reference). Two limits:

* ``cpu_timeout_s``: the CPU time each side may use (ITIMER_VIRTUAL in the child, which owns its
  signals). CPU time, not wall time: math-verify's own 5-second wall-clock alarms decided verdicts
  by machine load (on this shared 2-core VM, ``\boxed{(1, 2)}`` vs ``(1,2)`` scored 0 at a load
  average of 110 and 1 when idle); a check's CPU time does not depend on the load. math-verify's own
  timeouts are off in the child. Past the limit the check scores 0 (math-verify's verdict on its
  timeouts) and the child goes on.
* ``wall_timeout_s``: a backstop the parent keeps with ``wait`` (poll) for what no Python-level timer
  interrupts (a C-level computation): past it the parent kills the child (the next check starts
  another) and scores 0.

The child ignores the stop signals and runs in its own session: the parent decides when to stop. While
it waits for a verdict the parent reads the job's stop flag (``should_stop``) every 0.1 s; when it is set
the parent kills the child (the next check starts another) and raises batch.ScoringStopped. The child exits
when the parent's end of the pipe closes, however the parent ends. :class:`MathVerifyPool` keeps
several children, for checks in parallel (``reward.num_workers``).

Protocol: one JSON object per line. Request ``{"response": text, "gold": final answer, "cpu_s": limit}``;
the child answers ``{"reference": true}`` once the reference is parsed, then ``{"equal": bool}`` or
``{"timeout": "response"}``; or at once ``{"timeout": "reference"}`` (the reference took the whole
limit), ``{"equal": false}`` (math-verify reads nothing in the reference) or ``{"error": "..."}``. Its
first line is ``{"ready": true}``.
"""

from __future__ import annotations

import atexit
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from multiprocessing.connection import wait  # poll(2): no FD_SETSIZE limit, unlike select(2)
from typing import Callable, Optional

from megatron_gspo.data.rewards.batch import ScoringStopped

# How long a new child may take to import sympy and math-verify before the first check (a loaded CPU
# is slow: ~2 s on an idle core, tens of seconds under load).
STARTUP_TIMEOUT_S = 300.0
POLL_S = 0.1  # how often a waiting parent reads the stop flag
REFERENCE_CACHE = 4096  # parsed references a child keeps


class MathVerifyTimeout(Exception):
    """A check took longer than its limit; ``side``: "reference" or "response", the one being parsed (or,
    for the response, compared) when the limit was reached."""

    def __init__(self, side: str, message: str) -> None:
        super().__init__(message)
        self.side = side


class MathVerifyProcess:
    """A math-verify child process: ``equal(response, gold, ...)``; thread-safe; ``close()`` ends it."""

    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen] = None
        self._pending = b""  # what the child wrote past the last line read
        self._lock = threading.Lock()
        self.num_timeouts = 0
        self.num_starts = 0  # a timeout, a stop or a dead child makes the next check start another

    def _start(self, should_stop: Optional[Callable[[], bool]]) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        # unbuffered: wait() sees every byte the child wrote (a buffered reader could hold a second line)
        proc = subprocess.Popen([sys.executable, "-m", "megatron_gspo.data.rewards.math_verify_worker"],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env,
                                bufsize=0, start_new_session=True)
        self._proc, self._pending = proc, b""  # killable from now on, should the start be stopped
        reply = self._read(proc, STARTUP_TIMEOUT_S, should_stop)
        if reply != {"ready": True}:
            self._kill()
            raise RuntimeError(f"the math-verify checker process did not start (it answered {reply!r}); is "
                               "math-verify installed? (pip install math-verify)")
        return proc

    def _read(self, proc: subprocess.Popen, timeout_s: float, should_stop: Optional[Callable[[], bool]]):
        """The child's next line, None past the deadline; ScoringStopped when ``should_stop()`` (the child
        killed); RuntimeError if the child died."""
        deadline = time.monotonic() + timeout_s
        while True:
            if b"\n" in self._pending:
                line, self._pending = self._pending.split(b"\n", 1)
                return json.loads(line)
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready = wait([proc.stdout], min(left, POLL_S))
            if ready:
                chunk = os.read(proc.stdout.fileno(), 1 << 16)
                if not chunk:
                    raise RuntimeError(f"the math-verify checker process exited (status {proc.wait()})")
                self._pending += chunk
            elif should_stop is not None and should_stop():
                self._kill()
                raise ScoringStopped()

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc = None

    def equal(self, response: str, gold: str, cpu_timeout_s: float, wall_timeout_s: float,
              should_stop: Optional[Callable[[], bool]] = None) -> bool:
        """Whether math-verify finds ``response``'s answer equal to the final answer ``gold``. Raises
        MathVerifyTimeout (naming the side) past ``cpu_timeout_s`` seconds of the child's CPU time on a side
        or ``wall_timeout_s`` seconds of waiting (the child is then killed and replaced on the next call);
        ScoringStopped when ``should_stop()`` becomes true while it waits."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._start(should_stop)
                self.num_starts += 1
            proc, side = self._proc, "reference"
            request = memoryview((json.dumps({"response": response, "gold": gold, "cpu_s": cpu_timeout_s}) + "\n").encode())
            while request:  # an unbuffered write may take part of it
                request = request[proc.stdin.write(request):]
            deadline = time.monotonic() + wall_timeout_s
            while True:
                reply = self._read(proc, deadline - time.monotonic(), should_stop)
                if reply is None:
                    self._kill()
                    self.num_timeouts += 1
                    raise MathVerifyTimeout(side, f"math-verify gave no verdict within {wall_timeout_s:g} s on the "
                                                  f"{side} (the checker process was killed)")
                if "reference" not in reply:
                    break
                side = "response"
        if "error" in reply:
            raise RuntimeError(f"math-verify failed: {reply['error']}")
        if reply.get("timeout"):
            self.num_timeouts += 1
            raise MathVerifyTimeout(reply["timeout"], f"math-verify used more than {cpu_timeout_s:g} s of CPU "
                                                      f"time on the {reply['timeout']}")
        return bool(reply["equal"])

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.stdin.close()  # the child exits at end of input
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._kill()
            self._proc = None


class MathVerifyPool:
    """``size`` checker processes: ``map(fn, items)`` runs ``fn(checker, item)`` for every item, each on a
    free checker (a thread per checker waits on its child: the work is in the children), and returns the
    results in item order. ``close()`` ends the children."""

    def __init__(self, size: int) -> None:
        self.checkers = [MathVerifyProcess() for _ in range(max(1, int(size)))]

    def map(self, fn: Callable, items: list) -> list:
        if len(self.checkers) == 1:
            return [fn(self.checkers[0], item) for item in items]
        free: queue.SimpleQueue = queue.SimpleQueue()
        for c in self.checkers:
            free.put(c)

        def run(item):
            checker = free.get()
            try:
                return fn(checker, item)
            finally:
                free.put(checker)

        with ThreadPoolExecutor(len(self.checkers), thread_name_prefix="math-verify") as pool:
            futures = [pool.submit(run, item) for item in items]
            try:
                return [f.result() for f in futures]
            except BaseException:
                for f in futures:
                    f.cancel()
                raise

    def close(self) -> None:
        for c in self.checkers:
            c.close()


_process_checker: Optional[MathVerifyProcess] = None
_process_lock = threading.Lock()


def process_checker() -> MathVerifyProcess:
    """This process's shared checker (for math.math_reward), started on first use and closed at exit."""
    global _process_checker
    with _process_lock:
        if _process_checker is None:
            _process_checker = MathVerifyProcess()
            atexit.register(_process_checker.close)
        return _process_checker


# ----------------------------------------------------------------------------------------------
# The child
# ----------------------------------------------------------------------------------------------

class _CpuLimit(BaseException):
    """Raised in the child when a check has used its CPU time (a BaseException: math-verify catches
    Exception around its parsing and would otherwise go on past the limit)."""


def parse_reference(gold: str) -> list:
    """math-verify's reading of the final answer ``gold``, the way TRL and open-r1 parse it: as a boxed
    LaTeX answer (empty: nothing it can compare). Its wall-clock timeouts are off (the caller limits CPU time)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse

    return parse(f"\\boxed{{{gold}}}", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                 parsing_timeout=None)


def check_response(response: str, gold_parsed: list) -> bool:
    """math-verify's verdict on ``response`` against the parsed reference: the response parsed with
    math-verify's own extraction (LaTeX, preferring the last \\boxed{}, then plain expressions)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    answer_parsed = parse(response, extraction_config=[LatexExtractionConfig(boxed_match_priority=0),
                                                        ExprExtractionConfig()], parsing_timeout=None)
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=None))


def _with_cpu_limit(fn, seconds: float):
    def expired(signum, frame):
        raise _CpuLimit()

    signal.signal(signal.SIGVTALRM, expired)
    signal.setitimer(signal.ITIMER_VIRTUAL, seconds)
    try:
        return fn()
    finally:
        signal.setitimer(signal.ITIMER_VIRTUAL, 0)


def _answer(req: dict, references: dict, say: Callable[[dict], None]) -> dict:
    """The final reply to one request (module doc), saying ``{"reference": true}`` first when there is a
    response side to check."""
    gold, cpu_s = req["gold"], float(req["cpu_s"])
    if gold not in references:
        try:
            parsed = _with_cpu_limit(lambda: parse_reference(gold), cpu_s)
        except _CpuLimit:
            return {"timeout": "reference"}
        if len(references) >= REFERENCE_CACHE:
            references.pop(next(iter(references)))
        references[gold] = parsed
    if not references[gold]:
        return {"equal": False}
    say({"reference": True})
    try:
        return {"equal": _with_cpu_limit(lambda: check_response(req["response"], references[gold]), cpu_s)}
    except _CpuLimit:
        return {"timeout": "response"}


def main() -> None:
    # stop signals are the parent's business; it closes our input when it is done or gone
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    import logging

    logging.disable(logging.WARNING)  # math-verify warns that its own timeouts are off: they are, on purpose
    import math_verify  # noqa: F401 (imported before "ready": the first check's deadline is for the check)

    def say(msg: dict) -> None:
        print(json.dumps(msg), flush=True)

    say({"ready": True})
    references: dict = {}  # gold text -> math-verify's parse of it
    for line in sys.stdin:
        try:
            out = _answer(json.loads(line), references, say)
        except Exception as e:  # a bug here must reach the parent as a message, not a hang
            out = {"error": f"{type(e).__name__}: {e}"}
        say(out)


if __name__ == "__main__":
    main()
