"""Small real file systems for the tests of full and read-only disks: a tmpfs of a given size, mounted for
the test and unmounted after. Mounting needs root with CAP_SYS_ADMIN (a CI container may not have it):
the test is then skipped, saying why; the same behaviour is also tested by injecting the error."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from typing import Iterator

import pytest


@contextlib.contextmanager
def tmpfs(path: str, size: str = "1m", read_only: bool = False) -> Iterator[str]:
    """``path`` (created) with a tmpfs of ``size`` mounted on it, read-only if asked; pytest.skip where that
    cannot be done here."""
    os.makedirs(path, exist_ok=True)
    if shutil.which("mount") is None:
        pytest.skip("no mount command here: a real full / read-only disk cannot be made")
    opts = f"size={size}" + (",ro" if read_only else "")
    p = subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "tmpfs", path], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here ({(p.stderr or p.stdout).strip() or 'mount failed'}): needs root "
                    "with CAP_SYS_ADMIN; the injected-error tests cover the same code")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", path], capture_output=True)


def fill(path: str) -> None:
    """Write ``path/filler`` until its file system has no byte left."""
    with open(os.path.join(path, "filler"), "wb", buffering=0) as f:
        for size in (1 << 16, 4096, 512, 1):
            try:
                while True:
                    f.write(b"\0" * size)
            except OSError:
                continue
