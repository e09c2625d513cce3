"""Are two runs' metrics.jsonl the same run? Bit for bit, timings aside.

    python tools/compare_metrics.py BEFORE/metrics.jsonl AFTER/metrics.jsonl [--ignore PATTERN ...]
    python tools/compare_metrics.py --run OUT_DIR BEFORE/metrics.jsonl [section.key=value ...]
    python tools/compare_metrics.py --run OUT_DIR [section.key=value ...]  # the baseline: run only

Every row must have the same step, the same keys and the same values: floats compared exactly (the
JSON text of a float round-trips its bits; NaN equals NaN), except the keys that measure wall time or
memory (``TIMING``: perf/*_s, perf/*_per_s, perf/rss_mb and the asynchronous side's seconds and idle
fractions), which differ between any two runs. Everything else the default job logs (losses, rewards,
clip fractions, gradient norms, routing statistics, generated-token and decode-row counts, evaluation)
is a function of the seed and the code on one machine with one thread count; a key that appears on one
side only is a difference too.

``--run DIR`` runs the default job (``python -m megatron_gspo.train train.output_dir=DIR``, plus the
overrides) first (and only that when no BEFORE is given: the baseline), with ``OMP_NUM_THREADS`` and torch's intra-op threads pinned (``--threads``, default
2): CPU reductions split over threads add in another order with another thread count, so runs compare
bit for bit only at the same count. Exit status: 0 identical, 1 different (the differences listed,
the first step and key first), 2 bad input.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import math
import os
import subprocess
import sys
from typing import Iterable, Optional

TIMING: tuple[str, ...] = ("perf/*_s", "perf/*_per_s", "perf/rss_mb", "async/*_s", "async/*idle_frac")


def read_rows(path: str) -> list[dict]:
    """The rows of a metrics.jsonl (blank lines skipped); a line that is not a JSON object is an error."""
    rows = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:
                raise ValueError(f"{path}:{n}: not JSON ({e})") from None
            if not isinstance(row, dict) or "step" not in row:
                raise ValueError(f"{path}:{n}: not a metrics row (a JSON object with a 'step')")
            rows.append(row)
    return rows


def same_value(a, b) -> bool:
    """Exact equality; NaN equals NaN (a skipped step logs NaN on both sides)."""
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def differences(before: list[dict], after: list[dict], ignore: Iterable[str] = TIMING) -> list[str]:
    """Every difference between two runs' rows, in step order (empty: the same run)."""
    ignore = tuple(ignore)
    skip = lambda k: any(fnmatch.fnmatch(k, p) for p in ignore)  # noqa: E731
    out = []
    if len(before) != len(after):
        out.append(f"{len(before)} rows before, {len(after)} after")
    for i, (a, b) in enumerate(zip(before, after)):
        if a.get("step") != b.get("step"):
            out.append(f"row {i + 1}: step {a.get('step')} before, {b.get('step')} after")
            continue
        step = a["step"]
        for k in sorted(set(a) | set(b)):
            if skip(k):
                continue
            if k not in b:
                out.append(f"step {step}: {k} only before ({a[k]!r})")
            elif k not in a:
                out.append(f"step {step}: {k} only after ({b[k]!r})")
            elif not same_value(a[k], b[k]):
                out.append(f"step {step}: {k} {a[k]!r} before, {b[k]!r} after")
    return out


def run_default_job(out_dir: str, overrides: Iterable[str] = (), threads: int = 2) -> str:
    """Run the default job into ``out_dir`` (must not hold a metrics.jsonl: it would be appended to);
    returns the path of its metrics.jsonl."""
    path = os.path.join(out_dir, "metrics.jsonl")
    if os.path.exists(path):
        raise ValueError(f"{path} exists: a run into that directory would continue it; pick a new --run directory")
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "PYTHONWARNINGS": "ignore"}
    code = ("import sys, torch; torch.set_num_threads(int(sys.argv[1])); from megatron_gspo.train import main; "
            "sys.exit(main(sys.argv[2:]))")
    cmd = [sys.executable, "-c", code, str(threads), f"train.output_dir={out_dir}", *overrides]
    p = subprocess.run(cmd, env=env)
    if p.returncode != 0:
        raise RuntimeError(f"the default job exited with {p.returncode}: {' '.join(cmd)}")
    return path


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="*", help="BEFORE and AFTER metrics.jsonl (with --run: AFTER is run; "
                                             "then the positional arguments after BEFORE are job overrides)")
    ap.add_argument("--run", metavar="OUT_DIR", help="run the default job into OUT_DIR and compare it with BEFORE")
    ap.add_argument("--threads", type=int, default=2, help="torch / OpenMP threads of --run (default 2)")
    ap.add_argument("--ignore", action="append", default=[], metavar="PATTERN",
                    help="more keys to leave out (fnmatch); the timing keys are always left out")
    ap.add_argument("--max-shown", type=int, default=30, help="differences printed (default 30)")
    a = ap.parse_args(argv)
    try:
        if a.run and (not a.files or "=" in a.files[0]):  # no BEFORE: the baseline
            print(f"wrote {run_default_job(a.run, a.files, a.threads)}")
            return 0
        if a.run:
            before, overrides = a.files[0], a.files[1:]
            after = run_default_job(a.run, overrides, a.threads)
        else:
            if len(a.files) != 2:
                ap.error("give BEFORE and AFTER metrics.jsonl (or --run OUT_DIR BEFORE)")
            before, after = a.files
        diffs = differences(read_rows(before), read_rows(after), TIMING + tuple(a.ignore))
    except (OSError, ValueError, RuntimeError) as e:
        print(f"compare_metrics: {e}", file=sys.stderr)
        return 2
    if not diffs:
        print(f"identical: {before} and {after} (timing keys aside: {', '.join(TIMING + tuple(a.ignore))})")
        return 0
    print(f"{len(diffs)} difference(s) between {before} and {after}:")
    for d in diffs[: a.max_shown]:
        print(f"  {d}")
    if len(diffs) > a.max_shown:
        print(f"  ... {len(diffs) - a.max_shown} more")
    return 1


if __name__ == "__main__":
    sys.exit(main())
