"""math-verify in a child process: the math reward's checker, with a timeout that works in every process.

math-verify (the checker of TRL and open-r1) bounds its sympy work with ``signal.alarm``: that
works only in the main thread of the main interpreter (anywhere else it raises ValueError), there is
one alarm per process (its ``alarm(0)`` cancels any other alarm a job set, e.g. a reward plug-in's or
pytest-timeout's), its handler raises an exception into whatever code runs when the alarm fires, and a
C-level computation (a huge integer power) is not interrupted at all. The trainer's ranks also own
their signal handling (faults.PreemptionFlag: SIGTERM / SIGUSR1 mean "save and stop").

So the checking runs in a child process (``python -m megatron_gspo.math_verify_worker``), started on
first use and kept for the process's lifetime. The child is a main thread with nothing else to do, so
math-verify's own alarms work there and touch nothing of the trainer; the parent waits for each answer
with ``select`` and a deadline (``timeout_s``) and, past it, kills the child (a new one starts on the
next call) and scores 0, as math-verify does on its own timeouts. The child ignores the stop signals
(the parent decides when to stop; a preemption never kills a reward mid-batch), runs in its own session,
and exits when the parent's end of the pipe closes, however the parent ends.

Protocol: one JSON object per line. Request ``{"response": text, "gold": final answer}``; reply
``{"equal": bool}`` or ``{"error": "..."}``; the child's first line is ``{"ready": true}``.
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
        proc = subprocess.Popen([sys.executable, "-m", "megatron_gspo.math_verify_worker"], stdin=subprocess.PIPE,
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

    def equal(self, response: str, gold: str, timeout_s: float) -> bool:
        """Whether math-verify finds ``response``'s answer equal to the final answer ``gold``; raises
        MathVerifyTimeout past ``timeout_s`` seconds (the child is then killed and replaced on the next call)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None:
                self._proc = self._start()
                self.num_starts += 1
            proc = self._proc
            proc.stdin.write(json.dumps({"response": response, "gold": gold}) + "\n")
            proc.stdin.flush()
            reply = self._read(proc, timeout_s)
            if reply is None:
                self._kill(proc)
                self._proc = None
                self.num_timeouts += 1
                raise MathVerifyTimeout(f"math-verify took more than {timeout_s:g} s")
        if "error" in reply:
            raise RuntimeError(f"math-verify failed: {reply['error']}")
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

# math-verify's own per-step timeouts inside the child (its main thread): parsing each side and
# comparing; the parent's deadline bounds the whole check.
PARSE_TIMEOUT_S = 5
VERIFY_TIMEOUT_S = 5


def check(response: str, gold: str) -> bool:
    """math-verify's verdict, the way TRL and open-r1 call it: the gold answer parsed as a boxed LaTeX
    answer, the response parsed with math-verify's own extraction (LaTeX, preferring the last \\boxed{},
    then plain expressions)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    gold_parsed = parse(f"\\boxed{{{gold}}}", extraction_config=[LatexExtractionConfig(), ExprExtractionConfig()],
                        parsing_timeout=PARSE_TIMEOUT_S)
    if not gold_parsed:
        return False
    answer_parsed = parse(response, extraction_config=[LatexExtractionConfig(boxed_match_priority=0),
                                                        ExprExtractionConfig()],
                          parsing_timeout=PARSE_TIMEOUT_S)
    return bool(verify(gold_parsed, answer_parsed, timeout_seconds=VERIFY_TIMEOUT_S))


def main() -> None:
    # stop signals are the parent's business; it closes our input when it is done or gone
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)
    import logging

    logging.disable(logging.WARNING)  # math-verify logs each timeout; the verdict (False) is the answer
    import math_verify  # noqa: F401 (imported before "ready": the first check's deadline is for the check)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        try:
            req = json.loads(line)
            out = {"equal": check(req["response"], req["gold"])}
        except Exception as e:  # a bug here must reach the parent as a message, not a hang
            out = {"error": f"{type(e).__name__}: {e}"}
        print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
