"""The preflight's runner: run named checks, keep going past any failure, report ok / failed / skipped.

Pure on purpose (no torch, no distributed state): tests drive it with plain functions. A check is a
callable taking the context and returning ``(value, data)`` -- a one-line human value and a
JSON-ready dict -- or raising :class:`Skip` with the reason it cannot run here. Any other exception
makes it "failed" with the error; the next check still runs, because a user wants the whole picture
from one run on a new node, not the first problem only.
"""

from __future__ import annotations

import json
import logging
import time
import traceback
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Optional

log = logging.getLogger("megatron_gspo")

OK, FAILED, SKIPPED = "ok", "failed", "skipped"
EXIT_OK, EXIT_FAILED, EXIT_USAGE = 0, 1, 2


class Skip(Exception):
    """Raised by a check that cannot run here; the message is the reason ("no CUDA")."""


@dataclass
class Result:
    name: str
    status: str  # ok | failed | skipped
    value: str = ""  # ok: the measurement in words; failed: the error; skipped: the reason
    reason: Optional[str] = None  # skipped only
    error: Optional[str] = None  # failed only
    data: dict = field(default_factory=dict)
    seconds: float = 0.0
    stopped_by: Optional[str] = None  # skipped because a stop signal (its name) ended the run early


@dataclass
class Check:
    name: str
    fn: Callable[[Any], tuple[str, dict]]


def run_check(check: Check, ctx: Any) -> Result:
    t0 = time.perf_counter()
    try:
        value, data = check.fn(ctx)
        res = Result(check.name, OK, value, data=dict(data or {}))
    except Skip as e:
        res = Result(check.name, SKIPPED, str(e), reason=str(e))
    except Exception as e:  # noqa: BLE001 - a failing check is a result, not the end of the run
        err = f"{type(e).__name__}: {e}"
        log.debug("preflight check %s failed:\n%s", check.name, traceback.format_exc())
        res = Result(check.name, FAILED, err, error=err, data={"traceback": traceback.format_exc(limit=8)})
    res.seconds = time.perf_counter() - t0
    return res


def run_checks(checks: Iterable[Check], ctx: Any, on_result: Optional[Callable[[Result], None]] = None,
               should_stop: Optional[Callable[[], Optional[str]]] = None) -> list[Result]:
    """Every check in order, each isolated from the others' failures.

    ``should_stop()``: None, or why to stop ("SIGTERM"); read before the first check and after each one
    (under torchrun a collective vote: every rank runs the same checks). Once it says stop, the checks
    left are skipped ("not run: stopped by SIGTERM") and a check that failed while the signal was
    pending is reported skipped (cut short by it), not failed: the node is not at fault."""
    out, stop = [], should_stop() if should_stop is not None else None
    for c in checks:
        if stop is not None:
            r = Result(c.name, SKIPPED, f"not run: stopped by {stop}", reason=f"not run: stopped by {stop}",
                       stopped_by=stop)
        else:
            r = run_check(c, ctx)
            stop = should_stop() if should_stop is not None else None
            if stop is not None and r.status == FAILED:
                why = f"cut short by {stop} ({r.error})"
                r = Result(c.name, SKIPPED, why, reason=why, seconds=r.seconds, stopped_by=stop)
        if on_result is not None:
            on_result(r)
        out.append(r)
    return out


def stopped_by(results: Iterable[Result]) -> Optional[str]:
    """The stop signal that ended the run early (run_checks), or None."""
    return next((r.stopped_by for r in results if r.stopped_by), None)


def exit_code(results: Iterable[Result]) -> int:
    return EXIT_FAILED if any(r.status == FAILED for r in results) else EXIT_OK


def format_line(r: Result, width: int = 28) -> str:
    return f"{r.name:<{width}s} {r.status:<8s} {r.value}"


def format_table(results: list[Result]) -> str:
    width = max([len(r.name) for r in results] + [5])
    lines = [f"{'check':<{width}s} {'status':<8s} value / reason", "-" * (width + 40)]
    lines += [format_line(r, width) for r in results]
    n = {s: sum(r.status == s for r in results) for s in (OK, FAILED, SKIPPED)}
    lines.append(f"{n[OK]} ok, {n[FAILED]} failed, {n[SKIPPED]} skipped")
    return "\n".join(lines)


def to_json(results: list[Result], meta: dict) -> str:
    checks = {r.name: {k: v for k, v in asdict(r).items() if k != "name" and v is not None} for r in results}
    return json.dumps({"exit_code": exit_code(results), **meta, "checks": checks}, indent=1, default=str)
