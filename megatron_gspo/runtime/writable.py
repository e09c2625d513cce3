"""Whether the project can write where it is told to, asked once at start-up, with the real cause.

Every place a command writes (``checkpoint.save``, ``train.output_dir`` with its metrics.jsonl and
tensorboard/, the converters' ``--out`` and ``--summary-json``, the preflight's ``--json``,
``experiments.compare``'s ``--out`` and ``--docs-dir``) goes through ``check_writable`` before any
work: a run that could only fail at its first save or its last line is refused in one line that
names the key or flag and why (``read-only file system``, ``<path> is a regular file, not a
directory``, ``permission denied``), never minutes later as a traceback.

The test is the operation itself, not ``os.access``: an empty file is created (and removed) in the
directory the command would write into, or in its nearest existing ancestor, where the command
would create it; an existing output file is opened for appending and left as it was. ``os.access``
answers "permission denied" for a read-only mount and yes to root on one. A leaf module (standard
library only): the launcher-side tools and the converters import it before torch.
"""

from __future__ import annotations

import errno
import os
import pwd
import stat
import tempfile
from typing import Callable, Optional

__all__ = ["check_writable", "describe_os_error", "format_bytes", "free_bytes", "unwritable"]

# errno -> the cause as a person says it (os.strerror's wording, lower case), with what to look at
_CAUSES = {errno.EROFS: "read-only file system", errno.EACCES: "permission denied",
           errno.EPERM: "operation not permitted", errno.ENOSPC: "no space left on device",
           errno.EDQUOT: "disk quota exceeded", errno.ENOTDIR: "not a directory", errno.EIO: "input/output error"}


def format_bytes(n: float) -> str:
    """1234567 -> '1.23 MB': decimal units, as ``df -H`` and the hub speak."""
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000.0
    return f"{n:.2f} TB"


def _mount_point(path: str) -> str:
    path = os.path.abspath(path)
    while not os.path.ismount(path):
        path = os.path.dirname(path)
    return path


def _user() -> str:
    try:
        return pwd.getpwuid(os.geteuid()).pw_name
    except KeyError:  # a uid without a passwd entry (containers)
        return f"uid {os.geteuid()}"


def describe_os_error(e: OSError, where: str) -> str:
    """The cause of ``e`` (raised writing in ``where``) in words, with what to look at: ``read-only file
    system (/mnt is mounted read-only)``, ``permission denied (/data is not writable by user alice)``."""
    cause = _CAUSES.get(e.errno) or (e.strerror or str(e)).lower()
    if e.errno == errno.EROFS:
        return f"{cause} ({_mount_point(where)} is mounted read-only)"
    if e.errno in (errno.EACCES, errno.EPERM):
        return f"{cause} ({where} is not writable by user {_user()})"
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        free = free_bytes(where)
        return f"{cause} ({where}: {format_bytes(free)} free)" if free is not None else f"{cause} ({where})"
    return f"{cause} ({where})"


_LOOP = "a symbolic link loop (too many levels of symbolic links)"


def _kind(path: str) -> str:
    mode = os.lstat(path).st_mode
    if stat.S_ISLNK(mode):
        try:
            os.stat(path)
        except OSError as e:  # a link that leads back to itself is no link to a missing path
            return _LOOP if e.errno == errno.ELOOP else "a symbolic link to a missing path"
        return "a symbolic link to a file"
    return "a regular file" if stat.S_ISREG(mode) else "not a regular file or directory"


def _limit(name: str, default: int) -> int:
    try:
        return int(os.pathconf("/", name))
    except (OSError, ValueError):
        return default


def _unreachable(path: str, e: OSError) -> Optional[str]:
    """Why ``path`` cannot even be looked up (Errno 40 / 36), naming the link or the name at fault; None for any
    other error."""
    if e.errno == errno.ELOOP:  # the first prefix that cannot be resolved is the loop
        parts = path.split(os.sep)
        for i in range(2, len(parts) + 1):
            prefix = os.sep.join(parts[:i])
            try:
                os.stat(prefix)
            except OSError as err:
                if err.errno == errno.ELOOP:
                    return f"{prefix} is {_LOOP}"
                break
        return f"too many levels of symbolic links on the way to {path}"
    if e.errno == errno.ENAMETOOLONG:
        name_max, path_max = _limit("PC_NAME_MAX", 255), _limit("PC_PATH_MAX", 4096)
        for part in path.split(os.sep):
            if len(os.fsencode(part)) > name_max:
                return (f"the name {part[:16]}... is {len(os.fsencode(part))} bytes, over the file system's limit of "
                        f"{name_max} bytes per name")
        return f"the path is {len(os.fsencode(path))} bytes, over the limit of {path_max} bytes per path"
    return None


def _nearest_existing(path: str) -> str:
    """``path`` or its nearest ancestor that exists (PermissionError when one on the way cannot be entered)."""
    while True:
        try:
            os.lstat(path)
            return path
        except (FileNotFoundError, NotADirectoryError):
            path = os.path.dirname(path)


def free_bytes(path: str) -> Optional[int]:
    """Bytes an unprivileged writer can still use on the file system of ``path`` (or of its nearest
    existing ancestor); None where that cannot be asked."""
    try:
        st = os.statvfs(_nearest_existing(os.path.abspath(path)))
    except OSError:  # (PermissionError included)
        return None
    return st.f_bavail * st.f_frsize


def _probe_directory(folder: str) -> Optional[str]:
    """Create and remove an empty file in ``folder``: None, or why that failed."""
    try:
        fd, probe = tempfile.mkstemp(prefix=".write-test-", dir=folder)
    except OSError as e:
        return describe_os_error(e, folder)
    os.close(fd)
    os.remove(probe)
    return None


def unwritable(path: str, directory: bool = True) -> Optional[str]:
    """None if this process can write ``path`` (a directory to create files in, or with
    ``directory=False`` a file to write), else the cause in words. Missing directories on the way
    count as writable where their nearest existing ancestor is (the command creates them)."""
    path = os.path.abspath(path)
    try:
        existing = _nearest_existing(path)
    except PermissionError as e:  # a folder on the way that this user cannot enter
        return f"permission denied ({os.path.dirname(e.filename or path)} cannot be entered by user {_user()})"
    except OSError as e:  # a symbolic link loop on the way, a name or path too long
        cause = _unreachable(path, e)
        if cause is None:
            raise
        return cause
    if existing != path or directory:
        if not os.path.isdir(existing):
            return f"{existing} is {_kind(existing)}, not a directory"
        return _probe_directory(existing)
    if os.path.isdir(path):
        return f"{path} is a directory"
    try:
        with open(path, "ab"):  # appending nothing: the file stays as it was
            pass
    except OSError as e:
        return describe_os_error(e, path)
    return None


def check_writable(path: str, what: str, directory: bool = True,
                   error: Callable[[str], Exception] = OSError) -> None:
    """Raise ``error("<what>: cannot write there: <cause>")`` unless ``unwritable`` says yes. ``what``
    names the setting as the user gave it (``checkpoint.save=/ckpt``, ``--out /data/hf``)."""
    cause = unwritable(path, directory)
    if cause is not None:
        raise error(f"{what}: cannot write there: {cause}")
