"""math-verify in a child process: the math reward's checker, with a timeout that works in every process.

math-verify (the checker of TRL and open-r1) bounds its sympy work with ``signal.alarm``: that
works only in the main thread of the main interpreter (anywhere else it raises ValueError), there is
one alarm per process (its ``alarm(0)`` cancels any other alarm a job set, e.g. a reward plug-in's or
pytest-timeout's), its handler raises an exception into whatever code runs when the alarm fires, and a
C-level computation (a huge integer power) is not interrupted at all. The trainer's ranks also own
their signal handling (stop.PreemptionFlag: SIGTERM / SIGUSR1 mean "save and stop").

So the checking runs in a child process (``python -m megatron_gspo.data.math_verify_worker``), started on
first use and kept for the process's lifetime, and touches no signal of the trainer. Two limits:

* ``cpu_timeout_s``: the CPU time one check may use (ITIMER_VIRTUAL in the child, which owns its
  signals). CPU time, not wall time: math-verify's own 5-second wall-clock alarms decided verdicts
  by machine load (on this shared 2-core VM, ``\boxed{(1, 2)}`` vs ``(1,2)`` scored 0 at a load
  average of 110 and 1 when idle); a check's CPU time does not depend on the load. math-verify's own
  timeouts are off in the child. Past the limit the check scores 0 (math-verify's verdict on its
  timeouts) and the child goes on.
* ``wall_timeout_s``: a backstop the parent keeps with ``select`` for what no Python-level timer
  interrupts (a C-level computation): past it the parent kills the child (the next check starts
  another) and scores 0.

The child ignores the stop signals (the parent decides when to stop; a preemption never kills a
reward mid-batch), runs in its own session, and exits when the parent's end of the pipe closes,
however the parent ends.

Protocol: one JSON object per line. Request ``{"response": text, "gold": final answer, "cpu_s": limit}``;
reply ``{"equal": bool}``, ``{"timeout": true}`` or ``{"error": "..."}``; the child's first line is
``{"ready": true}``.
"""

from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

# How long a new child may take to import sympy and math-verify before the first check (a loaded CPU
# is slow: ~2 s on an idle core, tens of seconds under load).
STARTUP_TIMEOUT_S = 300.0


class MathVerifyTimeout(Exception):
    """The check took longer than its deadline (the child was killed)."""


class MathVerifyProcess:
    """A math-verify child process: ``equal(response, gold, timeout_s)``; thread-safe; ``close()`` ends it."""

    def __init__(self) -> None:
        self._proc: Optional[subprocess.Popen] = None
        self._lock = threading.Lock()
        self.num_timeouts = 0
        self.num_starts = 0  # a timeout or a dead child makes the next check start another

    def _start(self) -> subprocess.Popen:
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        proc = subprocess.Popen([sys.executable, "-m", "megatron_gspo.data.math_verify_worker"], stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True, bufsize=1,
                                start_new_session=True)
        reply = self._read(proc, STARTUP_TIMEOUT_S)
        if reply != {"ready": True}:
            self._kill(proc)
            raise RuntimeError(f"the math-verify checker process did not start (it answered {reply!r}); is "
                               "math-verify installed? (pip install math-verify)")
        return proc

    @staticmethod
    def _read(proc: subprocess.Popen, timeout_s: float) -> Optional[dict]:
        """The child's next line, None past the deadline; RuntimeError if the child died."""
        deadline = time.monotonic() + timeout_s
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([proc.stdout], [], [], left)
            if ready:
                line = proc.stdout.readline()
                if not line:
                    raise RuntimeError(f"the math-verify checker process exited (status {proc.wait()})")
                return json.loads(line)

    @staticmethod
    def _kill(proc: subprocess.Popen) -> None:
        proc.kill()
        proc.wait()

    def equal(self, response: str, gold: str, cpu_timeout_s: float, wall_timeout_s: float) -> bool:
        """Whether math-verify finds ``response``'s answer equal to the final answer ``gold``; raises
        MathVerifyTimeout past ``cpu_timeout_s`` seconds of the child's CPU time, or past
        ``wall_timeout_s`` seconds of waiting (the child is then killed and replaced on the next call)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
                self.num_starts += 1
            proc = self._proc
            proc.stdin.write(json.dumps({"response": response, "gold": gold, "cpu_s": cpu_timeout_s}) + "\n")
            proc.stdin.flush()
            reply = self._read(proc, wall_timeout_s)
            if reply is None:
                self._kill(proc)
                self._proc = None
                self.num_timeouts += 1
                raise MathVerifyTimeout(f"math-verify gave no verdict within {wall_timeout_s:g} s (the checker "
                                        "process was killed)")
        if "error" in reply:
            raise RuntimeError(f"math-verify failed: {reply['error']}")
        if reply.get("timeout"):
            self.num_timeouts += 1
            raise MathVerifyTimeout(f"math-verify used more than {cpu_timeout_s:g} s of CPU time")
        return bool(reply["equal"])

    def close(self) -> None:
        with self._lock:
            if self._proc is not None and self._proc.poll() is None:
                self._proc.stdin.close()  # the child exits at end of input
                try:
                    self._proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    self._kill(self._proc)
            self._proc = None


_process_checker: Optional[MathVerifyProcess] = None
_process_lock = threading.Lock()


def process_checker() -> MathVerifyProcess:
    """This process's checker, started on first use and closed at exit."""
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


def check(response: str, gold: str) -> bool:
    """math-verify's verdict, the way TRL and open-r1 call it: the gold answer parsed as a boxed LaTeX
    answer, the response parsed with math-verify's own extraction (LaTeX, preferring the last \\boxed{},
    then plain expressions). math-verify's wall-clock timeouts are off (the caller limits CPU time)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_parsed = parse(f"\\boxed{{{gold}}}", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                        parsing_timeout=None)
    if not gold_parsed:
        return False
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


def main() -> None:
    # stop signals are the parent's business; it closes our input when it is done or gone
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    import logging

    logging.disable(logging.WARNING)  # math-verify warns that its own timeouts are off: they are, on purpose
    import math_verify  # noqa: F401 (imported before "ready": the first check's deadline is for the check)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            out = {"equal": _with_cpu_limit(lambda: check(req["response"], req["gold"]), float(req["cpu_s"]))}
        except _CpuLimit:
            out = {"timeout": True}
        except Exception as e:  # a bug here must reach the parent as a message, not a hang
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
