"""Who owns a file a command leaves while it works, and whether that owner is gone.

A record (``holder``) names the process: host, pid and the process's start time (a pid reused by
another process is not the owner), the SLURM job id and restart count when there is one, when it
started and its command line. ``stale_reason`` says why a record's owner is gone, or None when it may
still be running:

* same host: its process is gone, or the pid now belongs to a process started at another time;
* another host: an earlier run of this same SLURM job (``scontrol requeue`` and a node failure's
  requeue keep SLURM_JOB_ID and raise SLURM_RESTART_COUNT). Any other owner on another host cannot be
  checked from here (its pid means nothing on this host) and counts as running.

Used by checkpoint.save's lock (checkpoint/lock.py) and the converters' temporary output directories
(checkpoints_tools/files.py). A leaf module: standard library only.
"""

from __future__ import annotations

import datetime
import os
import socket
import sys
import uuid
from typing import Optional

__all__ = ["describe", "holder", "is_ours", "stale_reason"]


def _process_stat(pid: int) -> Optional[tuple[str, int]]:
    """(state, start time in clock ticks since boot) of process ``pid`` (/proc/PID/stat fields 3 and 22), or None."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return fields[0], int(fields[19])
    except (OSError, ValueError, IndexError):
        return None


def _process_start(pid: int) -> Optional[int]:
    stat = _process_stat(pid)
    return stat[1] if stat else None


def holder() -> dict:
    """This process, as a record of who owns a file (a lock, a temporary output)."""
    env = os.environ
    return {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": _process_start(os.getpid()),
            "slurm_job": env.get("SLURM_JOB_ID"), "slurm_restart": int(env.get("SLURM_RESTART_COUNT", "0") or 0),
            "started": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            "command": " ".join([os.path.basename(sys.executable), *sys.argv])[:300], "token": uuid.uuid4().hex}


def describe(rec: dict) -> str:
    """``SLURM job 1234 (host node7, pid 4242, started ...: command)``: a record's owner as messages name it."""
    who = f"SLURM job {rec['slurm_job']}" if rec.get("slurm_job") else "a job"
    where = "this host" if rec.get("host") == socket.gethostname() else f"host {rec.get('host', '?')}"
    return f"{who} ({where}, pid {rec.get('pid', '?')}, started {rec.get('started', '?')}: {rec.get('command', '?')})"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    stat = _process_stat(pid)
    return stat is None or stat[0] != "Z"  # a zombie (killed, not yet reaped by its parent) is gone


def is_ours(rec: dict) -> bool:
    """The record is this very process's (a second job object of one program, e.g. the comparison's in-process
    runs, re-entering a lock it holds)."""
    return rec.get("host") == socket.gethostname() and rec.get("pid") == os.getpid()


def stale_reason(rec: dict) -> Optional[str]:
    """Why the owner of record ``rec`` is gone, or None when it may be running (module doc)."""
    me = holder()
    if rec.get("host") == me["host"]:
        pid = rec.get("pid")
        if not isinstance(pid, int) or not _alive(pid):
            return f"its process {pid} is gone"
        start = _process_start(pid)
        if rec.get("pid_start") is not None and start is not None and start != rec["pid_start"]:
            return f"pid {pid} now belongs to another process"
        return None
    if me["slurm_job"] and rec.get("slurm_job") == me["slurm_job"] and rec.get("slurm_restart", 0) < me["slurm_restart"]:
        return f"an earlier run of this SLURM job (restart {rec.get('slurm_restart', 0)}; this is restart {me['slurm_restart']})"
    return None
