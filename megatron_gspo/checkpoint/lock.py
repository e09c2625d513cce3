"""One job per checkpoint root: a lock file that names its holder, and stale locks told from live ones.

Two jobs saving into one ``checkpoint.save`` overwrite each other's ``iter_*.tmp`` directories and
tracker: one dies half-way, the other "finishes" with checkpoints it did not write. So the root holds
``save.lock`` while a job trains into it: taken at start-up by the job's rank 0, before any step,
and removed on every way out (the end, an error, a stop signal: ``SaveLock.release`` from the
trainer's close). What it records (``holder``): host, pid and the process's start time (a pid
reused by another process is not the holder), the SLURM job id and restart count when there is
one, when the job started and its command line (runtime/owner.py).

A second job finding the lock is refused at start-up, naming the holder. A lock is *stale*, and is
taken over with a warning naming it, when

* its holder ran on this host and its process is gone (SIGKILL, the OOM killer, a node reboot), or
  the pid now belongs to a process started at another time;
* it was left by an earlier run of this same SLURM job on another node (``scontrol requeue`` and a
  node failure's requeue keep SLURM_JOB_ID and raise SLURM_RESTART_COUNT).

* its holder ran on another host and its *lease* expired: a job renews its lock (the file's
  modification time) every ``RENEW_S`` seconds while it holds it, from a thread of its own, so a lock
  not renewed for ``lease_s`` seconds (``LEASE_S``, recorded in the lock) belongs to a job that is gone
  (a failed node, a SIGKILL), whatever the way the next job was started (a new ``sbatch``, another node).

Any other lock from another host is taken as held (its pid means nothing here; a lock written before
leases has none): the refusal names the holder and ``checkpoint.force_unlock=true``, with which a person
who knows that job is gone takes the lock at once (a warning names the holder). The lease's clock is
the file system's (a shared file system sets the time of a renewal) against this host's: hosts whose
clocks are minutes apart would take a live lock, which the lease's length leaves room for. A job that
finds its own lock taken over (it did not renew it in time) says so once, as an error. The file is created with ``link`` (atomic on NFS and Lustre as on local disks), so of two jobs
starting together exactly one gets it; taking over a stale lock renames it away first, so two jobs
taking over the same stale lock cannot both win either.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import socket
import threading
import time
from typing import Optional

from megatron_gspo.errors import CheckpointError
from megatron_gspo.runtime.owner import describe, holder, is_ours, stale_reason
from megatron_gspo.runtime.writable import describe_os_error

LOCK = "save.lock"
LEASE_S = 600.0  # a lock from another host not renewed for this long is stale (its job is gone)
RENEW_S = 60.0  # how often a job renews its lock while it holds it (well inside the lease)

log = logging.getLogger("megatron_gspo")


def read_lock(path: str) -> Optional[dict]:
    """The record in the lock file ``path``; None if there is none; {} if it cannot be read as one."""
    try:
        with open(path, encoding="utf-8") as f:
            rec = json.load(f)
    except FileNotFoundError:
        return None
    except (OSError, ValueError):
        return {}
    return rec if isinstance(rec, dict) else {}


def _lease(rec: dict) -> Optional[float]:
    """The lease the lock record ``rec`` was taken with (seconds), or None: a lock of this host (its pid
    decides) or one written before leases."""
    lease = rec.get("lease_s")
    if rec.get("host") == socket.gethostname() or not isinstance(lease, (int, float)) or isinstance(lease, bool):
        return None
    return float(lease)


def stale(path: str, rec: dict) -> Optional[str]:
    """Why the lock ``rec`` (read from ``path``) belongs to a job that is gone, or None when it may run (module doc)."""
    why = stale_reason(rec)
    lease = _lease(rec)
    if why is not None or lease is None:
        return why
    try:
        age = time.time() - os.stat(path).st_mtime
    except OSError:
        return None  # released meanwhile: the next look sees whoever holds it
    if age <= lease:
        return None
    return f"its lease expired: not renewed for {age:.0f} s (a running job renews it every {RENEW_S:.0f} s; lease {lease:.0f} s)"


def in_use_message(root: str, rec: dict) -> str:
    path = os.path.join(root, LOCK)
    lease = _lease(rec)
    gone = (f"a lock its job no longer renews is taken over {lease:.0f} s after its last renewal; if you know that "
            f"job is gone, set checkpoint.force_unlock=true to take it now" if lease is not None
            else f"if it is gone without removing its lock, e.g. its node failed, set checkpoint.force_unlock=true, "
                 f"or delete {path}")
    return (f"checkpoint.save={root} is in use by {describe(rec)}: two jobs saving into one directory overwrite "
            f"each other's checkpoints; give this job another checkpoint.save, or wait for that one to end ({gone})")


def refusal(root: str, force: bool = False) -> Optional[str]:
    """The one-line refusal if a live job holds ``root`` (read only: nothing is written), else None (always
    None with ``force``: checkpoint.force_unlock)."""
    path = os.path.join(root, LOCK)
    rec = read_lock(path)
    if force or rec is None or not rec or is_ours(rec) or stale(path, rec) is not None:
        return None
    return in_use_message(root, rec)


class SaveLock:
    """The lock of one checkpoint root, held by this process until ``release`` and renewed meanwhile every
    ``renew_s`` seconds (module doc). ``force``: take it from a holder that may still run (checkpoint.force_unlock)."""

    def __init__(self, root: str, force: bool = False, renew_s: float = RENEW_S) -> None:
        self.root, self.path = root, os.path.join(root, LOCK)
        self.record = {**holder(), "lease_s": LEASE_S}
        self.force, self.renew_s = force, renew_s
        self.created: list[str] = []  # directories the lock had to create (removed again if left empty)
        self.held = False
        self._stop = threading.Event()
        self._renewer: Optional[threading.Thread] = None

    def acquire(self) -> "SaveLock":
        """Take the lock (CheckpointError naming the holder when a live job has it); a stale one, or any with
        ``force``, is taken over with a warning naming what was left. Held, it is renewed until ``release``."""
        self._make_root()
        for _ in range(5):  # each pass either wins, refuses, or removes one stale lock another job left
            if self._create():
                return self._held()
            rec = read_lock(self.path)
            if rec is None:
                continue  # released between our try and our read
            if rec and is_ours(rec):
                self._write_over()
                return self._held()
            why = stale(self.path, rec) if rec else "its file is not a lock record"
            if why is None and self.force:
                why = "checkpoint.force_unlock=true (it may still be running: two jobs saving here overwrite each other)"
            if why is None:
                self._remove_created()
                raise CheckpointError(in_use_message(self.root, rec))
            log.warning("checkpoint.save=%s: taking over the lock of %s: %s", self.root, describe(rec) if rec else
                        f"{self.path}", why)
            self._break(rec)
        self._remove_created()
        raise CheckpointError(f"checkpoint.save={self.root}: could not take {self.path}: other jobs keep taking it")

    def _held(self) -> "SaveLock":
        self.held = True
        self._stop.clear()
        self._renewer = threading.Thread(target=self._renew_until_released, name="save.lock lease", daemon=True)
        self._renewer.start()
        return self

    def _renew_until_released(self) -> None:
        """The lease: the lock file's modification time set to now every ``renew_s`` seconds, while it is ours."""
        while not self._stop.wait(self.renew_s):
            rec = read_lock(self.path)
            if not rec or rec.get("token") != self.record["token"]:
                if rec is None or not is_ours(rec):  # (a second lock object of this process re-entered it: fine)
                    log.error("checkpoint.save=%s: this job's lock %s was taken over by %s while it ran (its lease "
                              "was not renewed in time): two jobs may be saving into this root", self.root, self.path,
                              describe(rec) if rec else "nobody (the file is gone)")
                return
            try:
                os.utime(self.path)
            except OSError as e:  # a file system that went away: the save that follows says so
                log.warning("checkpoint.save=%s: cannot renew the lock's lease: %s", self.root,
                            describe_os_error(e, self.path))

    def release(self) -> None:
        """Remove the lock if this process still holds it (a lock taken over by another job stays theirs),
        and the directories it created if nothing was written into them."""
        self._stop.set()
        if self._renewer is not None:
            self._renewer.join()
            self._renewer = None
        if self.held:
            self.held = False
            rec = read_lock(self.path)
            if rec and rec.get("token") == self.record["token"]:
                try:
                    os.remove(self.path)
                except FileNotFoundError:
                    pass
        self._remove_created()

    # ------------------------------------------------------------------------------------------
    def _make_root(self) -> None:
        missing, d = [], os.path.abspath(self.root)
        while not os.path.isdir(d):
            missing.append(d)
            d = os.path.dirname(d)
        for d in reversed(missing):
            try:
                os.mkdir(d)
            except FileExistsError:
                continue
            except OSError as e:
                raise CheckpointError(f"checkpoint.save={self.root}: cannot create {d}: {describe_os_error(e, d)}") from None
            self.created.append(d)

    def _remove_created(self) -> None:
        for d in reversed(self.created):
            try:
                os.rmdir(d)  # only if empty: a run that saved keeps its directory
            except OSError:
                break
        self.created = []

    def _create(self) -> bool:
        """Write the record into a file of our own, then link it to the lock's name: True if that was ours."""
        tmp = f"{self.path}.{self.record['token']}.tmp"
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(self.record, f)
                f.flush()
                os.fsync(f.fileno())
            try:
                os.link(tmp, self.path)
                return True
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP):
                    raise
                return self._create_exclusive()  # a file system without hard links
        except OSError as e:
            self._remove_created()
            raise CheckpointError(f"checkpoint.save={self.root}: cannot write its lock file {self.path}: "
                                  f"{describe_os_error(e, self.root)}") from None
        finally:
            if os.path.lexists(tmp):
                os.remove(tmp)

    def _create_exclusive(self) -> bool:
        try:
            fd = os.open(self.path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            json.dump(self.record, f)
        return True

    def _write_over(self) -> None:
        tmp = f"{self.path}.{self.record['token']}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.record, f)
        os.replace(tmp, self.path)

    def _break(self, rec: dict) -> None:
        """Move the stale lock away (only one of several jobs taking it over succeeds) and delete it."""
        aside = f"{self.path}.stale-{self.record['token']}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return  # another job took it over first; the next pass sees theirs
        if read_lock(aside) != rec:  # replaced between our read and our rename: a live holder's, put it back
            try:  # (unless yet another job has the name now; the next pass sees whoever holds it)
                os.link(aside, self.path)
            except FileExistsError:
                pass
        os.remove(aside)
