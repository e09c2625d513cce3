"""The stop story of a run: when every rank agrees to stop, what it saves, and the one line that says so.

A run stops before its last step for a stop signal (SIGTERM / SIGUSR1 from SLURM, a preemption,
``scancel``, torchrun stopping every rank when one exits; runtime/stop.py's ``PreemptionFlag``), or
because the rollout ranks of an asynchronous job are lost (rollout/remote.py raises ``StoppedFor`` with a
rollout rank's StopReason). Either way every rank raises ``StoppedFor`` together, after saving what this run
completed, and the entry point turns its reason into the exit code (runtime/exit_status.py):

    what this run completed                  saved                                   exit
    an RL step                               the state after it (unless the         75
                                             periodic save of that step holds it)
    SFT warm-start steps, no RL step         the warm start as far as it went,      75
                                             as the checkpoint of step 0
    nothing                                  nothing (the newest checkpoint is       79
                                             still the state to resume from)
    rollout ranks lost (async)               the state after the last trained step  75, or 1 when one raised
    too many skipped updates in a row        as for a stop signal as the step began   76
    (train.max_consecutive_skips)            (trainer/skips.py: the step's own updates, if any, undone)

Work a stop signal cuts short raises runtime/stop.py's ``Cancelled`` where it reads the flag (the decode loop,
the dynamic-sampling rounds, scoring, the worker pool, the making of examples, an evaluation), on every rank at
once where ranks must agree; it is handled here: a step's by ``check`` (nothing of the step applied: the last
completed state saved), an evaluation's by ``evaluation_cut_short`` (the step stands; the next boundary stops),
start-up's by ``start_up_cut_short`` (exit 79).

``StopControl`` is the trainer's only contact with all this: ``requested`` (a collective vote),
``check`` (at a step boundary, in the warm start, or for a step a signal cut short), ``evaluation_cut_short``,
``without_rollouts``, ``too_many_skips`` (with ``writes_state``: whether it would write the state in memory) and
``finished`` (the note for a signal that came too late to cut anything short).
"""

from __future__ import annotations

import logging
import time
from typing import Callable, NoReturn, Optional

from megatron_gspo.runtime import comm
from megatron_gspo.checkpoint.directory import has_manifest, iter_dir
from megatron_gspo.config import JobConfig, to_dict
from megatron_gspo.runtime.exit_status import EXIT_PREEMPTED, EXIT_PREEMPTED_NOTHING_SAVED, StopReason, StoppedFor
from megatron_gspo.runtime.stop import Cancelled, PreemptionFlag

log = logging.getLogger("megatron_gspo")


class StopControl:
    """When a run stops and what it saves (module doc). Built once by the Trainer with what a stop needs:

    cfg: the JobConfig (checkpoint.save; the config a warm-start checkpoint records); state: the
    ParallelState (the vote's device, rank 0 speaks); flag: the process's PreemptionFlag; source: the
    RolloutSource (a rollout rank's stop request, rollout ranks that are gone); checkpoints: the
    CheckpointManager; model, sampler: the DDP-wrapped policy and the RL prompt sampler (a warm-start
    checkpoint holds the weights and the data position); during_save: called inside a save (hooks).

    ``first_step``: the step this run's RL loop started at (a resume's), set by the trainer once the training
    state exists (None before: start-up, the SFT warm start); ``warm_start``: the SFT warm start of this run
    (sft.SFTRun), once it began. The step itself is handed to every call."""

    def __init__(self, cfg: JobConfig, state, flag: PreemptionFlag, source, checkpoints, model, sampler,
                 during_save: Callable[[str], None]) -> None:
        self.cfg, self.state, self.flag, self.source, self.checkpoints = cfg, state, flag, source, checkpoints
        self.model, self.sampler, self.during_save = model, sampler, during_save
        self.first_step: Optional[int] = None
        self.warm_start = None

    def requested(self, what: str) -> bool:
        """Whether any rank got a stop signal (a collective vote: every rank calls it at the same point)."""
        return comm.any_rank(self._signalled(), self.state.device, what=what)

    def _signalled(self) -> bool:
        """This rank got a stop signal, or (async, trainer rank 0) a rollout rank did and asked to stop."""
        return self.flag.set or self.source.peer_stop_request() is not None

    def _signal_name(self) -> str:
        """The stop signal, as the stop line names it: this rank's, a rollout rank's that asked the trainer to
        stop (async), or "(on another rank)"."""
        if self.flag.received is None and (request := self.source.peer_stop_request()) is not None:
            return request
        return self.flag.name

    # ------------------------------------------------------------------------------------------
    def check(self, step: int, abandoned: Optional[Cancelled] = None, agreed: bool = False) -> None:
        """If any rank got a stop signal: all save what this run completed (``step`` RL steps so far, or the
        SFT warm start as far as it went) and raise StoppedFor (module doc). Called at a step boundary
        (a collective vote), or with ``abandoned`` / ``agreed`` when every rank already agreed (the Cancelled
        of a step left in flight, the warm start's own vote). In the RL loop, a rollout rank found gone (async:
        torchrun stops every rank when one dies, and its signal may come first) makes it the stop for lost rollout
        ranks."""
        if abandoned is None and not agreed and not self.requested("preemption vote"):
            return
        t_stop = time.perf_counter()
        name = self._signal_name()
        try:
            if self.first_step is not None:  # the RL loop runs: its training state can be saved
                self.source.stop_if_ranks_lost(name)
        except StoppedFor as e:  # the rollout ranks' loss, the only stop it raises
            self.without_rollouts(step, e)
        first = step if self.first_step is None else self.first_step  # before the RL loop, none of it is done
        ws = self.warm_start
        in_sft = ws is not None and not ws.finished
        sft_saved = step == first and ws is not None and ws.progressed
        when = (f"step {step + 1} abandoned {abandoned.where} after {abandoned.elapsed_s:.1f} s"
                if abandoned is not None else f"in the SFT warm start after SFT step {ws.done} of {ws.steps}" if in_sft
                else "after the SFT warm start, before step 1" if sft_saved
                else "during start-up" if step == first else f"between steps {step} and {step + 1}")
        nothing = step == first and not sft_saved
        if self.state.is_main:
            log.warning("%s: %s, %s; %s", name, self.flag.timing(), when,
                        "nothing to save yet" if nothing else f"saving SFT step {ws.done}" if sft_saved
                        else f"saving step {step}")
        if nothing:
            raise self._nothing_saved(step, name, when, abandoned is not None)
        if sft_saved:
            raise self._warm_start_saved(step, name, when, t_stop)
        saved = self._save_last_completed_step(step)
        raise StoppedFor(f"preempted by signal {name} before step {step + 1}: {saved} (step {step}); exiting "
                         f"with {EXIT_PREEMPTED} (resume with checkpoint.resume=true); {self.flag.timing()}, "
                         f"{when}, save {time.perf_counter() - t_stop:.1f} s", StopReason.PREEMPTED)

    def _nothing_saved(self, step: int, name: str, when: str, abandoned: bool) -> StoppedFor:
        where = (f"{self.checkpoints.resume_dir} is still the state to resume from"
                 if self.checkpoints.resume_dir is not None
                 else "no checkpoint yet: a resumed run starts from the beginning")
        return StoppedFor(
            f"preempted by signal {name} {f'in step {step + 1}' if abandoned else 'during start-up'}: nothing "
            f"to save yet (no step of this run completed; {where}); exiting with {EXIT_PREEMPTED_NOTHING_SAVED}; "
            f"{self.flag.timing()}, {when}", StopReason.PREEMPTED_NOTHING_SAVED)

    def _warm_start_saved(self, step: int, name: str, when: str, t_stop: float) -> StoppedFor:
        ws = self.warm_start
        in_sft = not ws.finished
        saved = self.save_warm_start()
        then = (f"the warm start continues at SFT step {ws.done + 1}" if in_sft
                else "the warm start is over, step 1 comes next")
        return StoppedFor(
            f"preempted by signal {name} {'in the SFT warm start' if in_sft else f'before step {step + 1}'}: "
            f"{saved} (SFT step {ws.done} of {ws.steps}); exiting with {EXIT_PREEMPTED} (resume with "
            f"checkpoint.resume=true: {then}); {self.flag.timing()}, {when}, save {time.perf_counter() - t_stop:.1f} s",
            StopReason.PREEMPTED)

    def evaluation_cut_short(self, step: int, e: Cancelled) -> None:
        """Every rank together (the evaluation's vote raised ``e``): the evaluation after ``step`` is dropped, the
        step stands (saved and stopped at the next boundary, whose vote the signal carries)."""
        if self.state.is_main:
            log.warning("%s: evaluation after step %d abandoned %s after %.1f s; step %d stands, without eval/* metrics",
                        self.flag.name, step, e.where, e.elapsed_s, step)

    def without_rollouts(self, step: int, e: StoppedFor) -> NoReturn:
        """Every trainer rank together (RemoteSource raises StoppedFor on all of them): save the state
        after ``step`` (the weights of version ``step``, the data position after the last consumed batch)
        and stop with the rollout ranks' reason."""
        saved = self._save_last_completed_step(step)
        raise StoppedFor(f"stopping before step {step + 1}: {e}; {saved} (resume with "
                         "checkpoint.resume=true: the rollouts in flight are generated again)", e.reason)

    def writes_state(self, step: int) -> bool:
        """Whether a stop with ``step`` RL steps completed writes the training state in memory (not: nothing,
        or the periodic save of that step, already on disk): what a stop inside the next step must go back to."""
        if not self.cfg.checkpoint.save:
            return False
        if step == self.first_step:  # no RL step of this run: the warm start, if it progressed, or nothing
            return self.warm_start is not None and self.warm_start.progressed
        return not self.checkpoints.due(step)

    def too_many_skips(self, step: int, why: str) -> NoReturn:
        """Every rank together (the skip is a collective vote), inside step ``step + 1`` with the state in memory
        back at the end of step ``step`` (trainer/skips.py): save what a stop signal at this step's start would
        have, and stop with TOO_MANY_SKIPS."""
        ws, ck = self.warm_start, self.cfg.checkpoint
        if step == self.first_step and not (ws is not None and ws.progressed):
            saved = (f"nothing saved: no step of this run completed ({self.checkpoints.resume_dir} is still the state "
                     "to resume from)" if self.checkpoints.resume_dir is not None
                     else "nothing saved: no step of this run completed")
        elif step == self.first_step:
            saved = self.save_warm_start() + f" (SFT step {ws.done} of {ws.steps})"
        else:
            saved = f"{self._save_last_completed_step(step)} (step {step}, the last completed one)"
        raise StoppedFor(f"{why}; {saved}" + (f"; resume with checkpoint.resume=true from {ck.save}"
                                              if ck.save else ""), StopReason.TOO_MANY_SKIPS)

    def finished(self, step: int) -> None:
        """The run completed: a stop signal that came during the last step or after it cut nothing short."""
        if self.flag.set and self.state.is_main:
            log.warning("%s: %s, during the last step or after it: the run is complete (step %d%s); exiting with 0",
                        self.flag.name, self.flag.timing(), step, " saved" if self.cfg.checkpoint.save else "")

    # ------------------------------------------------------------------------------------------
    def save_warm_start(self) -> str:
        """Every rank: the SFT warm start as far as it went, as the checkpoint of step 0 (its weights, its
        optimizer while it is unfinished, its progress and data position; the KL reference is taken after
        it, so none). Returns what the stop line says about it."""
        ck, ws = self.cfg.checkpoint, self.warm_start
        self.checkpoints.save(0, self.model, ws.optimizer, None, extra_models={},
                              extra={"data": self.sampler.state_dict(), "config": to_dict(self.cfg),
                                     "sft": ws.state_dict()},
                              during_save=self.during_save)
        return f"warm start saved to {ck.save}" if ck.save else "NO checkpoint written (checkpoint.save is not set)"

    def _save_last_completed_step(self, step: int) -> str:
        """Every rank, when the job stops early: save the state after ``step``, unless the periodic save at
        the end of that step holds it already (its directory has a manifest only once complete): writing it
        again would spend the scheduler's lead time on a copy. The ranks vote, so all save or none. Returns
        what the stop line says about the checkpoint."""
        ck = self.cfg.checkpoint
        just_saved = bool(ck.save and step and self.checkpoints.due(step) and has_manifest(iter_dir(ck.save, step)))
        if not comm.all_ranks(just_saved, self.state.device, what="preemption: step already saved"):
            self.checkpoints.save_step(step)
        return f"checkpoint saved to {ck.save}" if ck.save else "NO checkpoint written (checkpoint.save is not set)"


def start_up_cut_short(flag: PreemptionFlag, e: Cancelled) -> StoppedFor:
    """The stop for a signal that cut start-up's work short (``e``: the making of a task's examples, before the
    Trainer and its StopControl exist): nothing to save yet, exit 79; every rank decides alone (no collective
    runs while examples are made, and every rank makes them)."""
    return StoppedFor(f"preempted by signal {flag.name} during start-up: nothing to save yet (no step of this run "
                      f"completed); exiting with {EXIT_PREEMPTED_NOTHING_SAVED}; {flag.timing()}, {e.where}",
                      StopReason.PREEMPTED_NOTHING_SAVED)
