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
