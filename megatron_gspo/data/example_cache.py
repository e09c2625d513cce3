"""A task's examples made at start-up: a progress line while they are made, a stop signal honoured between two
of them, and a file that keeps them for the next run of the same job.

reasoning-gym makes an example in microseconds (basic_arithmetic) or in a tenth of a second to a second
(zebra_puzzles, futoshiki, arc_agi), and a job's start-up needs up to a thousand of them (the check of the
reference answers) plus its held-out set: minutes, in which the job would otherwise be silent and deaf
to SLURM's SIGTERM. :func:`make_examples` makes them one by one, says how far it got every
``PROGRESS_EVERY_S`` seconds (count, rate, time left), and reads the stop flag before each one: a stop
raises ``runtime.stop.Cancelled``, what was made so far kept in the caller's dict.

:class:`ExampleCache` keeps them in ``<data.cache_dir>/reasoning_gym/<task>-<hash>.json``, where the hash
is of what the examples are a function of (the task, its settings, the seed, the dataset's size and
reasoning-gym's version; the file repeats them and a mismatch is not read). One JSON document, written to
a temporary file and renamed (a reader never sees half a file; two writers leave one whole file), and
read back exactly: an example's metadata (which its task's verifier reads) holds tuples, sets and dicts
with non-string keys, which are tagged in the JSON (``{"__tuple__": [...]}``) and checked to come back
type for type; examples holding anything else (an object) are not cached, and the job says so. What a
stopped start-up had made is written too, so a requeued job continues from there.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import socket
import time
from typing import Any, Callable, Optional, Sequence

from megatron_gspo.runtime.stop import Cancelled

log = logging.getLogger("megatron_gspo")

PROGRESS_EVERY_S = 5.0
CACHE_FORMAT = 1
_TAGS = ("__tuple__", "__set__", "__frozenset__", "__dict__", "__float__")


class Unencodable(TypeError):
    """An example holds a value the cache cannot write and read back exactly (its type's name)."""


def encode(x: Any) -> Any:
    """``x`` as JSON values, tuples / sets / non-string-keyed dicts / non-finite floats tagged (see decode)."""
    t = type(x)
    if x is None or t in (bool, int, str):
        return x
    if t is float:
        return x if math.isfinite(x) else {"__float__": repr(x)}
    if t is list:
        return [encode(v) for v in x]
    if t is tuple:
        return {"__tuple__": [encode(v) for v in x]}
    if t in (set, frozenset):
        return {"__set__" if t is set else "__frozenset__": [encode(v) for v in x]}
    if t is dict:
        if all(type(k) is str for k in x) and not (len(x) == 1 and next(iter(x)) in _TAGS):
            return {k: encode(v) for k, v in x.items()}
        return {"__dict__": [[encode(k), encode(v)] for k, v in x.items()]}
    raise Unencodable(t.__name__)


def decode(x: Any) -> Any:
    """The inverse of :func:`encode`."""
    if isinstance(x, list):
        return [decode(v) for v in x]
    if not isinstance(x, dict):
        return x
    if len(x) == 1:
        ((tag, v),) = x.items()
        if tag == "__tuple__":
            return tuple(decode(i) for i in v)
        if tag in ("__set__", "__frozenset__"):
            return (set if tag == "__set__" else frozenset)(decode(i) for i in v)
        if tag == "__dict__":
            return {decode(k): decode(val) for k, val in v}
        if tag == "__float__":
            return float(v)
    return {k: decode(v) for k, v in x.items()}


def same(a: Any, b: Any) -> bool:
    """Equal and of the same types all the way down (``(1, 2)`` is not ``[1, 2]``; NaN is NaN)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(v, b[k]) for k, v in a.items())
    if isinstance(a, float) and math.isnan(a):
        return math.isnan(b)
    return a == b


class ExampleCache:
    """The file of one task's examples (module doc). ``key``: what they are a function of (JSON values)."""

    def __init__(self, directory: str, name: str, key: dict) -> None:
        self.key = json.loads(json.dumps(key, sort_keys=True, default=repr))
        digest = hashlib.sha256(json.dumps(self.key, sort_keys=True).encode()).hexdigest()[:16]
        self.path = os.path.join(directory, f"{name}-{digest}.json")

    def load(self, warn: bool = True) -> dict[int, dict]:
        """The examples the file holds by index ({} when there is none, or it is not this key's: said when
        ``warn``)."""
        try:
            with open(self.path, encoding="utf-8") as f:
                doc = json.load(f)
            if doc.get("format") != CACHE_FORMAT or doc.get("key") != self.key:
                (log.warning if warn else log.debug)("%s: an example cache of other settings or another reasoning-gym version; not read "
                            "(the examples are made again and the file replaced)", self.path)
                return {}
            return {int(i): decode(e) for i, e in doc["examples"].items()}
        except FileNotFoundError:
            return {}
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            (log.warning if warn else log.debug)("%s: example cache unreadable (%s); the examples are made again and the file replaced",
                        self.path, str(e).splitlines()[0] if str(e) else type(e).__name__)
            return {}

    def save(self, examples: dict[int, dict]) -> Optional[str]:
        """Write ``examples`` (index -> entry) atomically; None when written, else why not (in words)."""
        try:
            encoded = {str(i): encode(e) for i, e in sorted(examples.items())}
        except Unencodable as e:
            return f"its examples hold a {e} value, which the cache cannot write and read back"
        text = json.dumps({"format": CACHE_FORMAT, "key": self.key, "examples": encoded})
        first = next(iter(examples.values()), None)
        if first is not None and not same(decode(json.loads(json.dumps(encode(first)))), first):
            return "its examples do not read back exactly from JSON"
        tmp = f"{self.path}.{socket.gethostname()}.{os.getpid()}.tmp"
        try:
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            with open(tmp, "w", encoding="utf-8") as f:
                f.write(text)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.path)
        except OSError as e:
            try:
                os.remove(tmp)
            except OSError:
                pass
            return f"cannot write {self.path}: {e.strerror or e}"
        return None


def _duration(s: float) -> str:
    s = int(round(s))
    return f"{s // 3600} h {s % 3600 // 60} min" if s >= 3600 else f"{s // 60} min {s % 60} s" if s >= 60 else f"{s} s"


def make_examples(source: str, make: Callable[[int], dict], indices: Sequence[int], made: dict[int, dict],
                  should_stop: Callable[[], bool] = lambda: False, say: Callable[[str], None] = log.info,
                  every_s: float = PROGRESS_EVERY_S, clock: Callable[[], float] = time.monotonic) -> dict[int, dict]:
    """``made`` (the examples there are, by index), given the example ``make(i)`` of every index of ``indices``
    it lacks, made in order, and returned; every ``every_s`` seconds ``say`` gets a progress line;
    ``should_stop()`` is read before each example: Cancelled when it says so, ``made`` holding what was made
    until then (for the caller to keep)."""
    todo = [i for i in dict.fromkeys(indices) if i not in made]
    t0 = last = clock()
    for n, index in enumerate(todo):
        if should_stop():
            raise Cancelled(f"while making {source} examples", elapsed_s=clock() - t0)
        made[index] = make(index)
        now = clock()
        if now - last >= every_s and n + 1 < len(todo):
            rate = (n + 1) / max(now - t0, 1e-9)
            left = _duration((len(todo) - n - 1) / rate)
            say(f"{source}: {n + 1}/{len(todo)} examples made ({rate:.3g}/s, about {left} left)")
            last = now
    return made
