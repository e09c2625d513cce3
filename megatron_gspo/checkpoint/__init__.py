"""Checkpoints: megatron dist_checkpointing (torch_dist) files, resumable under any TP / EP layout.

    storage.py    model weights <-> torch_dist files; how the files are written (in this process)
    torch_dist_files.py  the files a torch_dist checkpoint needs; .metadata / common.pt read without running code
    directory.py  a checkpoint root on disk: iter_* directories, manifests, tracker, rotation
    lock.py       one job per checkpoint root: save.lock, stale locks
    training.py   training checkpoints: model + optimizer + schedule + extras, atomic save / load
    space.py      a save the disk refused: the one line, exit 74, the size a checkpoint needs
    manager.py    CheckpointManager: the trainer's resume decision (verified once), its lock and its saves
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
