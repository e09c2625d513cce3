"""The non-finite update guard's count, and the state a stop for too many skipped updates goes back to.

An update whose loss or gradients are not finite on some rank is skipped on every rank (trainer/loop.py);
``train.max_consecutive_skips`` of them in a row stop the run (exit 76, runtime/exit_status.py). That stop
saves what a stop signal at the start of the step would have saved (trainer/stopping.py): the state after
the last *completed* step N, or nothing new when the periodic save of step N holds it. The count of skips
is part of the training state (``SkipCount``, in every checkpoint): a resumed run continues it.

A step is num_minibatches updates, and the consecutive count only restarts at an applied one: with
``train.num_minibatches > train.max_consecutive_skips`` the stop can come inside step N+1 after its first
updates were applied, when the weights and the optimizer in memory are no longer those of any completed
step. ``StepStart`` keeps what such a stop must go back to: the data position and the skip count as the
step began (its prompts are drawn again after a resume, its skips counted again) and, only where that stop would write the state (step N has no
periodic save, StopControl.writes_state), a host copy of the weights, the optimizer (master weights,
Adam states) and the schedule, taken before the step's first update. With the defaults (2 minibatches,
5 skips) no copy is ever taken; where one is, it costs a device-to-host copy of the rank's model and
optimizer state per step (save every step, ``checkpoint.save_interval=1``, to need none).
"""

from __future__ import annotations

import copy
from typing import Optional

import torch


class SkipCount:
    """Skipped updates: ``consecutive`` (since the last applied one) and ``total`` (the run's, resumes included)."""

    def __init__(self) -> None:
        self.consecutive = 0
        self.total = 0

    def skipped(self) -> None:
        self.consecutive += 1
        self.total += 1

    def applied(self) -> None:
        self.consecutive = 0

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive, "total": self.total}

    def load_state_dict(self, d: Optional[dict]) -> None:
        """``d``: a checkpoint's ``extra["skips"]``; None (a checkpoint older than the count): zero."""
        d = d or {}
        self.consecutive, self.total = int(d.get("consecutive", 0)), int(d.get("total", 0))


def _inner_optimizers(optimizer) -> list:
    """The torch optimizers under megatron's (one per part of a ChainedOptimizer): their param groups hold the
    tensors an update writes (the fp32 master weights, or the model's own parameters), their state Adam's."""
    return [o.optimizer for o in getattr(optimizer, "chained_optimizers", [optimizer])]


def _host(t: torch.Tensor) -> torch.Tensor:
    return t.detach().to("cpu", copy=True)  # host memory on purpose: the device has no room for a second copy


class StepStart:
    """What a stop for too many skips inside a step goes back to (module doc). ``ddp``, ``sampler``, ``skips``:
    the trainer's. Per step: ``begin`` (the data position; ``keep``: whether a stop inside this step would write
    the state; the optimizer and scheduler, built after the warm start), ``before_update`` (each update), then
    on such a stop ``rewind``. Updates outside a begun step (a test driving ``Trainer.train_on``) keep nothing."""

    def __init__(self, ddp, sampler, skips: SkipCount) -> None:
        self.ddp, self.sampler, self.skips = ddp, sampler, skips
        self.optimizer = self.scheduler = None
        self.data_state: Optional[dict] = None
        self.skips_state: Optional[dict] = None
        self.keep = False
        self.updated = False
        self._copy: Optional[dict] = None

    def begin(self, data_state: dict, keep: bool, optimizer, scheduler) -> None:
        self.data_state, self.keep, self.updated, self._copy = data_state, keep, False, None
        self.optimizer, self.scheduler = optimizer, scheduler
        self.skips_state = self.skips.state_dict()

    def before_update(self) -> None:
        """Called before each optimizer step of the step; the first one copies the state when ``keep``."""
        if not self.updated and self.keep:
            self._copy = self._take()
        self.updated = True

    def rewind(self) -> None:
        """The data position and skip count as the step began and, if an update of it was applied, the weights,
        optimizer and schedule from before it (when they were kept: else the stop writes nothing of them)."""
        if self.data_state is None:  # no step begun
            return
        self.sampler.load_state_dict(self.data_state)
        self.skips.load_state_dict(self.skips_state)
        if self.updated and self._copy is not None:
            self._restore(self._copy)
        self._copy = None

    def _params(self) -> list[torch.Tensor]:
        """Every tensor an update writes, each once: the model's parameters, the optimizers' (master) parameters."""
        seen, out = set(), []
        groups = [list(self.ddp.parameters())] + [g["params"] for o in _inner_optimizers(self.optimizer)
                                                 for g in o.param_groups]
        for p in (p for ps in groups for p in ps):
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
        return out

    def _take(self) -> dict:
        inner = _inner_optimizers(self.optimizer)
        scaler = getattr(self.optimizer, "grad_scaler", None)  # fp16's loss scale (None in bf16 / fp32)
        return {
            "params": [_host(p) for p in self._params()],
            "state": [{id(p): {k: _host(v) if torch.is_tensor(v) else copy.deepcopy(v) for k, v in s.items()}
                       for p, s in o.state.items()} for o in inner],
            "groups": [[{k: copy.deepcopy(v) for k, v in g.items() if k != "params"} for g in o.param_groups]
                       for o in inner],
            "scheduler_steps": self.scheduler.num_steps,  # the schedule is a function of its step count
            "scaler": copy.deepcopy(scaler.state_dict()) if scaler is not None else None,
        }

    @torch.no_grad()
    def _restore(self, c: dict) -> None:
        for p, saved in zip(self._params(), c["params"], strict=True):
            p.copy_(saved)
        for o, state, groups in zip(_inner_optimizers(self.optimizer), c["state"], c["groups"], strict=True):
            by_id = {id(p): p for g in o.param_groups for p in g["params"]}
            for p in [p for p in o.state if id(p) not in state]:  # Adam's states made by the update (a first one)
                del o.state[p]
            for pid, s in state.items():
                live = o.state[by_id[pid]]
                for k, v in s.items():  # an update adds no key to a state that exists: each tensor has its place
                    if torch.is_tensor(v):
                        live[k].copy_(v)
                    else:
                        live[k] = v
            for g, saved in zip(o.param_groups, groups, strict=True):
                g.update(saved)
        # back to the count (its load_state_dict adds to the current one); step() sets the groups' lr and wd again
        self.scheduler.step(increment=c["scheduler_steps"] - self.scheduler.num_steps)
        scaler = getattr(self.optimizer, "grad_scaler", None)
        if scaler is not None and c["scaler"] is not None:
            scaler.load_state_dict(c["scaler"])
