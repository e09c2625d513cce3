"""Checkpoints: megatron dist_checkpointing (torch_dist) files, resumable under any TP / EP layout.

    storage.py    model weights <-> torch_dist files; how the files are written (in this process)
    directory.py  a checkpoint root on disk: iter_* directories, manifests, tracker, rotation
    training.py   training checkpoints: model + optimizer + schedule + extras, atomic save / load
    manager.py    CheckpointManager: the trainer's resume decision (verified once) and its saves
"""

from megatron_gspo.checkpoint.directory import (
    MANIFEST,
    TRACKER,
    has_manifest,
    iter_dir,
    latest_complete,
    resolve,
    rotate,
    verify_checkpoint,
)
from megatron_gspo.checkpoint.manager import CheckpointManager
from megatron_gspo.checkpoint.storage import check_compatible, dist_checkpoint_to_tensors, load_model, save_model
from megatron_gspo.checkpoint.training import OPTIMIZER_CKPT_METADATA, load_checkpoint, save_checkpoint
from megatron_gspo.errors import CheckpointError

__all__ = ["MANIFEST", "OPTIMIZER_CKPT_METADATA", "TRACKER", "CheckpointError", "CheckpointManager",
           "check_compatible", "dist_checkpoint_to_tensors", "has_manifest", "iter_dir", "latest_complete",
           "load_checkpoint", "load_model", "resolve", "rotate", "save_checkpoint", "save_model", "verify_checkpoint"]
