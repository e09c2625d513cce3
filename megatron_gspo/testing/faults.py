"""Fault injection for the reliability tests: ``MEGATRON_GSPO_FAULTS="kind@step[:rank],..."``.

The entry point adds it when that variable is set (train.py's ``injected_faults``: a trainer hook, and
the same object for an async job's rollout rank); nothing else of the package imports this module, so
a production run never loads it. A test that builds a Trainer itself passes ``FaultInjection(spec)`` in
its hooks. Kinds:
  nan_logprob  make rank's old log-probs of the first micro-batch of every minibatch non-finite
               in that step (the loss and gradients follow: the NaN guard must catch it)
  nan_logprob_late  the same from the second minibatch of that step on: the first minibatch's update
               is applied, the later ones are skipped (a stop for too many skips inside a step)
  raise        raise RuntimeError at the start of that step
  kill         SIGKILL this process at the start of that step
  sigterm      send this process SIGTERM at the start of that step (a preempted rank)
  kill_in_save SIGKILL this process while the checkpoint of that step is half written
A fault without ``:rank`` fires on every rank. ``FaultInjection`` applies them from outside the loop,
as a trainer hook; an asynchronous rollout rank calls ``step_starts`` as its generation of a step begins.
"""

from __future__ import annotations

import os
import signal
from typing import Optional

from megatron_gspo.runtime.hooks import TrainerHook

FAULTS_ENV = "MEGATRON_GSPO_FAULTS"
_KINDS = ("nan_logprob", "nan_logprob_late", "raise", "kill", "sigterm", "kill_in_save")


class Faults:
    def __init__(self, spec: Optional[str] = None, rank: int = 0) -> None:
        spec = os.environ.get(FAULTS_ENV, "") if spec is None else spec
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
                raise ValueError(f"{FAULTS_ENV}: cannot parse {item!r}; expected kind@step[:rank] "
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
        if self.active("sigterm", step):
            os.kill(os.getpid(), signal.SIGTERM)

    def save_hook(self, step: int):
        if not self.active("kill_in_save", step):
            return None

        def hook(phase: str, path: str) -> None:
            os.kill(os.getpid(), signal.SIGKILL)

        return hook


class FaultInjection(TrainerHook):
    """``MEGATRON_GSPO_FAULTS`` (or ``spec``) applied to a trainer (hook) or a rollout rank (step_starts);
    ``rank``: the process's global rank (torchrun's RANK), which ``kind@step:rank`` names."""

    def __init__(self, spec: Optional[str] = None, rank: int = 0) -> None:
        self.faults = Faults(spec, rank)

    @classmethod
    def from_env(cls) -> Optional["FaultInjection"]:
        """The faults ``MEGATRON_GSPO_FAULTS`` asks for, for this process (rank: ``RANK``), or None."""
        spec = os.environ.get(FAULTS_ENV, "")
        return cls(spec, rank=int(os.environ.get("RANK", "0"))) if spec.strip() else None

    def step_starts(self, step: int) -> None:
        """Step ``step`` (1-based) begins on this rank: raise / die / get SIGTERM as the spec says."""
        self.faults.at_step_start(step)

    def at_step_start(self, trainer) -> None:
        self.step_starts(trainer.step + 1)

    def after_rollout(self, trainer, batch) -> None:
        if self.faults.active("nan_logprob", trainer.step + 1):
            poisoned = batch.minibatches
        elif self.faults.active("nan_logprob_late", trainer.step + 1):
            poisoned = batch.minibatches[1:]
        else:
            return
        for mini in poisoned:
            rows = batch.micro[mini[0]]
            batch.old_logprobs[rows] = batch.old_logprobs[rows].masked_fill(batch.mask[rows], float("nan"))

    def during_save(self, trainer, tmp_dir: str) -> None:
        hook = self.faults.save_hook(trainer.step)
        if hook is not None:
            hook("save", tmp_dir)
