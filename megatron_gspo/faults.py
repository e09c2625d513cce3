"""Preemption signals and test-only fault injection.

Preemption: SLURM sends SIGUSR1 (``--signal=B:USR1@300``) or SIGTERM before a job's time limit,
on preemption, ``scancel`` or ``scontrol requeue``. The handler only records the first signal and
when it came (a signal often arrives twice: SLURM signals every process of a job step and the
launcher passes it on too; repeats are counted, never acted on twice). The trainer reads the flag at
step boundaries, between two SFT warm-start steps, before a step's update and inside the long parts
(the decode loop, dynamic-sampling rounds: ``StepAbandoned``; an evaluation); all ranks agree through
an all-reduce, the last completed state is saved (an RL step, or the warm start as far as it went)
and the process exits with ``EXIT_PREEMPTED`` (or ``EXIT_PREEMPTED_NOTHING_SAVED`` when this run
completed nothing) so the batch script can requeue and resume. Once the code is decided the entry
point ignores the stop signals (exit_status.ignore_stop_signals): more of them change nothing.

Fault injection (tests only): ``MEGATRON_GSPO_FAULTS="kind@step[:rank],..."`` with kinds
  nan_logprob  make rank's old log-probs of the first micro-batch of every minibatch non-finite
               in that step (the loss and gradients follow: the NaN guard must catch it)
  raise        raise RuntimeError at the start of that step
  kill         SIGKILL this process at the start of that step
  kill_in_save SIGKILL this process while the checkpoint of that step is half written
A fault without ``:rank`` fires on every rank. Unset in production: every check is a dict lookup.
``FaultInjection`` applies them from outside the loop, as a trainer hook.
"""

from __future__ import annotations

import os
import signal
import time
from typing import Optional

from megatron_gspo.exit_status import (  # noqa: F401 (re-exported)
    EXIT_PREEMPTED,
    EXIT_PREEMPTED_NOTHING_SAVED,
    EXIT_TOO_MANY_SKIPS,
    GRACEFUL,
)
from megatron_gspo.hooks import TrainerHook

_KINDS = ("nan_logprob", "raise", "kill", "kill_in_save")


# The signals that mean "save and stop" (SIGQUIT stays a hard stop): the launcher's supervisor delivers
# the same ones (exit_status.GRACEFUL). The entry point catches them all (under the launcher the ranks
# inherit them ignored from torchrun: see exit_status.supervise); a Trainer built in another program
# takes TERM and USR1 only, leaving Ctrl-C to that program.
STOP_SIGNALS = GRACEFUL


class PreemptionFlag:
    """Set by a stop signal; one per process (``install``), shared by everything that checks it.

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


class StepAbandoned(Exception):
    """Raised, on every rank at once, inside a step that a stop signal cut short (rollout.py votes
    after each generation round; generation.generate stops decoding at once). Nothing of the step was
    applied: the trainer saves the last completed state and exits. ``where``: "in generation round 3";
    ``elapsed_s``: how long the step had run (set by the trainer)."""

    def __init__(self, step: int, where: str, elapsed_s: float = 0.0):
        super().__init__(f"step {step} abandoned {where}")
        self.step, self.where, self.elapsed_s = step, where, elapsed_s


class Faults:
    def __init__(self, spec: Optional[str] = None, rank: int = 0) -> None:
        spec = os.environ.get("MEGATRON_GSPO_FAULTS", "") if spec is None else spec
        self.rank = rank
        self._at: dict[tuple[str, int], Optional[int]] = {}
        for item in filter(None, (x.strip() for x in spec.split(","))):
            try:
                kind, rest = item.split("@")
                step, _, r = rest.partition(":")
                if kind not in _KINDS:
                    raise ValueError
                self._at[(kind, int(step))] = int(r) if r else None
            except ValueError:
                raise ValueError(f"MEGATRON_GSPO_FAULTS: cannot parse {item!r}; expected kind@step[:rank] "
                                 f"with kind in {list(_KINDS)}") from None

    def active(self, kind: str, step: int) -> bool:
        if (kind, step) not in self._at:
            return False
        r = self._at[(kind, step)]
        return r is None or r == self.rank

    def at_step_start(self, step: int) -> None:
        if self.active("raise", step):
            raise RuntimeError(f"injected fault: rank {self.rank} raises at step {step}")
        if self.active("kill", step):
            os.kill(os.getpid(), signal.SIGKILL)

    def save_hook(self, step: int):
        if not self.active("kill_in_save", step):
            return None

        def hook(phase: str, path: str) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        return hook


class FaultInjection(TrainerHook):
    """``MEGATRON_GSPO_FAULTS`` (or ``spec``) applied to a trainer, for the reliability tests."""

    def __init__(self, spec: Optional[str] = None, rank: int = 0) -> None:
        self.faults = Faults(spec, rank)

    def at_step_start(self, trainer) -> None:
        self.faults.at_step_start(trainer.step + 1)

    def after_rollout(self, trainer, batch) -> None:
        if not self.faults.active("nan_logprob", trainer.step + 1):
            return
        for mini in batch.minibatches:
            rows = batch.micro[mini[0]]
            batch.old_logprobs[rows] = batch.old_logprobs[rows].masked_fill(batch.mask[rows], float("nan"))

    def during_save(self, trainer, tmp_dir: str) -> None:
        hook = self.faults.save_hook(trainer.step)
        if hook is not None:
            hook("save", tmp_dir)

