"""Model weights in megatron dist_checkpointing (torch_dist) format, and how the files get written.

torch_dist keys are global (layers stacked, experts on an expert axis, TP shards described by
offsets), so a checkpoint written under one TP/EP layout loads under any other. The sharded
state dict must be built the same way on save and load: ``model.sharded_state_dict()``.
"""

from __future__ import annotations

import functools
import logging
import os
from typing import Optional

import torch

from megatron_gspo.checkpoint.directory import resolve
from megatron_gspo.checkpoint.torch_dist_files import (CORE_FILES, MEGATRON_METADATA, missing_files, read_common,
                                                       read_dcp_metadata)
from megatron_gspo.errors import CheckpointError
from megatron_gspo.model.gpt import unwrap

log = logging.getLogger(__name__)


def model_sharded_state_dict(model, prefix: str = ""):
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
    """Stands in for FileSystemWriterAsync.write_preloaded_data_multiproc (megatron-core 0.16) and
    write_preloaded_data_multithread (0.19): the same per-file writer (megatron's write_preloaded_data),
    one thread per file, a file's exception handed over as it was raised."""
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


def save_strategy():
    """megatron's torch_dist save strategy with every write in this process (see above)."""
    import queue

    from megatron.core.dist_checkpointing.strategies import filesystem_async
    from megatron.core.dist_checkpointing.strategies.torch import TorchDistSaveShardedStrategy

    if filesystem_async._results_queue is None:
        # megatron creates this lazily as a spawn-context Manager().Queue() (the long-lived server
        # process); our writes happen in this process, so an in-process queue does the same job.
        filesystem_async._results_queue = queue.Queue()

    class InProcessTorchDistSave(TorchDistSaveShardedStrategy):
        def _get_save_and_finalize_callbacks(self, writer, save_state_dict_ret, *args):
            # *args: megatron-core 0.19 passes the async strategy ("mcore" for a synchronous save)
            request = super()._get_save_and_finalize_callbacks(writer, save_state_dict_ret, *args)
            if request.async_fn is None:  # nothing to write on this rank
                return request
            if getattr(writer, "use_msc", False):  # megatron-core 0.19's multi-storage client: its own writer
                return request
            # megatron-core 0.19's writer writes with threads of this process too, but a file's OSError
            # reaches the caller as "error: <class 'OSError'>", the errno lost (its results check asserts
            # on the exception): a full disk could not be told from a bug (space.write_failure). Ours
            # hands the OSError itself to megatron's finalize step, under either version.
            transforms = [writer.transforms] if hasattr(writer, "transforms") else []
            return request._replace(async_fn=functools.partial(_write_buckets_in_threads, transforms))

    return InProcessTorchDistSave("torch_dist", 1)


def save_model(model, ckpt_dir: str, extra_common: Optional[dict] = None) -> None:
    """Collective: every rank calls it. Writes ``ckpt_dir`` (must not contain a checkpoint)."""
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)
    sd = {"model": model_sharded_state_dict(model)}
    if extra_common:
        sd.update(extra_common)
    dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=save_strategy())


def check_complete(ckpt_dir: str) -> None:
    """Refuse a directory that is not a whole torch_dist checkpoint (CheckpointError, one line): no
    metadata.json, or a core file or a data file its .metadata names missing; and one whose .metadata or
    common.pt would run code when megatron unpickles them (torch_dist_files.py). Run before megatron reads
    it, whose own failures are tracebacks (``'str' object has no attribute 'iterdir'`` for a missing common.pt)."""
    if not os.path.isdir(ckpt_dir):
        raise CheckpointError(f"{ckpt_dir}: no such checkpoint directory")
    if not os.path.isfile(os.path.join(ckpt_dir, MEGATRON_METADATA)):
        raise CheckpointError(f"{ckpt_dir}: not a dist_checkpointing checkpoint (no metadata.json)")
    md = read_dcp_metadata(ckpt_dir)
    missing = missing_files(ckpt_dir, md)
    if missing:
        named = [f for f in missing if f not in CORE_FILES]
        raise CheckpointError(f"{ckpt_dir}: not a complete checkpoint: {', '.join(missing)} missing"
                              + (" (named by its .metadata)" if named and len(named) == len(missing) else ""))
    read_common(ckpt_dir)


def checkpoint_metadata(ckpt_dir: str) -> dict:
    """{global key: ShardedTensor} and {unique key: ShardedObject} of what a torch_dist checkpoint holds
    (no data); CheckpointError when it is not a complete one (check_complete) or its metadata cannot be read."""
    from megatron.core.dist_checkpointing.serialization import load_sharded_metadata

    check_complete(ckpt_dir)
    try:
        return load_sharded_metadata(ckpt_dir)
    except Exception as e:  # unreadable / truncated .metadata
        raise CheckpointError(f"{ckpt_dir}: cannot read checkpoint metadata: {e}") from e


def _sharded_leaves(entry) -> list:
    """The ShardedTensors / ShardedObjects of one sharded-state-dict entry (factories built: megatron's
    SwiGLU linear_fc1 is a ShardedTensorFactory whose tensors are what the checkpoint holds)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensor, ShardedTensorFactory

    out = []
    for sh in nested_values(entry) if isinstance(entry, (dict, list)) else [entry]:
        if isinstance(sh, ShardedTensorFactory):
            out += _sharded_leaves(sh.build())
        elif isinstance(sh, (ShardedTensor, ShardedObject)):
            out.append(sh)
    return out


def _in_checkpoint(key: str, meta: dict) -> Optional[str]:
    return next((k for k in (f"model.{key}", key) if k in meta), None)


def is_optional_extra_state(name: str) -> bool:
    """A module's ``_extra_state`` (Transformer Engine's FP8 scaling state, megatron's placeholders): the
    local spec has none for its norms, the TE spec one per TE module; a checkpoint that lacks it loads with
    the module's own (fresh) extra state."""
    return name.endswith("._extra_state")


def missing_extra_states(sharded_sd: dict, meta: dict) -> list[str]:
    """The local names of ``sharded_sd`` (a model's sharded state dict) whose every shard is an optional
    extra state the checkpoint does not hold (TE's norm extra states in a local-spec checkpoint)."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    out = []
    for name, entry in sharded_sd.items():
        leaves = _sharded_leaves(entry)
        if (leaves and is_optional_extra_state(name) and all(isinstance(sh, ShardedObject) for sh in leaves)
                and any(_in_checkpoint(sh.unique_key, meta) is None for sh in leaves)):
            out.append(name)
    return out


def check_compatible(model, ckpt_dir: str, meta: Optional[dict] = None) -> None:
    """Compare every tensor's global shape with the checkpoint's metadata before loading, so a
    checkpoint of another model shape fails with the key and both shapes, not deep in torch; a missing
    tensor or object fails likewise, except optional extra states (is_optional_extra_state), which a
    load fills from the model (``load_model_state``): a checkpoint moves between the local and the
    Transformer Engine spec."""
    from megatron.core.dist_checkpointing.mapping import ShardedObject

    meta = checkpoint_metadata(ckpt_dir) if meta is None else meta
    sharded_sd = model_sharded_state_dict(model)
    optional = set(missing_extra_states(sharded_sd, meta))
    missing = []
    for name, entry in sharded_sd.items():
        if name in optional:
            continue
        for sh in _sharded_leaves(entry):
            key = _in_checkpoint(sh.unique_key if isinstance(sh, ShardedObject) else sh.key, meta)
            if key is None:
                missing.append(sh.key)
                continue
            if isinstance(sh, ShardedObject):
                continue
            have = tuple(meta[key].global_shape)
            if have != tuple(sh.global_shape):
                raise CheckpointError(
                    f"{ckpt_dir}: tensor {sh.key} has shape {have} in the checkpoint but the model "
                    f"expects {tuple(sh.global_shape)}; was it saved from a different model config?"
                )
    if missing:
        missing = sorted(set(missing))
        raise CheckpointError(f"{ckpt_dir}: checkpoint lacks {len(missing)} model tensors, e.g. {missing[:3]}")


def sharded_state_dict_to_load(model, ckpt_dir: str, meta: dict, sharded_sd: Optional[dict] = None,
                               prefix: str = "") -> tuple[dict, dict]:
    """(the sharded state dict to request from ``ckpt_dir``, the optional extra states it lacks, filled from
    the model: {local name: value}); ``load_model_state`` puts them together for a strict load."""
    sharded_sd = model_sharded_state_dict(model, prefix=prefix) if sharded_sd is None else sharded_sd
    absent = missing_extra_states(sharded_sd, meta)
    if not absent:
        return sharded_sd, {}
    own = unwrap(model).state_dict()
    filled = {name: own[name] for name in absent}
    if not torch.distributed.is_initialized() or torch.distributed.get_rank() == 0:
        log.info("%s holds no extra state for %d module(s) of this model (a checkpoint of the local spec loaded "
                 "into the Transformer Engine spec): they keep their fresh state (no FP8 scaling history), e.g. %s",
                 ckpt_dir, len(absent), absent[0])
    return {k: v for k, v in sharded_sd.items() if k not in filled}, filled


def load_model_state(model, loaded: dict, filled: dict) -> None:
    """Strict load of what the checkpoint gave plus the extra states it lacked (sharded_state_dict_to_load)."""
    unwrap(model).load_state_dict({**loaded, **filled}, strict=True)


def load_model(model, ckpt_dir: str) -> dict:
    """Collective. Loads weights into ``model`` (any layout, either spec); returns the non-tensor extras."""
    from megatron.core import dist_checkpointing

    ckpt_dir = resolve(ckpt_dir)
    meta = checkpoint_metadata(ckpt_dir)
    check_compatible(model, ckpt_dir, meta)
    model_sd, filled = sharded_state_dict_to_load(model, ckpt_dir, meta)
    loaded = dist_checkpointing.load({"model": model_sd}, ckpt_dir)
    load_model_state(model, loaded.pop("model"), filled)
    return loaded


def dist_checkpoint_to_tensors(ckpt_dir: str) -> dict[str, torch.Tensor]:
    """Read a torch_dist checkpoint's tensors into {global key: full tensor} in this one process, no
    process group needed (for tests and tools; holds the whole checkpoint in memory). Its byte objects
    (extra states) are not read: torch would unpickle them unrestricted (torch_dist_files.py)."""
    from torch.distributed.checkpoint import FileSystemReader, load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = read_dcp_metadata(ckpt_dir)

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):  # the metadata read above, without pickle.load
            return md

    import warnings

    out = {k: torch.empty(tuple(v.size), dtype=v.properties.dtype) for k, v in md.state_dict_metadata.items()
           if isinstance(v, TensorStorageMetadata)}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.filterwarnings("ignore", message=".*load in a single process")
        load(out, storage_reader=Reader(ckpt_dir), no_dist=True)
    return out
