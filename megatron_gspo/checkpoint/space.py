"""A checkpoint save the disk refused: what it needs, what failed, and the one line that says so.

A save that fails for want of space (or on a disk gone read-only or failing) ends the run with
``exit_status.EXIT_CHECKPOINT_WRITE_FAILED`` (74, sysexits' EX_IOERR) and one line naming the
directory, the cause, how much a checkpoint of the job needs, and the last complete step, with the
partial ``iter_*.tmp`` removed. Not 75: a requeue would meet the same full disk. What torch reports
for a full disk is not always an OSError ("[enforce fail at inline_container.cc] unexpected pos 704 vs
598" from its zip writer, inside a CheckpointException; a rank's OSError reaches the CheckpointException
as text, its errno in the message), so the free space of the file system is asked too (``write_failure``).
"""

from __future__ import annotations

import errno
import json
import os
import re
from typing import Iterator, Optional

from megatron_gspo.runtime.exit_status import StopReason
from megatron_gspo.runtime.writable import describe_os_error, format_bytes, free_bytes

# the causes of a failed write that are the disk's, not the program's
DISK_ERRNOS = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EIO)
# a file system with less than this left after a failed write is taken as full (torch's zip writer
# loses the errno); a real full disk has at most a few blocks left
FULL_BELOW_BYTES = 1 << 20


def _chain(e: BaseException) -> Iterator[BaseException]:
    """``e``, its causes and contexts, and the per-rank failures a torch CheckpointException carries."""
    seen, todo = set(), [e]
    while todo:
        x = todo.pop()
        if x is None or id(x) in seen:
            continue
        seen.add(id(x))
        yield x
        todo += [x.__cause__, x.__context__]
        failures = getattr(x, "failures", None)
        if isinstance(failures, dict):  # {rank: exception, or (exception, traceback)}
            for f in failures.values():
                todo += [y for y in (f if isinstance(f, tuple) else (f,)) if isinstance(y, BaseException)]


def write_failure(e: BaseException, where: str) -> Optional[str]:
    """The disk's cause of the failed write ``e`` in ``where`` (``no space left on device (...: 4.10 KB
    free)``, ``read-only file system (...)``), or None when it was not the disk."""
    for x in _chain(e):
        if isinstance(x, OSError) and x.errno in DISK_ERRNOS:
            return describe_os_error(x, where)
        # a rank's failure crosses torch's gather as text: "Worker failure: [Errno 28] No space left on device"
        for code in map(int, re.findall(r"\[Errno (\d+)\]", str(x))):
            if code in DISK_ERRNOS:
                return describe_os_error(OSError(code, os.strerror(code)), where)
    free = free_bytes(where)
    if free is not None and free < FULL_BELOW_BYTES:
        return f"no space left on device ({where}: {format_bytes(free)} free)"
    return None


def estimate_bytes(job) -> int:
    """About how many bytes a training checkpoint of ``job`` (a JobConfig) holds: the weights in their
    precision, Adam's two fp32 moments (SGD: one) and the fp32 master copy of a bf16 / fp16 model, the
    KL reference's weights when loss.kl_coef > 0."""
    m = job.model
    n = m.num_parameters()
    w = 4 if m.precision == "fp32" else 2
    opt = (8 if job.optimizer.optimizer == "adam" else 4) + (0 if w == 4 else 4)
    return n * (w + opt) + (n * w if job.loss.kl_coef > 0 else 0)


def _manifest_bytes(ckpt_dir: str) -> Optional[int]:
    try:
        with open(os.path.join(ckpt_dir, "manifest.json"), encoding="utf-8") as f:
            return sum(int(x["bytes"]) for x in json.load(f)["files"].values())
    except (OSError, ValueError, KeyError, TypeError):
        return None


def needed(job, newest: Optional[str]) -> str:
    """``about 1.31 MB (the size of iter_0000001)``: the size of the newest complete checkpoint of the
    root, else the estimate from the config (``job``; None: unknown)."""
    size = _manifest_bytes(newest) if newest else None
    if size is not None:
        return f"about {format_bytes(size)} (the size of {os.path.basename(newest)})"
    if job is None:
        return "an unknown amount"
    return f"about {format_bytes(estimate_bytes(job))} (estimated from the config)"


def no_space_message(root: str, step: int, cause: str, need: str, last: Optional[int], last_dir: Optional[str]) -> str:
    """The one line of a save the disk refused (StoppedFor with StopReason.CHECKPOINT_WRITE_FAILED: exit 74)."""
    prior = (f"the last complete checkpoint is step {last} ({last_dir})" if last is not None
             else "there is no complete checkpoint under it yet")
    return (f"checkpoint.save={root}: {cause} writing iter_{step:07d}: a checkpoint of this job needs {need}; "
            f"{prior}; the partial iter_{step:07d}.tmp was removed; make room (or move the root, with its "
            f"checkpoints, and point checkpoint.save there) and resume with checkpoint.resume=true; "
            f"exiting with {StopReason.CHECKPOINT_WRITE_FAILED.exit_code.value}")
