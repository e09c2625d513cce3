"""math-verify in a child process: the math reward's checker, with a timeout that works in every process.

math-verify (the checker of TRL and open-r1) bounds its sympy work with ``signal.alarm``: that
works only in the main thread of the main interpreter (anywhere else it raises ValueError), there is
one alarm per process (its ``alarm(0)`` cancels any other alarm a job set, e.g. a reward plug-in's or
pytest-timeout's), its handler raises an exception into whatever code runs when the alarm fires, and a
C-level computation (a huge integer power) is not interrupted at all. The trainer's ranks also own
their signal handling (runtime.stop.PreemptionFlag: SIGTERM / SIGUSR1 mean "save and stop").

So the checking runs in worker processes of the job's worker pool (runtime/workers.py, with this
module's ``math_handler``), started on first use and kept until closed, touching no signal of the trainer.
A check has two sides, each parsed under its own limit so that a timeout names the side that caused it:
the reference (parsed once per worker and kept: the G responses to a prompt share it) and the response
(parsed, then compared with the reference). Two limits:

* ``cpu_timeout_s``: the CPU time each side may use (ITIMER_VIRTUAL in the worker, which owns its
  signals). CPU time, not wall time: math-verify's own 5-second wall-clock alarms decided verdicts
  by machine load (on this shared 2-core VM, ``\boxed{(1, 2)}`` vs ``(1,2)`` scored 0 at a load
  average of 110 and 1 when idle); a check's CPU time does not depend on the load. math-verify's own
  timeouts are off in the worker. Past the limit the check scores 0 (math-verify's verdict on its
  timeouts) and the worker goes on.
* ``wall_timeout_s``: a backstop the pool keeps for what no Python-level timer interrupts (a C-level
  computation): past it the pool kills the worker (the next check starts another) and it scores 0.

A stop of the job (``should_stop``) kills the workers within 0.1 s and raises runtime.stop.Cancelled.
:class:`MathVerifyPool` keeps ``reward.num_workers`` of them, for checks in parallel.

Requests: ``{"response": text, "gold": final answer, "cpu_s": limit}``; the worker notes
``{"reference": true}`` once the reference is parsed, then answers ``{"equal": bool}`` or
``{"timeout": "response"}``; or at once ``{"timeout": "reference"}`` (the reference took the whole
limit) or ``{"equal": false}`` (math-verify reads nothing in the reference).
"""

from __future__ import annotations

import atexit
import signal
import threading
from typing import Callable, Optional

from megatron_gspo.runtime.workers import Reply, Request, WorkerPool, WorkerStartError

# How long a new worker may take to import sympy and math-verify before the first check (a loaded CPU
# is slow: ~2 s on an idle core, tens of seconds under load).
STARTUP_TIMEOUT_S = 300.0
REFERENCE_CACHE = 4096  # parsed references a worker keeps
HANDLER = "megatron_gspo.data.rewards.math_verify_worker:math_handler"


class MathVerifyTimeout(Exception):
    """A check took longer than its limit; ``side``: "reference" or "response", the one being parsed (or,
    for the response, compared) when the limit was reached."""

    def __init__(self, side: str, message: str) -> None:
        super().__init__(message)
        self.side = side


class MathVerifyPool:
    """``size`` math-verify worker processes (module doc): ``verdicts`` checks many pairs side by side,
    ``equal`` one (thread-safe); ``close()`` ends them."""

    def __init__(self, size: int = 1) -> None:
        self.pool = WorkerPool(max(1, int(size)), HANDLER, name="math-verify", startup_timeout_s=STARTUP_TIMEOUT_S)
        self._lock = threading.Lock()
        self.num_timeouts = 0

    @property
    def num_starts(self) -> int:
        """Worker processes started (a wall-clock timeout or a stop makes the next check start another)."""
        return self.pool.num_starts

    @property
    def pids(self) -> list[int]:
        return self.pool.pids

    def _verdict(self, rep: Reply, cpu_timeout_s: float, wall_timeout_s: float):
        """A reply as True / False, or the exception that says why there is none (MathVerifyTimeout naming the
        side, RuntimeError), or None (skipped)."""
        if rep.skipped:
            return None
        if rep.timeout:
            self.num_timeouts += 1
            side = "response" if rep.notes else "reference"  # the worker notes the reference once it is parsed
            return MathVerifyTimeout(side, f"math-verify gave no verdict within {wall_timeout_s:g} s on the {side} "
                                           "(the checker process was killed)")
        if rep.error is not None:
            return RuntimeError(f"math-verify failed: {rep.error}")
        if rep.value.get("timeout"):
            self.num_timeouts += 1
            side = rep.value["timeout"]
            return MathVerifyTimeout(side, f"math-verify used more than {cpu_timeout_s:g} s of CPU time on the {side}")
        return bool(rep.value["equal"])

    def verdicts(self, pairs: list[tuple[str, str]], cpu_timeout_s: float, wall_timeout_s: float,
                 should_stop: Optional[Callable[[], bool]] = None, skip: Optional[Callable[[str], bool]] = None,
                 on_verdict: Optional[Callable[[int, object], None]] = None) -> list:
        """math-verify's verdict on each ``(response, gold)`` pair, checked side by side: True / False, or the
        exception that says why there is none (MathVerifyTimeout past ``cpu_timeout_s`` of CPU time on a side or
        ``wall_timeout_s`` of waiting; RuntimeError), or None for a pair whose ``skip(gold)`` was true when a
        worker was free for it. ``on_verdict(i, verdict)`` is called as each arrives (before later pairs are
        handed out). runtime.stop.Cancelled when ``should_stop()`` becomes true."""
        out: list = [None] * len(pairs)

        def arrived(i: int, rep: Reply) -> None:
            out[i] = self._verdict(rep, cpu_timeout_s, wall_timeout_s)
            if on_verdict is not None and out[i] is not None:
                on_verdict(i, out[i])

        requests = [Request({"response": r, "gold": g, "cpu_s": cpu_timeout_s},
                            skip=None if skip is None else (lambda g=g: skip(g))) for r, g in pairs]
        with self._lock:
            try:
                self.pool.run(requests, wall_timeout_s, should_stop, arrived)
            except WorkerStartError as e:
                raise RuntimeError(f"the math-verify checker process did not start ({e}); is math-verify "
                                   "installed? (pip install math-verify)") from None
        return out

    def equal(self, response: str, gold: str, cpu_timeout_s: float, wall_timeout_s: float,
              should_stop: Optional[Callable[[], bool]] = None) -> bool:
        """Whether math-verify finds ``response``'s answer equal to the final answer ``gold``; raises what
        ``verdicts`` gives instead of a verdict."""
        (verdict,) = self.verdicts([(response, gold)], cpu_timeout_s, wall_timeout_s, should_stop)
        if isinstance(verdict, Exception):
            raise verdict
        return verdict

    def close(self) -> None:
        self.pool.close()


_process_checker: Optional[MathVerifyPool] = None
_process_lock = threading.Lock()


def process_checker() -> MathVerifyPool:
    """This process's shared checker (for math.math_reward), started on first use and closed at exit."""
    global _process_checker
    with _process_lock:
        if _process_checker is None:
            _process_checker = MathVerifyPool(1)
            atexit.register(_process_checker.close)
        return _process_checker


# ----------------------------------------------------------------------------------------------
# The worker side
# ----------------------------------------------------------------------------------------------

class _CpuLimit(BaseException):
    """Raised in the worker when a check has used its CPU time (a BaseException: math-verify catches
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


def math_handler():
    """The worker's handler (module doc): math-verify imported before the worker says it is ready (the first
    check's deadline is for the check), its parsed references kept across checks."""
    import logging

    logging.disable(logging.WARNING)  # math-verify warns that its own timeouts are off: they are, on purpose
    import math_verify  # noqa: F401

    references: dict = {}  # gold text -> math-verify's parse of it
    return lambda req, note: _answer(req, references, note)
