"""The converters' plain files: the output directory (refused when it exists without --force or
overlaps the input; built in a temp dir next to it and renamed into place only when complete), the
side files that travel with a model (tokenizer & co.), and JSON read with errors that name the file.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
from typing import Any, Iterable, Iterator

from checkpoints_tools.errors import ConversionError


def check_output(target: str, force: bool, inputs: Iterable[str] = ()) -> str:
    """Refuse an existing output without --force, and an output that is (or holds) an input."""
    target = os.path.abspath(target)
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


@contextlib.contextmanager
def atomic_output_dir(target: str, force: bool) -> Iterator[str]:
    """Yield a fresh temp dir next to ``target``; on success rename it to ``target`` (replacing
    an existing one only with ``force``), on any error delete it and leave ``target`` untouched."""
    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    base = os.path.basename(target)
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the result is an ordinary directory
    try:
        yield tmp
        if os.path.lexists(target):
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
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


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
