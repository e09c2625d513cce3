"""Model weights in megatron dist_checkpointing (torch_dist) format, and how the files get written.

torch_dist keys are global (layers stacked, experts on an expert axis, TP shards described by
offsets), so a checkpoint written under one TP/EP layout loads under any other. The sharded
state dict must be built the same way on save and load: ``model.sharded_state_dict()``.
"""

from __future__ import annotations

import functools
import os
from typing import Optional

import torch

from megatron_gspo.checkpoint.directory import resolve
from megatron_gspo.errors import CheckpointError
from megatron_gspo.model import unwrap


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
    sd = {"model": model_sharded_state_dict(model)}
    if extra_common:
        sd.update(extra_common)
    dist_checkpointing.save(sd, ckpt_dir, sharded_strategy=save_strategy())


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
    for sh in nested_values(model_sharded_state_dict(model)):
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
    sd = {"model": model_sharded_state_dict(model)}
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
