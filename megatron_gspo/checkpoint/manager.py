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

A job that will write into ``checkpoint.save`` holds its lock (lock.py) from construction to ``close()``;
a resume that finds the checkpoint already at ``train.num_steps`` (``finished``) takes none, loads no
tensor and writes nothing. ``checkpoint.load`` as initial weights is checked against the job's model
config first (config_change.check_load_config).

A checkpoint of step 0 is one of the supervised warm start, saved when a stop signal cut it short (or
came before step 1 completed): ``warm_start`` is its progress, and the warm start continues from it.
"""

from __future__ import annotations

import logging
import os
from typing import Callable, Optional

import torch

from megatron_gspo.runtime import comm
from megatron_gspo.runtime.exit_status import StopReason, StoppedFor
from megatron_gspo.checkpoint.config_change import WARM_START, allowed, check_load_config, check_resume_config
from megatron_gspo.checkpoint.directory import (TRACKER, has_manifest, iter_dir, iter_steps, no_complete_checkpoint,
                                               remove_partial_saves, scan)
from megatron_gspo.checkpoint.lock import SaveLock, refusal as lock_refusal
from megatron_gspo.checkpoint.storage import check_compatible, check_complete, load_model
from megatron_gspo.checkpoint.torch_dist_files import read_common
from megatron_gspo.checkpoint.space import needed, no_space_message
from megatron_gspo.checkpoint.training import DiskRefusedSave, load_checkpoint, save_checkpoint
from megatron_gspo.checkpoint.training import saved_runs as read_saved_runs
from megatron_gspo.config import CheckpointConfig, to_dict
from megatron_gspo.errors import CheckpointError

log = logging.getLogger("megatron_gspo")

_NONE, _ITSELF = -1, -2  # broadcast codes: no complete checkpoint; the path is an iteration directory


MODEL_CONFIG_FILES = ("model_config.yaml", "model_config.yml", "model_config.json")


def saved_model_config(ckpt_dir: str) -> tuple[Optional[dict], str]:
    """(the model section a checkpoint was written with, where it was read) or (None, ""): a converted
    checkpoint's model_config.{yaml,yml,json} (checkpoints_tools.hf_to_megatron writes one; in the checkpoint
    directory or its parent: flat ModelConfig fields or a job's ``model:``), else a trainer checkpoint's job
    (common.pt's extra.config.model)."""
    import json

    import yaml

    for folder in (ckpt_dir, os.path.dirname(os.path.abspath(ckpt_dir))):
        for name in MODEL_CONFIG_FILES:
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                continue
            try:
                with open(path, encoding="utf-8") as f:
                    data = json.load(f) if name.endswith(".json") else yaml.safe_load(f)
            except (OSError, ValueError, yaml.YAMLError) as e:
                raise CheckpointError(f"{path}: cannot read the checkpoint's model config ({e})") from None
            if isinstance(data, dict) and isinstance(data.get("model"), dict):
                data = data["model"]
            if not isinstance(data, dict):
                raise CheckpointError(f"{path}: expected a mapping of model.* keys, got {type(data).__name__}")
            return data, path
    model = ((read_common(ckpt_dir).get("extra") or {}).get("config") or {}).get("model")
    return (model, os.path.join(ckpt_dir, "common.pt")) if isinstance(model, dict) else (None, "")


class CheckpointManager:
    """``checkpoint.*`` for one run. Construction is collective (rank 0 verifies, all agree)."""

    def __init__(self, cfg: CheckpointConfig, state, num_steps: Optional[int] = None) -> None:
        self.cfg, self.state, self.num_steps = cfg, state, num_steps
        self.skipped: list[tuple[str, str]] = []  # (rank 0) damaged checkpoints newer than resume_dir
        self.lock: Optional[SaveLock] = None  # (rank 0) checkpoint.save's, while this job may write there
        if cfg.save:  # a root another job is training into is refused before minutes of verifying it
            self._agree(lock_refusal(cfg.save, cfg.force_unlock) if state.is_main else None, "checkpoint.save is in use")
        # resume = continue the newest complete checkpoint under save (or load); with no checkpoint there
        # yet, a resume request is a fresh start (initial weights from checkpoint.load, if given)
        root = (cfg.save or cfg.load) if cfg.resume else None
        self.resume_dir = self._settle(root, required=False) if root else None
        self.initial_weights = None
        if self.resume_dir is None and cfg.load:
            self.initial_weights = self._settle(cfg.load, required=True)
        self._common: Optional[dict] = None
        self._tracked: Optional[dict] = None  # what save_step writes (track)
        self._runs: Optional[Callable[[], dict]] = None  # the trackers' runs save_step writes (keep_runs)
        # resumed at train.num_steps already: the run trains and writes nothing (restore and save_final know)
        self.finished = self.nothing_to_train()
        if self.finished is not None and state.is_main:
            log.info("%s", self.finished)
        if cfg.save and self.finished is None:  # a run that will write holds the root until close()
            self._take_lock()

    def _agree(self, refusal: Optional[str], what: str) -> None:
        """Collective: rank 0's ``refusal`` (None: none) raised as a CheckpointError on every rank."""
        if comm.any_rank(refusal is not None, self.state.device, what=f"checkpoint: {what}"):
            raise CheckpointError(refusal or f"{what} (rank 0's error names why)")

    def _take_lock(self) -> None:
        refusal = None
        if self.state.is_main:
            try:
                self.lock = SaveLock(self.cfg.save, force=self.cfg.force_unlock).acquire()
            except CheckpointError as e:
                refusal = str(e)
            else:  # no other job writes here now: a dead one's partial saves only take space
                if gone := remove_partial_saves(self.cfg.save):
                    log.info("checkpoint.save=%s: removed the partial save(s) of a run that died: %s", self.cfg.save,
                             ", ".join(gone))
        self._agree(refusal, "checkpoint.save is in use")

    def close(self) -> None:
        """Give back checkpoint.save's lock (every way out of a run: Trainer.close, a refused start-up)."""
        if self.lock is not None:
            self.lock.release()
            self.lock = None

    def nothing_to_train(self) -> Optional[str]:
        """What to say when the resume checkpoint is already at ``num_steps`` (a requeued job that had finished,
        a resume of a finished run): the run trains and writes nothing, and ends with 0. Else None."""
        if self.num_steps is None or not self.resuming:
            return None
        step = int(self.saved_common().get("step", 0))
        if step < self.num_steps:
            return None
        return (f"nothing to train: {self.resume_dir} is at step {step} and train.num_steps={self.num_steps}; "
                "nothing was written (raise train.num_steps to train further)")

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
        if self._common is None:  # weights_only: a common.pt that would run code is refused naming the file
            self._common = read_common(self.resume_dir) if self.resume_dir else {}
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
            self._check_load_config(current)
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

    def _check_load_config(self, current: dict) -> None:
        """checkpoint.load as initial weights: the model config it was written with (a converted checkpoint's
        model_config.yaml, a trainer checkpoint's job) against the job's, key by key (config_change.ARCHITECTURE)."""
        if self.initial_weights is None:
            return
        check_complete(self.initial_weights)  # a directory that is no checkpoint is refused as that first
        saved, source = saved_model_config(self.initial_weights)
        if saved is None:
            return
        accepted = check_load_config(self.cfg.load, source, saved, current.get("model", {}), self.cfg.allow_config_change)
        if accepted and self.state.is_main:
            log.warning("checkpoint.load=%s: model config differs from %s (accepted by checkpoint.allow_config_change): "
                        "%s", self.cfg.load, source, "; ".join(map(str, accepted)))

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
        """Load the resume checkpoint (already verified) into everything; {"step", "extra", "path"}. A run with
        nothing to train (``finished``) loads no tensor: its step and data position are all it uses."""
        if self.finished is not None:
            common = self.saved_common()
            return {"step": int(common["step"]), "extra": common.get("extra") or {}, "path": self.resume_dir}
        return load_checkpoint(self.resume_dir, model, optimizer, scheduler, extra_models=extra_models, verified=True)

    def due(self, step: int) -> bool:
        """A periodic save is due after ``step`` completed steps."""
        return bool(self.cfg.save and self.cfg.save_interval and step % self.cfg.save_interval == 0)

    def track(self, model, optimizer, scheduler, *, job, data, extra_models: dict,
              during_save: Optional[Callable[[str], None]] = None, skips=None) -> None:
        """The training state every later ``save_step`` writes, handed over once (trainer.optim.setup_optimizer,
        beside the restore of the same state): the policy ``model`` (DDP), its ``optimizer`` and
        ``scheduler``, the ``extra_models`` by name, and, read when a save runs, the position of ``data``
        (its ``state_dict()``), the count of skipped updates ``skips`` (its ``state_dict()``; None: not
        written) and the ``job`` config (the resume compares it, config_change.py)."""
        self._tracked = dict(model=model, optimizer=optimizer, scheduler=scheduler, job=job, data=data,
                             extra_models=extra_models, during_save=during_save, skips=skips)

    def keep_runs(self, runs: Callable[[], dict]) -> None:
        """Every later save writes ``runs()`` (rank 0's run trackers' runs, MetricsLogger.runs) beside the state
        (logger_runs.json), for a resumed job to continue them (``saved_runs``)."""
        self._runs = runs

    def saved_runs(self) -> dict:
        """(rank 0) {tracker: run} of the checkpoint this job resumes; {} for a fresh start."""
        return read_saved_runs(self.resume_dir) if self.resuming else {}

    def save_step(self, step: int) -> Optional[str]:
        """Collective: the tracked state after ``step`` completed steps, now (a periodic save, the end of the
        run, a stop). None when checkpoint.save is unset."""
        if self._tracked is None:
            raise RuntimeError("CheckpointManager.save_step before track(): nothing to save")
        t = self._tracked
        extra = {"data": t["data"].state_dict(), "config": to_dict(t["job"])}
        if t["skips"] is not None:
            extra["skips"] = t["skips"].state_dict()
        runs = self._runs() if self._runs is not None and self.state.is_main else None
        return self.save(step, t["model"], t["optimizer"], t["scheduler"], extra_models=t["extra_models"],
                         extra=extra, during_save=t["during_save"], runs=runs)

    def save_if_due(self, step: int) -> None:
        """At the end of step ``step``: the periodic save, when ``due``."""
        if self.due(step):
            self.save_step(step)

    def save_final(self, step: int) -> None:
        """At the end of the run: the last step, unless its periodic save holds it already (or the run resumed
        at train.num_steps: it trained nothing, and a full disk must not fail it)."""
        if not self.due(step) and self.finished is None:
            self.save_step(step)

    def save(self, step: int, model, optimizer, scheduler, *, extra: dict, extra_models: Optional[dict] = None,
             during_save: Optional[Callable[[str], None]] = None, runs: Optional[dict] = None) -> Optional[str]:
        """Collective. Writes <save>/iter_<step> atomically; None when checkpoint.save is unset."""
        if not self.cfg.save:
            return None
        hook = (lambda phase, tmp: during_save(tmp)) if during_save is not None else None
        try:
            return save_checkpoint(self.cfg.save, step, model, optimizer, scheduler, extra=extra,
                                   is_main=self.state.is_main, keep_last=self.cfg.keep_last, fault_hook=hook,
                                   extra_models=extra_models, runs=runs)
        except DiskRefusedSave as e:  # one line, exit 74 (space.py)
            raise StoppedFor(self._refused_save(step, e.cause), StopReason.CHECKPOINT_WRITE_FAILED) from None

    def _refused_save(self, step: int, cause: str) -> str:
        root = self.cfg.save
        done = [s for s in iter_steps(root) if s < step and has_manifest(iter_dir(root, s))]
        last = done[0] if done else None
        last_dir = iter_dir(root, last) if last is not None else None
        job = self._tracked["job"] if self._tracked is not None else None
        return no_space_message(root, step, cause, needed(job, last_dir), last, last_dir)
