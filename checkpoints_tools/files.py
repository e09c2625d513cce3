"""The converters' plain files: the output directory (refused when it exists without --force or
overlaps the input, or cannot be written; built in a temp dir next to it, which names its owner, and
renamed into place only when complete; what killed runs left beside it removed by the next run), the
side files that travel with a model (tokenizer & co.), and JSON read with errors that name the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from typing import Any, Iterable, Iterator, Optional

from checkpoints_tools.errors import ConversionError
from megatron_gspo.runtime.owner import holder, is_ours, stale_reason
from megatron_gspo.runtime.writable import check_writable, format_bytes


def check_output(target: str, force: bool, inputs: Iterable[str] = ()) -> str:
    """Refuse an existing output without --force, an output that is (or holds) an input, and one that
    cannot be written (runtime/writable.py: the real cause, before any work)."""
    target = os.path.abspath(target)
    check_writable(os.path.dirname(target), f"--out {target}", error=ConversionError)
    for src in inputs:
        if not src:
            continue
        s = os.path.realpath(src)
        t = os.path.realpath(target)
        if s == t or s.startswith(t + os.sep) or t.startswith(s + os.sep):
            raise ConversionError(f"output {target} overlaps the input {src}; choose another --out")
    if os.path.lexists(target) and not force:
        raise ConversionError(f"output {target} already exists; pass --force to replace it")
    return target


OWNER = ".conversion-owner.json"  # in a temp output directory while a conversion writes it (runtime/owner.py)


def _leftover(parent: str, name: str) -> Optional[str]:
    """Why ``parent/name`` (a ``.<out>.tmp-*`` directory) is what a conversion left behind, or None while the
    conversion that owns it may still be running (another process on this host, or on another host)."""
    try:
        with open(os.path.join(parent, name, OWNER), encoding="utf-8") as f:
            rec = json.load(f)
    except (OSError, ValueError):
        return "killed before it recorded its owner, or written by an older version"
    if not isinstance(rec, dict):
        return "an unreadable owner record"
    return stale_reason(rec) if not is_ours(rec) else None


def remove_leftovers(target: str, say) -> None:
    """Name and remove what earlier conversions to ``target`` left beside it when they were killed (SIGKILL,
    a node's end, a time limit): ``.<name>.tmp-*`` output they were writing, and a ``.<name>.old-*`` of an
    earlier output a --force run had moved aside (put back as ``target`` when the run died before its new
    output was in place). ``say(line)`` tells the user. A temp directory whose conversion still runs stays."""
    parent, base = os.path.split(os.path.abspath(target))
    check_writable(parent, f"--out {os.path.abspath(target)}", error=ConversionError)  # before touching anything
    if not os.path.isdir(parent):
        return
    for name in sorted(os.listdir(parent)):
        path = os.path.join(parent, name)
        if name.startswith(f".{base}.old-") and os.path.isdir(path) and not os.path.lexists(target):
            os.rename(path, target)
            say(f"put back {target} from {name}, where a --force conversion that was killed had moved it")
        elif name.startswith((f".{base}.tmp-", f".{base}.old-")) and os.path.isdir(path):
            why = _leftover(parent, name) if name.startswith(f".{base}.tmp-") else "superseded by the new output"
            if why is None:
                say(f"left {path} alone: a conversion that is still running writes it")
                continue
            size = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)
            shutil.rmtree(path, ignore_errors=True)
            say(f"removed {path} ({format_bytes(size)}), left by an earlier conversion ({why})")


@contextlib.contextmanager
def atomic_output_dir(target: str, force: bool) -> Iterator[str]:
    """Yield a fresh temp dir next to ``target`` (owned by this process: OWNER); on success rename it to
    ``target`` (replacing an existing one only with ``force``), on any error or stop signal delete it and leave
    ``target`` untouched."""
    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    base = os.path.basename(target)
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the result is an ordinary directory
    try:
        write_json(os.path.join(tmp, OWNER), holder())
        yield tmp
        os.remove(os.path.join(tmp, OWNER))
        _put_in_place(tmp, target, force)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        e.partial_output = tmp  # what the stop line names (cli.run_cli)
        raise


def _put_in_place(tmp: str, target: str, force: bool) -> None:
    parent, base = os.path.split(target)
    if not os.path.lexists(target):
        os.rename(tmp, target)
        return
    if not force:
        raise ConversionError(f"output {target} appeared during the conversion; not replacing it without --force")
    old = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
    os.rmdir(old)
    os.rename(target, old)
    os.rename(tmp, target)
    if os.path.isdir(old) and not os.path.islink(old):
        shutil.rmtree(old, ignore_errors=True)
    else:
        os.unlink(old)


# Files of an HF model directory that are weights or the model config (everything else at the
# top level -- tokenizer, chat template, generation config, README -- travels along).
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf|distcp)$|.*\.index\.json$")


def copy_side_files(src_dir: str, dst_dir: str, skip: Iterable[str] = ()) -> list[str]:
    """Copy tokenizer & co. (every top-level regular file that is not weights or in ``skip``)."""
    skip = set(skip)
    copied = []
    for name in sorted(os.listdir(src_dir)):
        p = os.path.join(src_dir, name)
        if not os.path.isfile(p) or name in skip or name.startswith(".") or _WEIGHT_FILE.fullmatch(name):
            continue
        shutil.copy2(p, os.path.join(dst_dir, name))
        copied.append(name)
    return copied


def read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise ConversionError(f"{what} not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: invalid JSON ({e})") from None


def write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
