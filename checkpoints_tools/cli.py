"""What the two converter commands share: parsing sizes and dtypes, the common options, progress
lines with the process's memory, the end-of-run summary, and running a conversion as a command
(a ConversionError becomes ``error: ...`` and exit status 2; a stop signal ends it at the next tensor
with its partial output removed, exit 130 / 143)."""

from __future__ import annotations

import json
import re
import signal
import sys
import threading
import time
from typing import Any, Optional

import torch

from checkpoints_tools.errors import ConversionError, ConversionStopped
from megatron_gspo.runtime.sysinfo import current_rss, peak_rss, reset_peak_rss
from megatron_gspo.runtime.writable import check_writable, format_bytes

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """'5GB' -> 5e9 (decimal units like transformers' max_shard_size; KiB/MiB/GiB binary)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?B|B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ConversionError(f"cannot parse size {text!r}; use e.g. 5GB, 500MB, 2GiB or a byte count")
    n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if n <= 0:
        raise ConversionError(f"size must be positive, got {text!r}")
    return n


# 1234567 -> '1.23 MB': decimal units, the ones --max-shard-size and the hub speak
human_bytes = format_bytes


DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name in (None, "auto"):
        return None
    if name not in DTYPES:
        raise ConversionError(f"--dtype {name!r} is not one of auto, fp32, bf16, fp16")
    return DTYPES[name]


class Progress:
    """Per-group progress lines on stderr and the end-of-run summary."""

    def __init__(self, what: str, total_groups: int, quiet: bool = False):
        self.what = what
        self.total = total_groups
        self.quiet = quiet
        self.t0 = time.perf_counter()
        reset_peak_rss()  # measure the conversion, not the imports before it
        self.baseline_rss = current_rss()
        self.done = 0
        self.tensors = 0
        self.bytes = 0

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{self.what}] {msg}", file=sys.stderr, flush=True)

    def warn(self, msg: str) -> None:
        """A line said even under --quiet (what was found and removed beside --out)."""
        print(f"[{self.what}] {msg}", file=sys.stderr, flush=True)

    def group(self, name: str, tensors: int, nbytes: int) -> None:
        self.done += 1
        self.tensors += tensors
        self.bytes += nbytes
        self.log(f"{self.done}/{self.total} {name}: {tensors} tensors, {human_bytes(nbytes)} "
                 f"({time.perf_counter() - self.t0:.1f}s, rss {human_bytes(current_rss())})")

    def summary(self, out: str, **extra: Any) -> dict:
        s = dict(output=out, tensors=self.tensors, bytes=self.bytes,
                 seconds=round(time.perf_counter() - self.t0, 3),
                 peak_rss_bytes=peak_rss(), baseline_rss_bytes=self.baseline_rss)
        s["peak_rss_growth_bytes"] = max(0, s["peak_rss_bytes"] - self.baseline_rss)
        s.update(extra)
        self.log(f"done: {s['tensors']} tensors, {human_bytes(s['bytes'])} in {s['seconds']:.1f}s; "
                 f"peak RSS {human_bytes(s['peak_rss_bytes'])} "
                 f"(+{human_bytes(s['peak_rss_growth_bytes'])} over the "
                 f"{human_bytes(self.baseline_rss)} at start) -> {out}")
        return s


def write_summary(path: Optional[str], summary: dict) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)


def add_common_args(ap, dtype_help: str) -> None:
    """Options both converters take."""
    ap.add_argument("--force", action="store_true", help="replace an existing output directory")
    ap.add_argument("--dtype", default="auto", help=dtype_help)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the work is copies and I/O; more threads "
                         "mostly contend)")
    ap.add_argument("--summary-json", default=None, help="also write the summary to this JSON file")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")


# The signals that stop a conversion (a scheduler's SIGTERM, Ctrl-C's SIGINT, a closed terminal's SIGHUP): the
# handler only records the first; the conversion stops at its next stop_point (at most one tensor later).
STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
_stop: dict = {"signum": None}


def _on_signal(signum, frame) -> None:
    if _stop["signum"] is None:
        _stop["signum"] = signum


def stop_point() -> None:
    """Where a conversion may stop: between tensors. Raises ConversionStopped once a stop signal came."""
    if _stop["signum"] is not None:
        raise ConversionStopped(_stop["signum"])


def check_summary_path(path: Optional[str]) -> None:
    """--summary-json writable before any work (the real cause otherwise: runtime/writable.py)."""
    if path:
        check_writable(path, f"--summary-json {path}", directory=False, error=ConversionError)


def run_cli(args, convert_fn) -> int:
    """Run ``convert_fn()`` with ``args.threads`` torch threads; a ConversionError becomes ``error: ...`` on
    stderr and exit status 2 (nothing was written). A stop signal ends it at the next stop_point: its partial
    output removed, one line, exit 128 + the signal (143 SIGTERM, 130 Ctrl-C)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, args.threads))
    in_main = threading.current_thread() is threading.main_thread()
    previous = {s: signal.signal(s, _on_signal) for s in STOP_SIGNALS} if in_main else {}
    try:
        check_summary_path(args.summary_json)
        summary = convert_fn()
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BaseException as e:  # a stop signal's ConversionStopped, wherever torch's writer wrapped it
        if _stop["signum"] is None:
            raise
        return _stopped(e)
    finally:
        for s, h in previous.items():
            signal.signal(s, h)
        torch.set_num_threads(threads)
        signum, _stop["signum"] = _stop["signum"], None
    if signum is not None:  # it came after the last stop point: the output is complete
        print(f"{signal.Signals(signum).name} after the conversion had finished: its output is complete",
              file=sys.stderr)
    write_summary(args.summary_json, summary)
    return 0


def _stopped(e: BaseException) -> int:
    signum = _stop["signum"]
    partial = getattr(e, "partial_output", None)
    print(f"stopped by {signal.Signals(signum).name}: "
          + (f"removed the partial output {partial}; " if partial else "nothing was written yet; ")
          + f"nothing was written to --out; exit {128 + signum}", file=sys.stderr, flush=True)
    return 128 + signum
