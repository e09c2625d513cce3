"""Model weights in megatron dist_checkpointing (torch_dist) format.

torch_dist keys are global (layers stacked, experts on an expert axis, TP shards described by
offsets), so a checkpoint written under one TP/EP layout loads under any other. The sharded
state dict must be built the same way on save and load: ``model.sharded_state_dict()``.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from megatron_gspo.model import unwrap


class CheckpointError(RuntimeError):
    """A checkpoint is missing, incomplete, or does not fit the model."""


def _model_sharded_state_dict(model, prefix: str = ""):
    return unwrap(model).sharded_state_dict(prefix=prefix)


def save_model(model, ckpt_dir: str, extra_common: Optional[dict] = None) -> None:
    """Collective: every rank calls it. Writes ``ckpt_dir`` (must not contain a checkpoint)."""
    from megatron.core import dist_checkpointing

    os.makedirs(ckpt_dir, exist_ok=True)
    sd = {"model": _model_sharded_state_dict(model)}
    if extra_common:
        sd.update(extra_common)
    dist_checkpointing.save(sd, ckpt_dir)


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
# Layout (Megatron-LM names): <save>/iter_0000010/ (torch_dist) and
# <save>/latest_checkpointed_iteration.txt. A checkpoint is written to iter_XXXXXXX.tmp and renamed
# into place only after every rank finished, and the tracker file is replaced last, so a crash
# mid-save never leaves a directory that looks complete.

TRACKER = "latest_checkpointed_iteration.txt"


def iter_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def latest_step(root: str) -> Optional[int]:
    path = os.path.join(root, TRACKER)
    if not os.path.isfile(path):
        return None
    text = open(path, encoding="utf-8").read().strip()
    if not text.isdigit():
        raise CheckpointError(f"{path}: expected an iteration number, found {text[:40]!r}")
    step = int(text)
    if not os.path.isdir(iter_dir(root, step)):
        raise CheckpointError(f"{path} names iteration {step} but {iter_dir(root, step)} does not exist")
    return step


def resolve(path: str) -> str:
    """A checkpoint root (with a tracker file) -> its latest iteration directory; else path."""
    if os.path.isfile(os.path.join(path, TRACKER)):
        return iter_dir(path, latest_step(path))
    return path


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_initialized():
        dist.barrier()


def _replace_file(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def _training_sharded_state_dict(model, optimizer, is_loading: bool) -> dict:
    from megatron_gspo import cpu_compat

    model_sd = _model_sharded_state_dict(model)
    sd = {"model": model_sd}
    if optimizer is not None:
        with cpu_compat.optimizer_context():
            sd["optimizer"] = optimizer.sharded_state_dict(model_sd, is_loading=is_loading)
    return sd


def save_checkpoint(root: str, step: int, model, optimizer=None, scheduler=None, extra: Optional[dict] = None,
                    is_main: bool = True) -> str:
    """Collective. Writes <root>/iter_<step> atomically and points the tracker at it."""
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
    sd = _training_sharded_state_dict(model, optimizer, is_loading=False)
    sd["step"] = step
    if scheduler is not None:
        sd["scheduler"] = scheduler.state_dict()
    if extra:
        sd["extra"] = extra
    dist_checkpointing.save(sd, tmp)
    _barrier()
    if is_main:
        if os.path.exists(final):
            shutil.rmtree(final)
        os.replace(tmp, final)
        _replace_file(os.path.join(root, TRACKER), str(step))
    _barrier()
    return final


def load_checkpoint(path: str, model, optimizer=None, scheduler=None) -> dict:
    """Collective. ``path`` is a checkpoint root (its latest iteration) or an iter_ directory.
    Returns {"step": int, "extra": dict}."""
    from megatron.core import dist_checkpointing

    path = resolve(path)
    check_compatible(model, path)
    sd = _training_sharded_state_dict(model, optimizer, is_loading=True)
    loaded = dist_checkpointing.load(sd, path)
    unwrap(model).load_state_dict(loaded["model"], strict=True)
    if optimizer is not None:
        if "optimizer" not in loaded:
            raise CheckpointError(f"{path}: has no optimizer state (a weights-only checkpoint?); "
                                  "load it with checkpoint.load as initial weights instead of resuming")
        from megatron_gspo import cpu_compat

        with cpu_compat.optimizer_context():
            optimizer.load_state_dict(loaded["optimizer"])
    if scheduler is not None and "scheduler" in loaded:
        scheduler.load_state_dict(loaded["scheduler"])
    return {"step": int(loaded.get("step", 0)), "extra": loaded.get("extra", {})}
