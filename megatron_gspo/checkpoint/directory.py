"""A checkpoint root on disk: iteration directories, manifests, the tracker file, rotation.

    <root>/iter_0000010/            one checkpoint (torch_dist files + manifest.json)
    <root>/iter_0000012.tmp/        a save in progress (never taken for a checkpoint)
    <root>/latest_checkpointed_iteration.txt   the newest step (Megatron-LM's name; a hint only)
    <root>/save.lock                the job writing into the root (lock.py)

Crash safety: every rank writes into ``iter_XXXXXXX.tmp`` and fsyncs; rank 0 writes manifest.json
(size and crc32 of every file, and the list of files a complete checkpoint needs: torch_dist's
metadata.json, .metadata and common.pt and every data file .metadata names; a save lacking one gets
no manifest) last, renames the directory into place and fsyncs the parent, then replaces the
tracker. So a directory with a manifest is complete as written; a manifest that does not list every
needed file (an older or damaged one) does not count. ``verify_checkpoint``
re-reads every file against its manifest: that is for the one checkpoint a run resumes from (a
disk can still corrupt it); rotation trusts the manifests and reads no file (at 30B with Adam state
and three kept checkpoints, checksumming them on every save would read a terabyte).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import zlib
from typing import Optional

from megatron_gspo.checkpoint.torch_dist_files import (ALWAYS, CORE_FILES, core_files, data_files, missing_files,
                                                       read_dcp_metadata)
from megatron_gspo.errors import CheckpointError

TRACKER = "latest_checkpointed_iteration.txt"
MANIFEST = "manifest.json"

log = logging.getLogger("megatron_gspo")


def iter_dir(root: str, step: int) -> str:
    return os.path.join(root, f"iter_{step:07d}")


def iter_steps(root: str) -> list[int]:
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


def fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def replace_file(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)


def write_manifest(ckpt_dir: str, step: int) -> None:
    """manifest.json of the save in ``ckpt_dir``: size and crc32 of every file, and which files a complete
    checkpoint must hold (torch_dist's core files and every data file its .metadata names). A save missing
    one is refused here, never given a manifest: a directory of another job's leftovers, or of a save whose
    files another job deleted, would otherwise pass for a checkpoint."""
    md = read_dcp_metadata(ckpt_dir)
    required = [*core_files(md), *data_files(md)]
    missing = missing_files(ckpt_dir, md)
    if missing:
        raise CheckpointError(f"{ckpt_dir}: the save is incomplete, {', '.join(missing)} missing (deleted by "
                              "another job writing into the same checkpoint.save?); no manifest written")
    files = {}
    for name in sorted(os.listdir(ckpt_dir)):
        path = os.path.join(ckpt_dir, name)
        if name == MANIFEST or not os.path.isfile(path):
            continue
        fsync_path(path)
        files[name] = {"bytes": os.path.getsize(path), "crc32": _crc32(path)}
    replace_file(os.path.join(ckpt_dir, MANIFEST),
                 json.dumps({"step": step, "required": required, "files": files}, indent=1))


def has_manifest(ckpt_dir: str) -> bool:
    """The save of ``ckpt_dir`` finished: its manifest (written last) lists every file a complete checkpoint
    needs. The manifest alone is read, no checkpoint file (rotation trusts it)."""
    return _manifest_files(ckpt_dir)[0] is not None


def _manifest_files(ckpt_dir: str) -> tuple[Optional[dict], Optional[str]]:
    """({file: {"bytes", "crc32"}} of ``ckpt_dir``'s manifest, None) or (None, why it is not a manifest of a
    complete checkpoint). One that does not list every file a torch_dist checkpoint needs (its own
    "required", or, for a manifest without that list, the core files) is not."""
    mpath = os.path.join(ckpt_dir, MANIFEST)
    if not os.path.isfile(mpath):
        return None, "no manifest.json (the save did not finish)"
    try:
        with open(mpath, encoding="utf-8") as f:
            manifest = json.load(f)
        files, required = manifest["files"], manifest.get("required", CORE_FILES)
        if not isinstance(files, dict) or not isinstance(required, (list, tuple)):
            raise ValueError("'files' is not a mapping or 'required' not a list")
    except (ValueError, KeyError, TypeError) as e:
        return None, f"unreadable manifest.json ({e})"
    unlisted = [f for f in (*ALWAYS, *required) if f not in files]
    if unlisted:
        return None, f"manifest.json does not list {', '.join(dict.fromkeys(unlisted))} (an incomplete save)"
    return files, None


def verify_checkpoint(ckpt_dir: str) -> Optional[str]:
    """None if ``ckpt_dir`` is complete and intact, else the reason it is not."""
    files, why = _manifest_files(ckpt_dir)
    if files is None:
        return why
    for name, meta in files.items():
        path = os.path.join(ckpt_dir, name)
        if not os.path.isfile(path):
            return f"file {name} is missing"
        if os.path.getsize(path) != meta["bytes"]:
            return f"file {name} has {os.path.getsize(path)} bytes, the manifest says {meta['bytes']}"
        if _crc32(path) != meta["crc32"]:
            return f"file {name} fails its checksum"
    return None


def scan(root: str) -> tuple[Optional[int], list[tuple[str, str]]]:
    """(the newest step under ``root`` whose checkpoint verifies or None, [(iter dir, why not)] of every
    newer one that does not): one full read of the files of each candidate, newest first."""
    skipped = []
    for step in iter_steps(root):
        why = verify_checkpoint(iter_dir(root, step))
        if why is None:
            return step, skipped
        skipped.append((iter_dir(root, step), why))
    return None, skipped


def latest_complete(root: str) -> Optional[int]:
    """The newest step under ``root`` whose checkpoint verifies; a bad newer one is skipped with a
    warning naming it (the tracker is a hint, the manifests are the truth)."""
    step, skipped = scan(root)
    if step is not None:
        for path, why in skipped:
            log.warning("checkpoint %s is incomplete or corrupt (%s); falling back to an earlier one", path, why)
    return step


def no_complete_checkpoint(root: str, skipped: list[tuple[str, str]]) -> str:
    """The one line for a checkpoint root where nothing verifies, naming every damaged directory."""
    if skipped:
        damaged = "; ".join(f"{os.path.basename(path)}: {why}" for path, why in skipped)
    else:
        tracker = os.path.join(root, TRACKER)
        named = open(tracker, encoding="utf-8").read().strip() if os.path.isfile(tracker) else "?"
        damaged = f"{TRACKER} names step {named} but no iter_* directory is there"
    return f"{root}: no complete checkpoint (every iter_* directory failed verification): {damaged}"


def resolve(path: str) -> str:
    """A checkpoint root -> its newest complete iteration directory; an iteration dir -> itself."""
    if os.path.isfile(os.path.join(path, TRACKER)) or iter_steps(path):
        step = latest_complete(path)
        if step is None:
            raise CheckpointError(no_complete_checkpoint(path, scan(path)[1]))
        return iter_dir(path, step)
    return path


def rotate(root: str, keep_last: int, upto: Optional[int] = None) -> list[str]:
    """Delete all but the newest ``keep_last`` complete checkpoints (0 keeps everything). The
    newest complete checkpoint is never deleted, whatever state the others are in. Complete means
    "has its manifest" (written last by the save): no file is read again here. ``upto``: the step just
    saved; directories of later steps are neither counted nor deleted: they are damaged ones a resume
    skipped (it took the newest that verifies), and counting them would delete the checkpoints of
    the run that trains those steps again, the one just written included (keep_last=1)."""
    if keep_last <= 0:
        return []
    complete = [s for s in iter_steps(root) if (upto is None or s <= upto) and has_manifest(iter_dir(root, s))]
    doomed = complete[max(1, keep_last):]
    for s in doomed:
        shutil.rmtree(iter_dir(root, s), ignore_errors=True)
    return [iter_dir(root, s) for s in doomed]


def remove_leftovers(root: str) -> None:
    """Delete the iter_*.tmp directories of saves that died half-way (SIGKILL, node failure), and the
    iter_*.old ones a save of an existing step moved aside: one save runs at a time, so once this one
    is in place every other .tmp / .old is garbage. Until then they sit harmlessly, never taken for a
    checkpoint."""
    for d in os.listdir(root):
        if d.startswith("iter_") and d.endswith((".tmp", ".old")) and os.path.isdir(os.path.join(root, d)):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)


def remove_partial_saves(root: str) -> list[str]:
    """Delete the iter_*.tmp directories of saves that died half-way (a SIGKILL, a full disk); run by the job
    that just took the root's lock (lock.py), so no other job's save is in progress. Returns their names.
    (The iter_*.old ones stay: a save killed between its two renames has its older copy there.)"""
    gone = []
    for d in sorted(os.listdir(root)) if os.path.isdir(root) else ():
        if d.startswith("iter_") and d.endswith(".tmp") and os.path.isdir(os.path.join(root, d)):
            shutil.rmtree(os.path.join(root, d), ignore_errors=True)
            gone.append(d)
    return gone
