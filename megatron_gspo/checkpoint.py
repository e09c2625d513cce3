"""Model weights in megatron dist_checkpointing (torch_dist) format.

torch_dist keys are global (layers stacked, experts on an expert axis, TP shards described by
offsets), so a checkpoint written under one TP/EP layout loads under any other. The sharded
state dict must be built the same way on save and load: ``model.sharded_state_dict()``.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import zlib
from typing import Optional

import torch

from megatron_gspo.model import unwrap


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the model."""


def _model_sharded_state_dict(model, prefix: str = ""):
    return unwrap(model).sharded_state_dict(prefix=prefix)


# ----------------------------------------------------------------------------------------------
# How the files are written: megatron's torch_dist strategy, every write in this process
# ----------------------------------------------------------------------------------------------
# megatron-core's torch_dist save (TorchDistSaveShardedStrategy + FileSystemWriterAsync) is built
# for asynchronous saves: even a synchronous dist_checkpointing.save forks one writer process per
# file, and they report to a multiprocessing Manager queue, a server process spawned at the first
# save that lives as long as the trainer (plus multiprocessing's resource tracker). Those helpers
# are what broke preemption: torchrun (and SLURM) deliver SIGTERM to the worker's whole process
# group, the Manager dies of it, and the checkpoint written *because of* that SIGTERM fails in
# dist_checkpointing.save with BrokenPipeError, leaving iter_*.tmp behind; a SIGKILLed trainer
# left them orphaned. Our saves are synchronous anyway (the step waits for the files), so nothing
# is gained from other processes: the strategy below is megatron's own (same planning,
# de-duplication, file names, metadata and fsync, loadable by any megatron tool), with the
# per-file writes run by threads of the calling rank (as torch.distributed.checkpoint's own
# FileSystemWriter does) and the results handed over in memory. A signal then only sets the
# trainer's preemption flag; nothing else is there to be killed or orphaned.


def _write_buckets_in_threads(transforms: list, rank: int, write_buckets: list, results_queue) -> None:
    """Stands in for FileSystemWriterAsync.write_preloaded_data_multiproc: the same per-file
    writer (megatron's write_preloaded_data), one thread per file instead of one forked process."""
    import queue
    from concurrent.futures import ThreadPoolExecutor

    from megatron.core.dist_checkpointing.strategies.filesystem_async import FileSystemWriterAsync

    def write(index: int, bucket) -> tuple:
        results, done = queue.Queue(), queue.Queue()
        done.put(index)  # write_preloaded_data marks its task done on this queue
        FileSystemWriterAsync.write_preloaded_data(transforms, index, bucket, results, done, True)
        return results.get_nowait()  # (index, [WriteResult]) or (index, the exception)

    with ThreadPoolExecutor(max_workers=max(1, len(write_buckets)), thread_name_prefix="ckpt-write") as pool:
        outputs = list(pool.map(write, range(len(write_buckets)), write_buckets))
    errors = [out for _, out in outputs if isinstance(out, Exception)]
    # what megatron's finalize step reads back: {file index: results}, or the first error
    results_queue.put(errors[0] if errors else dict(outputs))


def _save_strategy():
    """megatron's torch_dist save strategy with every write in this process (see above)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if filesystem_async._results_queue is None:
        # megatron creates this lazily as a spawn-context Manager().Queue() (the long-lived server
        # process); our writes happen in this process, so an in-process queue does the same job.
        filesystem_async._results_queue = queue.Queue()

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret):
            request = super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret)
            if request.async_fn is None:  # nothing to write on this rank
                return request
            transforms = [writer.transforms] if hasattr(writer, "transforms") else []
            return request._replace(async_fn=functools.partial(_write_buckets_in_threads, transforms))

    return InProcessTorchDistSave("torch_dist", 1)


def save_model(model, ckpt_dir: str, extra_common: Optional[dict] = None) -> None:
    """Collective: every rank calls it. Writes ``ckpt_dir`` (must not contain a checkpoint)."""
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)
    sd = {"model": _model_sharded_state_dict(model)}
    if extra_common:
        sd.update(extra_common)
    dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=_save_strategy())


def check_compatible(model, ckpt_dir: str) -> None:
    """Compare every tensor's global shape with the checkpoint's metadata before loading, so a
    checkpoint of another model shape fails with the key and both shapes, not deep in torch."""
    from megatron.core.dist_checkpointing import load_tensors_metadata
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.dist_checkpointing.dict_utils import nested_values

    if not os.path.isfile(os.path.join(ckpt_dir, "metadata.json")):
        raise CheckpointError(f"{ckpt_dir}: not a dist_checkpointing checkpoint (no metadata.json)")
    try:
        meta = load_tensors_metadata(ckpt_dir)
    except Exception as e:  # unreadable / truncated .metadata
        raise CheckpointError(f"{ckpt_dir}: cannot read checkpoint metadata: {e}") from e
    missing = []
    for sh in nested_values(_model_sharded_state_dict(model)):
        if not isinstance(sh, ShardedTensor):
            continue
        key = f"model.{sh.key}" if f"model.{sh.key}" in meta else sh.key
        if key not in meta:
            missing.append(sh.key)
            continue
        have = tuple(meta[key].global_shape)
        if have != tuple(sh.global_shape):
            raise CheckpointError(
                f"{ckpt_dir}: tensor {sh.key} has shape {have} in the checkpoint but the model "
                f"expects {tuple(sh.global_shape)}; was it saved from a different model config?"
            )
    if missing:
        raise CheckpointError(f"{ckpt_dir}: checkpoint lacks {len(missing)} model tensors, e.g. {missing[:3]}")


def load_model(model, ckpt_dir: str) -> dict:
    """Collective. Loads weights into ``model`` (any layout); returns the non-tensor extras."""
    from megatron.core import dist_checkpointing

    ckpt_dir = resolve(ckpt_dir)
    check_compatible(model, ckpt_dir)
    sd = {"model": _model_sharded_state_dict(model)}
    loaded = dist_checkpointing.load(sd, ckpt_dir)
    unwrap(model).load_state_dict(loaded.pop("model"), strict=True)
    return loaded


def dist_checkpoint_to_tensors(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Read a torch_dist checkpoint into {global key: full tensor} in this one process, no
    process group needed (for tests and tools; holds the whole checkpoint in memory)."""
    import tempfile

    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "ckpt.pt")
        dcp_to_torch_save(ckpt_dir, out)
        return torch.load(out, map_location="cpu", weights_only=False)


# ----------------------------------------------------------------------------------------------
# Training checkpoints: model + optimizer + scheduler + data position + step + config
# ----------------------------------------------------------------------------------------------
# Layout (Megatron-LM names): <save>/iter_0000010/ (torch_dist + manifest.json) and
# <save>/latest_checkpointed_iteration.txt. Crash safety:
#   1. every rank writes into iter_XXXXXXX.tmp; all files are fsynced;
#   2. rank 0 writes manifest.json (size and crc32 of every file), fsyncs it, renames the directory
#      into place and fsyncs the parent;
#   3. the tracker file is replaced (write + fsync + rename) last.
# A directory without a valid manifest, or whose files differ from it, is incomplete or corrupt:
# loading skips it with a warning naming it and takes the newest checkpoint that verifies.

TRACKER = "latest_checkpointed_iteration.txt"
# How megatron lays out a DistributedOptimizer's state in the checkpoint. "fully_reshardable" stores
# its shards as per-parameter tensors (the replicated optimizer's layout), so a checkpoint resumes
# under another TP / EP / DP size; megatron 0.16's own default ("fully_sharded_model_space") is
# deprecated and its dist_checkpointing refuses to save it ("ShardedTensor.flattened_range is not
# supported", seen with the distributed optimizer on the CPU). The replicated optimizer ignores it.
OPTIMIZER_CKPT_METADATA = {"chained_optim_avoid_prefix": True, "distrib_optim_sharding_type": "fully_reshardable"}
MANIFEST = "manifest.json"

log = logging.getLogger("megatron_gspo")


def iter_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def _iter_steps(root: str) -> list[int]:
    """Steps of the iter_XXXXXXX directories under root (temporary ones excluded), newest first."""
    if not os.path.isdir(root):
        return []
    steps = [int(d[5:]) for d in os.listdir(root) if d.startswith("iter_") and d[5:].isdigit()]
    return sorted(steps, reverse=True)


def _crc32(path: str) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_manifest(ckpt_dir: str, step: int) -> None:
    files = {}
    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        if name == MANIFEST or not os.path.isfile(path):
            continue
        _fsync_path(path)
        files[name] = {"bytes": os.path.getsize(path), "crc32": _crc32(path)}
    _replace_file(os.path.join(ckpt_dir, MANIFEST), json.dumps({"step": step, "files": files}, indent=1))


def verify_checkpoint(ckpt_dir: str) -> Optional[str]:
    """None if ``ckpt_dir`` is complete and intact, else the reason it is not."""
    mpath = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isfile(mpath):
        return "no manifest.json (the save did not finish)"
    try:
        manifest = json.load(open(mpath, encoding="utf-8"))
        files = manifest["files"]
    except (ValueError, KeyError) as e:
        return f"unreadable manifest.json ({e})"
    for name, meta in files.items():
        path = os.path.join(ckpt_dir, name)
        if not os.path.isfile(path):
            return f"file {name} is missing"
        if os.path.getsize(path) != meta["bytes"]:
            return f"file {name} has {os.path.getsize(path)} bytes, the manifest says {meta['bytes']}"
        if _crc32(path) != meta["crc32"]:
            return f"file {name} fails its checksum"
    return None


def latest_complete(root: str) -> Optional[int]:
    """The newest step under ``root`` whose checkpoint verifies; a bad newer one is skipped with a
    warning naming it (the tracker is a hint, the manifests are the truth)."""
    for step in _iter_steps(root):
        why = verify_checkpoint(iter_dir(root, step))
        if why is None:
            return step
        log.warning("checkpoint %s is incomplete or corrupt (%s); falling back to an earlier one",
                    iter_dir(root, step), why)
    return None


def resolve(path: str) -> str:
    """A checkpoint root -> its newest complete iteration directory; an iteration dir -> itself."""
    if os.path.isfile(os.path.join(path, TRACKER)) or _iter_steps(path):
        step = latest_complete(path)
        if step is None:
            raise CheckpointError(f"{path}: no complete checkpoint (every iter_* directory failed verification)")
        return iter_dir(path, step)
    return path


def _barrier() -> None:
    from megatron_gspo import comm

    comm.barrier()


def _replace_file(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _training_sharded_state_dict(model, optimizer, is_loading: bool, extra_models: Optional[dict] = None) -> dict:
    from megatron_gspo import cpu_compat

    model_sd = _model_sharded_state_dict(model)
    sd = {"model": model_sd}
    for name, m in (extra_models or {}).items():  # e.g. the frozen KL reference, keys "ref_model.*"
        sd[name] = _model_sharded_state_dict(m, prefix=f"{name}.")
    if optimizer is not None:
        with cpu_compat.optimizer_context():
            sd["optimizer"] = optimizer.sharded_state_dict(
                model_sd, is_loading=is_loading, metadata=OPTIMIZER_CKPT_METADATA)
    return sd


def _optimizer_parts(optimizer) -> int:
    return len(getattr(optimizer, "chained_optimizers", [optimizer]))


def rotate(root: str, keep_last: int) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints (0 keeps everything). The
    newest complete checkpoint is never deleted, whatever state the others are in."""
    import shutil

    if keep_last <= 0:
        return []
    complete = [s for s in _iter_steps(root) if verify_checkpoint(iter_dir(root, s)) is None]
    doomed = complete[max(1, keep_last):]
    for s in doomed:
        shutil.rmtree(iter_dir(root, s), ignore_errors=True)
    return [iter_dir(root, s) for s in doomed]


def _remove_leftovers(root: str) -> None:
    """Delete the iter_*.tmp directories of saves that died half-way (SIGKILL, node failure): one
    save runs at a time, so once this one is in place every other .tmp is garbage. Until then they
    sit harmlessly, never taken for a checkpoint."""
    import shutil

    for d in os.listdir(root):
        if d.startswith("iter_") and d.endswith(".tmp") and os.path.isdir(os.path.join(root, d)):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def save_checkpoint(root: str, step: int, model, optimizer=None, scheduler=None, extra: Optional[dict] = None,
                    is_main: bool = True, keep_last: int = 0, fault_hook=None,
                    extra_models: Optional[dict] = None) -> str:
    """Collective. Writes <root>/iter_<step> atomically (see above) and points the tracker at it."""
    import shutil

    from megatron.core import dist_checkpointing

    final = iter_dir(root, step)
    tmp = final + ".tmp"
    if is_main:
        os.makedirs(root, exist_ok=True)
        if os.path.exists(tmp):  # leftover of a crashed save
            shutil.rmtree(tmp)
        os.makedirs(tmp)
    _barrier()
    sd = _training_sharded_state_dict(model, optimizer, is_loading=False, extra_models=extra_models)
    sd["step"] = step
    if optimizer is not None:
        sd["optimizer_parts"] = _optimizer_parts(optimizer)
    if scheduler is not None:
        sd["scheduler"] = scheduler.state_dict()
    if extra:
        sd["extra"] = extra
    dist_checkpointing.save(sd, tmp, sharded_strategy=_save_strategy())
    if fault_hook is not None:
        fault_hook("save", tmp)  # tests: die with a half-written checkpoint
    _barrier()
    if is_main:
        _write_manifest(tmp, step)
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_path(root)
        _replace_file(os.path.join(root, TRACKER), str(step))
        _remove_leftovers(root)
        rotate(root, keep_last)
    _barrier()
    return final


def load_checkpoint(path: str, model, optimizer=None, scheduler=None, extra_models: Optional[dict] = None) -> dict:
    """Collective. ``path`` is a checkpoint root (its newest complete iteration) or an iter_
    directory. Returns {"step": int, "extra": dict, "path": str}."""
    from megatron.core import dist_checkpointing

    path = resolve(path)
    why = verify_checkpoint(path) if os.path.isfile(os.path.join(path, MANIFEST)) else None
    if why is not None:
        raise CheckpointError(f"{path}: {why}")
    check_compatible(model, path)
    if optimizer is not None:
        # Weights and Adam moments are stored under global, layout-free keys, but megatron keeps
        # one optimizer per parameter family (dense / expert), and how many exist depends on the
        # layout (EP > 1 splits them); their non-tensor state cannot be re-split on load.
        saved = dist_checkpointing.load_common_state_dict(path).get("optimizer_parts")
        if saved is not None and saved != _optimizer_parts(optimizer):
            raise CheckpointError(
                f"{path}: the optimizer state was saved as {saved} megatron optimizer(s) and this layout "
                f"builds {_optimizer_parts(optimizer)} (dense/expert parameters are split when "
                "expert_model_parallel_size > 1); resume with the saving layout's EP, or start from these "
                f"weights with a fresh optimizer: checkpoint.load={path} checkpoint.resume=false")
    sd = _training_sharded_state_dict(model, optimizer, is_loading=True, extra_models=extra_models)
    loaded = dist_checkpointing.load(sd, path)
    unwrap(model).load_state_dict(loaded["model"], strict=True)
    for name, m in (extra_models or {}).items():
        unwrap(m).load_state_dict(loaded[name], strict=True)
    if optimizer is not None:
        if "optimizer" not in loaded:
            raise CheckpointError(f"{path}: has no optimizer state (a weights-only checkpoint?); "
                                  "load it with checkpoint.load as initial weights instead of resuming")
        from megatron_gspo import cpu_compat

        with cpu_compat.optimizer_context():
            optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and "scheduler" in loaded:
        scheduler.load_state_dict(loaded["scheduler"])
    return {"step": int(loaded.get("step", 0)), "extra": loaded.get("extra", {}), "path": path}
