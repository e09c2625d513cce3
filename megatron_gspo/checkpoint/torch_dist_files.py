"""The files a torch_dist checkpoint is made of, and reading its two pickled ones without running code.

A megatron torch_dist checkpoint directory holds

    metadata.json   megatron's backend description (JSON)
    .metadata       torch.distributed.checkpoint's global metadata: every tensor's chunks and the file
                    and byte range of each (a *pickle*)
    common.pt       the non-sharded state (step, scheduler, the job's config, ...; torch.save), as megatron-core
                    0.16 writes it; 0.19 keeps that state in the data instead, as one byte object
                    ("common_state/...") that .metadata names, read with weights_only=True (core_files)
    __R_N.distcp    the data, named by .metadata

What loading one trusts: torch.distributed.checkpoint reads ``.metadata`` with ``pickle.load`` and
the byte objects stored in the .distcp files (megatron's ShardedObjects, e.g. Transformer Engine's
extra states) with ``torch.load(weights_only=False)``; megatron reads ``common.pt`` with
``torch.load``'s default (weights_only=True since torch 2.6). So a checkpoint from a stranger can run
code in the loading process. What this module does about it, before megatron or torch touch a
checkpoint (storage.check_complete, and the converters' reader): ``.metadata`` is read with an
unpickler that builds only torch.distributed.checkpoint's own data classes, torch.Size and dtypes,
and ``common.pt`` with ``weights_only=True``; anything else is refused naming the file. The byte
objects inside the .distcp files are not checked here (docs/checkpoints.md: what loading trusts).
"""

from __future__ import annotations

import dataclasses
import enum
import os
import pickle
from typing import Any

from megatron_gspo.errors import CheckpointError, a_or_an

DCP_METADATA = ".metadata"
COMMON = "common.pt"
MEGATRON_METADATA = "metadata.json"
# what every torch_dist checkpoint holds besides the data files its .metadata names (common.pt: core_files)
ALWAYS = (MEGATRON_METADATA, DCP_METADATA)
CORE_FILES = (*ALWAYS, COMMON)
# megatron-core 0.19's key of the common state inside the data (ShardedObject("common_state", ...).unique_key)
COMMON_STATE_KEY = "common_state/"


class _Refused(pickle.UnpicklingError):
    """The pickle names a global that is not data (its loading would call it)."""


class _MetadataUnpickler(pickle.Unpickler):
    """Builds torch.distributed.checkpoint's data classes and enums (Metadata, TensorStorageMetadata,
    _StorageInfo, WriteItem, ...), torch.Size, dtypes, layouts and memory formats; nothing callable else."""

    def find_class(self, module: str, name: str) -> Any:
        import torch

        if module.startswith("torch.distributed.checkpoint."):
            obj = super().find_class(module, name)
            if isinstance(obj, type) and (dataclasses.is_dataclass(obj) or issubclass(obj, enum.Enum)):
                return obj
        elif module == "torch" and name == "Size":
            return torch.Size
        elif module == "torch" and isinstance(getattr(torch, name, None), (torch.dtype, torch.layout, torch.memory_format)):
            return getattr(torch, name)
        elif (module, name) == ("torch.serialization", "_get_layout"):  # a layout by its name: no code
            return super().find_class(module, name)
        elif (module, name) in (("builtins", "set"), ("builtins", "frozenset"), ("collections", "OrderedDict"),
                                ("pathlib", "PosixPath"), ("pathlib", "PurePosixPath")):  # a path: torch's checkpoint_id
            return super().find_class(module, name)
        raise _Refused(f"it would call {module}.{name}, which no torch_dist metadata holds")


def read_dcp_metadata(ckpt_dir: str):
    """torch.distributed.checkpoint's Metadata of ``ckpt_dir``, read without running code from it;
    CheckpointError naming the file when it cannot be (missing, truncated, or holding more than data)."""
    path = os.path.join(ckpt_dir, DCP_METADATA)
    if not os.path.isfile(path):
        raise CheckpointError(f"{ckpt_dir}: not a complete checkpoint: {DCP_METADATA} missing")
    try:
        with open(path, "rb") as f:
            md = _MetadataUnpickler(f).load()
    except _Refused as e:
        raise CheckpointError(f"{ckpt_dir}: cannot read checkpoint metadata: {path}: {e}: refused, "
                              "a checkpoint whose loading would run code") from None
    except Exception as e:  # truncated or not a pickle at all
        raise CheckpointError(f"{ckpt_dir}: cannot read checkpoint metadata: {path}: {type(e).__name__}: {e}") from None
    if not hasattr(md, "storage_data") or not hasattr(md, "state_dict_metadata"):
        raise CheckpointError(f"{ckpt_dir}: cannot read checkpoint metadata: {path} holds a "
                              f"{type(md).__name__}, not torch.distributed.checkpoint's Metadata")
    return md


def data_files(md) -> list[str]:
    """The .distcp files a checkpoint's Metadata ``md`` names, sorted."""
    return sorted({info.relative_path for info in (md.storage_data or {}).values()})


def weights_only_cause(e: Exception) -> str:
    """The line of torch.load's weights_only refusal that names what was refused (``... GLOBAL posix.system ...``)."""
    lines = [ln.strip() for ln in str(e).splitlines() if ln.strip()]
    return next((ln for ln in lines if "GLOBAL" in ln), lines[0] if lines else type(e).__name__).rstrip(".")


def common_state_key(md) -> str | None:
    """The key of the common state inside the data when the checkpoint keeps it there (megatron-core 0.19's
    format), else None (0.16's: common.pt)."""
    return next((k for k in (md.state_dict_metadata or {}) if k.startswith(COMMON_STATE_KEY)), None)


def core_files(md) -> tuple[str, ...]:
    """The files besides the data that the checkpoint of Metadata ``md`` needs: common.pt unless its common
    state is in the data."""
    return ALWAYS if common_state_key(md) is not None else CORE_FILES


def _common_bytes(ckpt_dir: str, key: str):
    """The common state's bytes in the data of ``ckpt_dir``, as a file object. DCP's default load planner
    would ``torch.load(weights_only=False)`` them; this one keeps the bytes, for read_common's weights_only load."""
    import io

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    kept = {}

    class _KeepBytes(DefaultLoadPlanner):  # (DCP loads into a copy of the state dict: the bytes are kept aside)
        def load_bytes(self, read_item, value) -> None:
            kept[read_item.dest_index.fqn] = value.read()

    dcp.load({key: io.BytesIO()}, storage_reader=dcp.FileSystemReader(ckpt_dir), planner=_KeepBytes(), no_dist=True)
    if key not in kept:
        raise CheckpointError(f"{ckpt_dir}: not a complete checkpoint: its common state ({key}) is not in the data")
    return io.BytesIO(kept[key])


def read_common(ckpt_dir: str) -> dict:
    """The common (non-sharded) state of ``ckpt_dir``: ``common.pt`` (megatron-core 0.16), or the byte object
    in the data that .metadata names (0.19), read with weights_only=True (tensors and plain data only)."""
    import torch

    path = os.path.join(ckpt_dir, COMMON)
    key = None
    if not os.path.isfile(path):
        key = common_state_key(read_dcp_metadata(ckpt_dir))
        if key is None:
            raise CheckpointError(f"{ckpt_dir}: not a complete checkpoint: {COMMON} missing")
    where = path if key is None else f"{ckpt_dir}: its common state ({key})"  # what the messages name
    try:
        obj = torch.load(path if key is None else _common_bytes(ckpt_dir, key), map_location="cpu", weights_only=True)
        if key is not None and isinstance(obj, (list, tuple)) and len(obj) == 1:
            obj = obj[0]  # megatron saves it as a one-element list (load_common_state_dict)
    except CheckpointError:
        raise
    except pickle.UnpicklingError as e:
        raise CheckpointError(f"{where}: refused: it holds more than tensors and plain data ({weights_only_cause(e)}); "
                              "loading it unrestricted could run code from it") from None
    except Exception as e:  # truncated, or a damaged data file
        raise CheckpointError(f"{where}: unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: holds {a_or_an(type(obj).__name__)}, not megatron's common state dict")
    return obj


def missing_files(ckpt_dir: str, md=None) -> list[str]:
    """The core files and the data files (named by .metadata) that ``ckpt_dir`` lacks."""
    md = read_dcp_metadata(ckpt_dir) if md is None else md
    return [f for f in (*core_files(md), *data_files(md)) if not os.path.isfile(os.path.join(ckpt_dir, f))]
