"""Preemption signals: the process's stop flag.

Preemption: SLURM sends SIGUSR1 (``--signal=B:USR1@300``) or SIGTERM before a job's time limit,
on preemption, ``scancel`` or ``scontrol requeue``. The handler only records the first signal and
when it came (a signal often arrives twice: SLURM signals every process of a job step and the
launcher passes it on too; repeats are counted, never acted on twice). The trainer reads the flag at
step boundaries, between two SFT warm-start steps, before a step's update and inside the long parts
(the decode loop, dynamic-sampling rounds, scoring, an evaluation: ``Cancelled``); all ranks agree through
an all-reduce, the last completed state is saved (an RL step, or the warm start as far as it went)
and the process exits with ``EXIT_PREEMPTED`` (or ``EXIT_PREEMPTED_NOTHING_SAVED`` when this run
completed nothing) so the batch script can requeue and resume. Once the code is decided the entry
point ignores the stop signals (exit_status.ignore_stop_signals): more of them change nothing. What a
stop saves and the line that reports it: trainer/stopping.py.
"""

from __future__ import annotations

import signal
import time
from typing import Optional

from megatron_gspo.runtime.exit_status import (  # noqa: F401 (re-exported)
    EXIT_PREEMPTED,
    EXIT_PREEMPTED_NOTHING_SAVED,
    EXIT_TOO_MANY_SKIPS,
    GRACEFUL,
)


# The signals that mean "save and stop" (SIGQUIT stays a hard stop): the launcher's supervisor delivers
# the same ones (exit_status.GRACEFUL). The entry point catches them all (under the launcher the ranks
# inherit them ignored from torchrun: see launch/supervisor.py); a Trainer built in another program
# takes TERM and USR1 only, leaving Ctrl-C to that program.
STOP_SIGNALS = GRACEFUL


class PreemptionFlag:
    """Set by a stop signal; one per process (``install``), shared by everything that checks it. The
    entry point installs it first thing (a signal during start-up is kept) and hands it to the Trainer
    (``Trainer(cfg, stop=flag)``); a Trainer built by another program installs it itself.

    Why a class attribute and not the signal table: a handler is process-wide, and the flag must keep a
    signal that came before the Trainer was built; the table can also hold an older flag's handler again
    (a program that saves and restores handlers), which would bring back that flag's state. ``release``
    forgets the process's flag (tests: "as in a new process"); the next ``install`` makes a fresh one.

    ``received``: the first signal (its number), ``received_at``: when (time.time()), ``count``:
    how many deliveries arrived (SLURM and the launcher both deliver most signals)."""

    _process: Optional["PreemptionFlag"] = None

    def __init__(self, signals=(signal.SIGTERM, signal.SIGUSR1)) -> None:
        self.received: Optional[int] = None
        self.received_at: Optional[float] = None
        self.count = 0
        self.signals: set = set()
        self.catch(signals)

    @classmethod
    def of_process(cls) -> Optional["PreemptionFlag"]:
        """The process's flag, if one was installed."""
        return cls._process

    @classmethod
    def install(cls, signals=(signal.SIGTERM, signal.SIGUSR1)) -> "PreemptionFlag":
        """The process's flag, created on first use; ``signals`` are added to what it catches."""
        if cls._process is None:
            cls._process = cls(signals)
        else:
            cls._process.catch(signals)
        return cls._process

    def catch(self, signals) -> None:
        for sig in signals:
            if sig not in self.signals:
                signal.signal(sig, self._handler)
                self.signals.add(sig)

    def release(self) -> None:
        """No longer the process's flag: the next ``install`` makes a fresh one (whose handlers replace
        this one's; until then a signal still lands here, never in the default handler)."""
        if type(self)._process is self:
            type(self)._process = None

    def _handler(self, signum, frame) -> None:
        # Nothing but bookkeeping here: the handler may run in the middle of any Python code
        # (logging included), so the decision and the log line come from the trainer.
        if self.received is None:
            self.received, self.received_at = signum, time.time()
        self.count += 1

    @property
    def set(self) -> bool:
        return self.received is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.received).name if self.received is not None else "(on another rank)"

    def timing(self) -> str:
        """``signal received 2.1 s earlier (2 deliveries)``: for the line that reports the stop."""
        if self.received is None:
            return "signal received on another rank"
        times = "" if self.count == 1 else f" ({self.count} deliveries)"
        return f"signal received {time.time() - self.received_at:.1f} s earlier{times}"


class Cancelled(Exception):
    """Work cut short by the stop flag: the one exception for "stop now". Raised wherever long work reads the
    flag: the decode loop's vote and the dynamic-sampling rounds (rollout/colocated.py), a wait on the worker
    pool (runtime/workers.py: rewards, the math checker, environments), scoring, the making of a task's
    examples at start-up, an evaluation, an asynchronous rollout rank's loop. Where ranks must agree it is
    raised on every rank at once (``raise_together``). Handled where the work began, by trainer/stopping.py for
    the trainer (a step cut short: nothing of it applied, the last completed state saved; an evaluation: the
    step stands; start-up: nothing to save), by the rank's loop on a rollout rank (rollout/worker.py).

    ``where``: what was cut short, as the stop line says it ("in generation round 3, decoding cut short");
    ``step``: the RL step it was in (1-based; None outside one); ``elapsed_s``: how long it had run (set by
    whoever reports it)."""

    def __init__(self, where: str, step: Optional[int] = None, elapsed_s: float = 0.0):
        super().__init__(where if step is None else f"step {step} abandoned {where}")
        self.where, self.step, self.elapsed_s = where, step, elapsed_s


def raise_together(cut_short: bool, device, where: str, step: Optional[int] = None, *, what: str) -> None:
    """One vote over every rank (``what`` names it): if the work was cut short on any rank (``cut_short`` is
    this rank's answer), every rank raises Cancelled(where, step) here, together, so that they leave the work
    at the same point (a collective left on one rank only would hang the others)."""
    from megatron_gspo.runtime import comm  # torch: only where ranks vote (a worker process imports this module)

    if comm.any_rank(cut_short, device, what=what):
        raise Cancelled(where, step)
