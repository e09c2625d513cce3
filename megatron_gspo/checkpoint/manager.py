"""The trainer's one checkpoint object: where a run starts from, and its saves.

Finding the checkpoint to resume from reads every file of the newest candidate against its
manifest (a disk can corrupt a complete checkpoint). That happens once, on rank 0, which broadcasts
the step it settled on: at 30B with Adam state a checkpoint is hundreds of GB, and every rank
re-verifying it costs minutes of I/O before step 1.
Saves rotate by manifest (directory.rotate) and never re-read what they keep.

What a resume (``checkpoint.resume=true``) does with what it finds under the root:

* nothing (no iter_* directory, no tracker): a fresh start, the first run of a job;
* the newest checkpoint verifies: it is continued;
* the newest does not verify (damaged after it was written: its manifest is written last, so a save
  that died leaves only an iter_*.tmp) but an older one does: the older one is continued, with a
  warning naming each damaged directory; the run trains the steps after it again (the same steps: a
  resume is exact) and its saves replace the damaged directories as it reaches their steps;
* none verifies: refused (CheckpointError, exit 2) naming every damaged directory, never a fresh start
  beside them (under a requeue loop that would silently throw the run away).

A checkpoint of step 0 is one of the supervised warm start, saved when a stop signal cut it short (or
came before step 1 completed): ``warm_start`` is its progress, and the warm start continues from it.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import torch

from megatron_gspo.runtime import comm
from megatron_gspo.checkpoint.config_change import WARM_START, allowed, check_resume_config
from megatron_gspo.checkpoint.directory import TRACKER, iter_dir, iter_steps, no_complete_checkpoint, scan
from megatron_gspo.checkpoint.storage import check_compatible, load_model
from megatron_gspo.checkpoint.training import load_checkpoint, save_checkpoint
from megatron_gspo.config import CheckpointConfig, to_dict
from megatron_gspo.errors import CheckpointError

log = logging.getLogger("megatron_gspo")

_NONE, _ITSELF = -1, -2  # broadcast codes: no complete checkpoint; the path is an iteration directory


class CheckpointManager:
    """``checkpoint.*`` for one run. Construction is collective (rank 0 verifies, all agree)."""

    def __init__(self, cfg: CheckpointConfig, state) -> None:
        self.cfg, self.state = cfg, state
        self.skipped: list[tuple[str, str]] = []  # (rank 0) damaged checkpoints newer than resume_dir
        # resume = continue the newest complete checkpoint under save (or load); with no checkpoint there
        # yet, a resume request is a fresh start (initial weights from checkpoint.load, if given)
        root = (cfg.save or cfg.load) if cfg.resume else None
        self.resume_dir = self._settle(root, required=False) if root else None
        self.initial_weights = None
        if self.resume_dir is None and cfg.load:
            self.initial_weights = self._settle(cfg.load, required=True)
        self._common: Optional[dict] = None
        self._tracked: Optional[dict] = None  # what save_step writes (track)

    @property
    def resuming(self) -> bool:
        """A training checkpoint is continued (model, optimizer, schedule, data position and step)."""
        return self.resume_dir is not None and self.warm_start is None

    @property
    def warm_start(self) -> Optional[dict]:
        """The progress {"step", "steps", "data"} of the supervised warm start when ``resume_dir`` is a
        checkpoint of one (step 0, sft.SFTRun.state_dict), else None."""
        if self.resume_dir is None:
            return None
        return (self.saved_common().get("extra") or {}).get("sft")

    def saved_common(self) -> dict:
        """The resume checkpoint's non-tensor state (step, extra: data position, config, ...), read once."""
        if self._common is None:
            from megatron.core import dist_checkpointing

            self._common = dist_checkpointing.load_common_state_dict(self.resume_dir) if self.resume_dir else {}
        return self._common

    def _settle(self, path: str, required: bool) -> Optional[str]:
        """The iteration directory ``path`` stands for, decided on rank 0 and broadcast: a checkpoint
        root gives its newest checkpoint that verifies; any other directory is itself (initial weights,
        e.g. a converted HF model) or, for a resume (``required=False``), no checkpoint yet. A root where
        nothing verifies is refused, for a resume too (module doc)."""
        is_root = os.path.isfile(os.path.join(path, TRACKER)) or bool(iter_steps(path))
        if not is_root and not required:
            return None
        code, why = _ITSELF, None
        if self.state.is_main and is_root:
            step, self.skipped = scan(path)  # the one full read of the files
            code = _NONE if step is None else step
            if step is None:
                why = no_complete_checkpoint(path, self.skipped)
            for bad, reason in self.skipped if step is not None else ():
                log.warning("checkpoint %s is incomplete or corrupt (%s); %s from %s, the newest that verifies",
                            bad, reason, "resuming" if not required else "loading", iter_dir(path, step))
        t = torch.tensor([code], dtype=torch.long, device=self.state.device)
        code = int(comm.broadcast(t, 0, None, what="checkpoint: the step rank 0 verified").item())
        if code == _ITSELF:
            return path
        if code == _NONE:
            why = why or (f"{path}: no complete checkpoint (every iter_* directory failed verification; rank 0's "
                          "error names them)")
            if required:
                raise CheckpointError(why)
            raise CheckpointError(
                f"{why}; checkpoint.resume=true does not start the run over beside a damaged checkpoint: restore "
                f"it from a copy, or move {path} aside to start afresh")
        return iter_dir(path, code)

    def check_config(self, current: dict) -> None:
        """When resuming: compare the job (``config.to_dict``) with the one the checkpoint was written
        with (config_change.py). A difference that changes the training trajectory is refused by key
        (ConfigError) unless checkpoint.allow_config_change lists it; the accepted ones are logged."""
        if self.resume_dir is None:
            return
        saved = (self.saved_common().get("extra") or {}).get("config")
        if saved is None:
            log.warning("%s holds no job config (an older checkpoint): the resumed job cannot be compared with "
                        "the one that wrote it", self.resume_dir)
            return
        ws = self.warm_start
        fixed = WARM_START if ws is not None and ws["step"] < ws["steps"] else ()
        accepted = check_resume_config(self.resume_dir, saved, current, self.cfg.allow_config_change, fixed)
        changed = [c for c in accepted if c.why != "not in the checkpoint's config"]  # not new keys of the code
        if changed and self.state.is_main:
            log.info("resume: config changed since %s (accepted): %s", self.resume_dir,
                     "; ".join(f"{c}{' (checkpoint.allow_config_change)' if c.why.startswith('checkpoint') else ''}"
                               for c in changed))

    def change_allowed(self, key: str) -> bool:
        """checkpoint.allow_config_change names ``key`` ("section.key") or its section."""
        return allowed(key, self.cfg.allow_config_change)

    def prepare(self, model) -> None:
        """Before DDP wraps the model: refuse a resume checkpoint of another shape before any work,
        or load ``checkpoint.load``'s weights for a fresh start."""
        if self.resume_dir is not None:
            check_compatible(model, self.resume_dir)
        elif self.initial_weights is not None:
            load_model(model, self.initial_weights)

    def restore(self, model, optimizer, scheduler, extra_models: Optional[dict] = None) -> dict:
        """Load the resume checkpoint (already verified) into everything; {"step", "extra", "path"}."""
        return load_checkpoint(self.resume_dir, model, optimizer, scheduler, extra_models=extra_models, verified=True)

    def due(self, step: int) -> bool:
        """A periodic save is due after ``step`` completed steps."""
        return bool(self.cfg.save and self.cfg.save_interval and step % self.cfg.save_interval == 0)

    def track(self, model, optimizer, scheduler, *, job, data, extra_models: dict,
              during_save: Optional[Callable[[str], None]] = None) -> None:
        """The training state every later ``save_step`` writes, handed over once (trainer.optim.setup_optimizer,
        beside the restore of the same state): the policy ``model`` (DDP), its ``optimizer`` and
        ``scheduler``, the ``extra_models`` by name, and, read when a save runs, the position of ``data``
        (its ``state_dict()``) and the ``job`` config (the resume compares it, config_change.py)."""
        self._tracked = dict(model=model, optimizer=optimizer, scheduler=scheduler, job=job, data=data,
                             extra_models=extra_models, during_save=during_save)

    def save_step(self, step: int) -> Optional[str]:
        """Collective: the tracked state after ``step`` completed steps, now (a periodic save, the end of the
        run, a stop). None when checkpoint.save is unset."""
        if self._tracked is None:
            raise RuntimeError("CheckpointManager.save_step before track(): nothing to save")
        t = self._tracked
        return self.save(step, t["model"], t["optimizer"], t["scheduler"], extra_models=t["extra_models"],
                         extra={"data": t["data"].state_dict(), "config": to_dict(t["job"])},
                         during_save=t["during_save"])

    def save_if_due(self, step: int) -> None:
        """At the end of step ``step``: the periodic save, when ``due``."""
        if self.due(step):
            self.save_step(step)

    def save_final(self, step: int) -> None:
        """At the end of the run: the last step, unless its periodic save holds it already."""
        if not self.due(step):
            self.save_step(step)

    def save(self, step: int, model, optimizer, scheduler, *, extra: dict, extra_models: Optional[dict] = None,
             during_save: Optional[Callable[[str], None]] = None) -> Optional[str]:
        """Collective. Writes <save>/iter_<step> atomically; None when checkpoint.save is unset."""
        if not self.cfg.save:
            return None
        hook = (lambda phase, tmp: during_save(tmp)) if during_save is not None else None
        return save_checkpoint(self.cfg.save, step, model, optimizer, scheduler, extra=extra,
                               is_main=self.state.is_main, keep_last=self.cfg.keep_last, fault_hook=hook,
                               extra_models=extra_models)
