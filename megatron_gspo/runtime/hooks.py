"""Hooks: code that runs at fixed points of the RL loop without living in it.

The supervised warm start (sft.SFTWarmStart), test fault injection (testing.faults.FaultInjection) and the
comparison experiment's routing probe (experiments/compare) and the rollout sources' own (the remote source's
async timing, the rollout dump) all attach here, so that ``Trainer.run`` stays the loop and nothing else. Override
what you need; every method is a no-op. The interface sits in runtime/, below both the trainer and the rollout
sources (``megatron_gspo.trainer.TrainerHook`` re-exports it).

Call order in ``Trainer.run`` (one RL step is ``at_step_start`` .. ``after_step``)::

    before_training            model built, resume checkpoint chosen (trainer.resumed: a training
                               checkpoint; trainer.checkpoints.warm_start: one of an unfinished SFT
                               warm start); no RL optimizer yet, no KL-reference snapshot yet
    for each step:
        at_step_start
        after_rollout(batch)   rollout, rewards, advantages and old log-probs ready; may edit batch
        after_update(k)        after each applied optimizer step (minibatch k of the step)
        after_step(metrics)    the step's reduced metrics, before they are logged
    close                      always, also after an error

``during_save(tmp_dir)`` runs inside a checkpoint save, after the files are written and before the
checkpoint is made complete (fault injection kills the process there).
"""

from __future__ import annotations

from typing import Iterable


class TrainerHook:
    def before_training(self, trainer) -> None:
        pass

    def at_step_start(self, trainer) -> None:
        pass

    def after_rollout(self, trainer, batch) -> None:
        pass

    def after_update(self, trainer, minibatch: int) -> None:
        pass

    def after_step(self, trainer, metrics: dict) -> None:
        pass

    def during_save(self, trainer, tmp_dir: str) -> None:
        pass

    def close(self, trainer) -> None:
        pass


class Hooks(TrainerHook):
    """Several hooks called in order, as one."""

    def __init__(self, hooks: Iterable[TrainerHook] = ()) -> None:
        self.hooks = list(hooks)

    def add(self, hook: TrainerHook) -> None:
        self.hooks.append(hook)

    def before_training(self, trainer) -> None:
        for h in self.hooks:
            h.before_training(trainer)

    def at_step_start(self, trainer) -> None:
        for h in self.hooks:
            h.at_step_start(trainer)

    def after_rollout(self, trainer, batch) -> None:
        for h in self.hooks:
            h.after_rollout(trainer, batch)

    def after_update(self, trainer, minibatch: int) -> None:
        for h in self.hooks:
            h.after_update(trainer, minibatch)

    def after_step(self, trainer, metrics: dict) -> None:
        for h in self.hooks:
            h.after_step(trainer, metrics)

    def during_save(self, trainer, tmp_dir: str) -> None:
        for h in self.hooks:
            h.during_save(trainer, tmp_dir)

    def close(self, trainer) -> None:
        for h in self.hooks:
            h.close(trainer)
