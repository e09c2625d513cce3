"""Training checkpoints: model, optimizer, LR schedule, extra models and plain state (data position,
config), saved and loaded collectively and atomically (directory.py has the on-disk protocol)."""

from __future__ import annotations

import json
import os
import shutil
from typing import Optional

import torch

from megatron_gspo.runtime import comm
from megatron_gspo.checkpoint.directory import (
    MANIFEST,
    TRACKER,
    fsync_path,
    iter_dir,
    remove_leftovers,
    replace_file,
    resolve,
    rotate,
    verify_checkpoint,
    write_manifest,
)
from megatron_gspo.checkpoint.storage import (
    check_compatible,
    checkpoint_metadata,
    load_model_state,
    model_sharded_state_dict,
    save_strategy,
    sharded_state_dict_to_load,
)
from megatron_gspo.checkpoint.space import write_failure
from megatron_gspo.checkpoint.torch_dist_files import read_common
from megatron_gspo.errors import CheckpointError
from megatron_gspo.model.gpt import unwrap

# How megatron lays out a DistributedOptimizer's state in the checkpoint. "fully_reshardable" stores
# its shards as per-parameter tensors (the replicated optimizer's layout), so a checkpoint resumes
# under another TP / EP / DP size; megatron 0.16's own default ("fully_sharded_model_space") is
# deprecated and its dist_checkpointing refuses to save it ("ShardedTensor.flattened_range is not
# supported", seen with the distributed optimizer on the CPU). The replicated optimizer ignores it.
OPTIMIZER_CKPT_METADATA = {"chained_optim_avoid_prefix": True, "distrib_optim_sharding_type": "fully_reshardable"}


# The runs of the job's trackers (wandb, MLflow) in a checkpoint, which a resumed job continues
LOGGER_RUNS = "logger_runs.json"


def saved_runs(ckpt_dir: str) -> dict:
    """{tracker: run} of the checkpoint ``ckpt_dir`` (LOGGER_RUNS; {} when it holds none: saved without
    trackers, or before their first step). Verified with the rest of the checkpoint (its manifest)."""
    path = os.path.join(ckpt_dir, LOGGER_RUNS)
    if not os.path.isfile(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def _model_device(model) -> torch.device:
    """The job's device, where its parameters live (compat.optimizer_context keys on it)."""
    return next(unwrap(model).parameters()).device


def _training_sharded_state_dict(model, optimizer, is_loading: bool, extra_models: Optional[dict] = None) -> dict:
    from megatron_gspo.runtime import compat

    model_sd = model_sharded_state_dict(model)
    sd = {"model": model_sd}
    for name, m in (extra_models or {}).items():  # e.g. the frozen KL reference, keys "ref_model.*"
        sd[name] = model_sharded_state_dict(m, prefix=f"{name}.")
    if optimizer is not None:
        with compat.optimizer_context(_model_device(model)):
            sd["optimizer"] = optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata=OPTIMIZER_CKPT_METADATA)
    return sd


def _optimizer_parts(optimizer) -> int:
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


def save_checkpoint(root: str, step: int, model, optimizer=None, scheduler=None, extra: Optional[dict] = None,
                    is_main: bool = True, keep_last: int = 0, fault_hook=None,
                    extra_models: Optional[dict] = None, runs: Optional[dict] = None) -> str:
    """Collective. Writes <root>/iter_<step> atomically (see above) and points the tracker at it. ``runs``:
    rank 0's run trackers' runs ({name: {"id": ...}}, runtime/trackers), written by rank 0 to LOGGER_RUNS (a
    rank-0 state: in the common state every rank writes, the ranks' copies would differ). A write
    the disk refused (no space left, quota, read-only, I/O error: space.write_failure) raises
    DiskRefusedSave with the partial iter_<step>.tmp removed; any other failure propagates as it is."""
    final = iter_dir(root, step)
    tmp = final + ".tmp"
    try:
        _write(root, step, tmp, model, optimizer, scheduler, extra, is_main, fault_hook, extra_models, runs)
        if is_main:
            _publish(root, step, tmp, final, keep_last)
    except BaseException as e:  # torch's CheckpointException is a BaseException
        cause = None if isinstance(e, (KeyboardInterrupt, SystemExit)) else write_failure(e, tmp if os.path.isdir(tmp) else root)
        if cause is None:
            raise
        shutil.rmtree(tmp, ignore_errors=True)  # every rank that failed: a full disk gets its space back
        raise DiskRefusedSave(cause) from e
    comm.barrier()
    return final


class DiskRefusedSave(OSError):
    """The disk refused a checkpoint's files; ``cause`` in words (CheckpointManager says the rest)."""

    def __init__(self, cause: str):
        super().__init__(cause)
        self.cause = cause


def _write(root: str, step: int, tmp: str, model, optimizer, scheduler, extra, is_main: bool, fault_hook,
           extra_models, runs: Optional[dict] = None) -> None:
    """Every rank: the checkpoint's files into ``tmp``."""
    from megatron.core import dist_checkpointing

    if is_main:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp):  # leftover of a crashed save
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    comm.barrier()
    sd = _training_sharded_state_dict(model, optimizer, is_loading=False, extra_models=extra_models)
    sd["step"] = step
    if optimizer is not None:
        sd["optimizer_parts"] = _optimizer_parts(optimizer)
    if scheduler is not None:
        sd["scheduler"] = scheduler.state_dict()
    if extra:
        sd["extra"] = extra
    dist_checkpointing.save(sd, tmp, sharded_strategy=save_strategy())
    if is_main and runs:  # before the manifest, which then covers it
        with open(os.path.join(tmp, LOGGER_RUNS), "w", encoding="utf-8") as f:
            json.dump(runs, f)
    if fault_hook is not None:
        fault_hook("save", tmp)  # tests: die with a half-written checkpoint
    comm.barrier()


def _publish(root: str, step: int, tmp: str, final: str, keep_last: int) -> None:
    """Rank 0, once every rank wrote: the manifest last, the directory into place, the tracker, rotation."""
    write_manifest(tmp, step)
    if os.path.exists(final):  # this step again (a warm start saved twice, a damaged one redone):
        # moved aside, not deleted first, so that no moment is without the older copy
        if os.path.exists(final + ".old"):
            shutil.rmtree(final + ".old")
        os.replace(final, final + ".old")
    os.replace(tmp, final)
    fsync_path(root)
    replace_file(os.path.join(root, TRACKER), str(step))
    remove_leftovers(root)
    rotate(root, keep_last, upto=step)


def load_checkpoint(path: str, model, optimizer=None, scheduler=None, extra_models: Optional[dict] = None,
                    verified: bool = False) -> dict:
    """Collective. ``path`` is a checkpoint root (its newest complete iteration) or an iter_
    directory; ``verified=True``: an iteration directory whose files were already checked against
    its manifest (CheckpointManager does it once, on one rank). Returns {"step", "extra", "path"}."""
    from megatron.core import dist_checkpointing

    if not verified:
        path = resolve(path)
        why = verify_checkpoint(path) if os.path.isfile(os.path.join(path, MANIFEST)) else None
        if why is not None:
            raise CheckpointError(f"{path}: {why}")
    meta = checkpoint_metadata(path)
    check_compatible(model, path, meta)
    if optimizer is not None:
        # Weights and Adam moments are stored under global, layout-free keys, but megatron keeps
        # one optimizer per parameter family (dense / expert), and how many exist depends on the
        # layout (EP > 1 splits them); their non-tensor state cannot be re-split on load.
        saved = read_common(path).get("optimizer_parts")
        if saved is not None and saved != _optimizer_parts(optimizer):
            raise CheckpointError(
                f"{path}: the optimizer state was saved as {saved} megatron optimizer(s) and this layout "
                f"builds {_optimizer_parts(optimizer)} (dense/expert parameters are split when "
                "expert_model_parallel_size > 1); resume with the saving layout's EP, or start from these "
                f"weights with a fresh optimizer: checkpoint.load={path} checkpoint.resume=false")
    sd = _training_sharded_state_dict(model, optimizer, is_loading=True, extra_models=extra_models)
    # a checkpoint of the other spec lacks the Transformer Engine extra states (storage.py): requested
    # only where it holds them, the model's own kept for the rest
    filled = {}
    for name, m in [("model", model), *(extra_models or {}).items()]:
        sd[name], filled[name] = sharded_state_dict_to_load(m, path, meta, sharded_sd=sd[name])
    loaded = dist_checkpointing.load(sd, path)
    load_model_state(model, loaded["model"], filled["model"])
    for name, m in (extra_models or {}).items():
        load_model_state(m, loaded[name], filled[name])
    if optimizer is not None:
        if "optimizer" not in loaded:
            raise CheckpointError(f"{path}: has no optimizer state (a weights-only checkpoint?); "
                                  "load it with checkpoint.load as initial weights instead of resuming")
        from megatron_gspo.runtime import compat

        compat.align_param_groups(optimizer, loaded["optimizer"])
        with compat.optimizer_context(_model_device(model)):
            optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and "scheduler" in loaded:
        scheduler.load_state_dict(loaded["scheduler"])
    return {"step": int(loaded.get("step", 0)), "extra": loaded.get("extra", {}), "path": path}
