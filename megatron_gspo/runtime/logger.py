"""Rank-0 logging: metrics.jsonl and the run trackers (runtime/trackers/: TensorBoard, wandb, MLflow), one
progress line per step, the step's section timings (``Timer``) and the perf/* and data/* metrics of a step."""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import sys
import time
from typing import Mapping, Optional, Sequence, Union

import torch

from megatron_gspo.runtime.sysinfo import current_rss
from megatron_gspo.runtime.trackers.base import Tracker, Trackers
from megatron_gspo.runtime.writable import describe_os_error

Value = Union[float, int, torch.Tensor]

log = logging.getLogger("megatron_gspo")


def setup_logging(rank: int, prefix: str | None = None) -> None:
    """The process's logging and warning filters, for a command-line entry point (train.main, the preflight,
    the comparison's runs, the test programs): the root logger at INFO on rank 0, WARNING elsewhere, one
    line per record on stdout; megatron's import-time apex/TE notices, DeprecationWarning and
    FutureWarning silenced. ``prefix``: who speaks, in brackets after the time (an async job's rollout
    ranks: "rollout rank N"). The library itself never calls it: it logs to the ``megatron_gspo`` logger
    and leaves the host program's logging and warnings as they are."""
    import warnings

    warnings.filterwarnings("ignore", message=".*(Apex|apex|Transformer Engine).*")
    warnings.filterwarnings("ignore", category=DeprecationWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)
    logging.basicConfig(level=logging.INFO if rank == 0 else logging.WARNING, stream=sys.stdout,
                        format=f"%(asctime)s [{prefix}] %(message)s" if prefix else "%(asctime)s %(message)s",
                        datefmt="%H:%M:%S", force=True)
    logging.getLogger("megatron").setLevel(logging.WARNING)


class MetricsLogger:
    """Writes on rank 0 only; other ranks get a no-op object with the same methods.

    metrics.jsonl gets one row per step, written whole to the file (no buffer of ours) as the step ends.
    A write that fails (a full disk, a quota, a file system gone away) is said in one line when it
    happens and training goes on: the metrics are a log, the checkpoint is the run's state (a checkpoint
    the disk refuses stops the run, exit 74). Each later step tries again; a line says when rows are
    written again and which steps have none. ``trackers`` (train.loggers: TensorBoard, wandb, MLflow;
    runtime/trackers/) get the step's finite scalars and its histograms; one that fails is off for the
    rest of the run.

    ``resumed``: this run continues a checkpoint (checkpoint.resume found one). Its rows from the resumed
    step on are an earlier attempt's, which went past that checkpoint: dropped, the steps logged again. A
    run that continues nothing never touches an earlier run's logs: they are moved aside
    (``keep_earlier_logs``) and this run writes a new metrics.jsonl."""

    def __init__(self, output_dir: str, enabled: bool, trackers: Sequence[Tracker] = (), resumed: bool = False) -> None:
        self.enabled = enabled
        self.output_dir = output_dir
        self.resumed = resumed
        self.trackers = Trackers(trackers if enabled else ())
        self.started = False  # the trackers (at the first row)
        self.fd: Optional[int] = None  # metrics.jsonl, opened for appending at the first row
        self.lost: list[int] = []  # steps whose row could not be written since the last one that was

    def _open(self, first_step: int) -> None:
        # Opened at the first log line, so a run refused at start-up writes nothing. For a resumed run
        # that first step is where its history starts: rows at or after it were written by the run that
        # went on past its last checkpoint (killed, then resumed from that checkpoint) and would give every
        # re-run step two rows. They are dropped, with a warning; TensorBoard hides its own events from
        # that step on (purge_step). A new run's predecessor in the directory is kept whole, aside.
        os.makedirs(self.output_dir, exist_ok=True)
        path = os.path.join(self.output_dir, "metrics.jsonl")
        if not self.resumed:
            keep_earlier_logs(self.output_dir)
        dropped = truncate_jsonl(path, first_step)
        if dropped:
            log.warning("%s: dropped %d row(s) of steps >= %d written by an earlier run that went past its last "
                        "checkpoint; this run logs those steps again", path, dropped, first_step)
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def log(self, step: int, metrics: Mapping[str, Value]) -> None:
        if not self.enabled:
            return
        row, scalars, histograms = {"step": step}, {}, {}
        for k, v in metrics.items():
            if isinstance(v, torch.Tensor) and v.numel() != 1:  # a histogram ("cat" metric; empty when no row trained)
                v = v.float()
                v = v[torch.isfinite(v)]  # a skipped (non-finite) step must not break logging
                if v.numel() > 0:
                    histograms[k] = v
                continue
            row[k] = scalars[k] = float(v)
        self._write_row(step, (json.dumps(row) + "\n").encode("utf-8"))
        if not self.started:  # after the first row: an earlier run's tensorboard/ is moved aside by then
            self.started = True
            self.trackers.start(step)
        # a non-finite scalar (a skipped step's loss) is in metrics.jsonl only
        self.trackers.log(step, {k: x for k, x in scalars.items() if math.isfinite(x)}, histograms)

    def runs(self) -> dict:
        """{tracker: its run}: what a resumed job needs to continue each tracker's run (kept in the checkpoint)."""
        return self.trackers.runs()

    def _write_row(self, step: int, data: bytes) -> None:
        """Append one row, whole or not at all (a row cut by a full disk is cut off again)."""
        start = None
        try:
            if self.fd is None:
                self._open(step)
            start = os.lseek(self.fd, 0, os.SEEK_END)
            view = memoryview(data)
            while view:
                view = view[os.write(self.fd, view):]
        except OSError as e:
            if start is not None:
                with contextlib.suppress(OSError):
                    os.ftruncate(self.fd, start)
            if not self.lost:
                log.warning("train.output_dir=%s: cannot write metrics.jsonl at step %d: %s; training goes on (the "
                            "metrics are a log, the checkpoint holds the run) and each step tries again",
                            self.output_dir, step, describe_os_error(e, self.output_dir))
            self.lost.append(step)
            return
        if self.lost:
            log.warning("train.output_dir=%s: metrics.jsonl written again from step %d; %s", self.output_dir, step,
                        self._missing())
            self.lost = []

    def _missing(self) -> str:
        steps = self.lost
        named = ", ".join(map(str, steps)) if len(steps) <= 8 else f"{steps[0]}-{steps[-1]}"
        return f"{len(steps)} step(s) have no row: {named}"

    def close(self) -> None:
        self.trackers.close()
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
        if self.lost:
            log.warning("train.output_dir=%s: metrics.jsonl could not be written to the end: %s", self.output_dir,
                        self._missing())
            self.lost = []


LOGS = ("metrics.jsonl", "tensorboard")  # what MetricsLogger writes in train.output_dir


def keep_earlier_logs(output_dir: str) -> Optional[int]:
    """A run that continues no checkpoint, in a directory holding an earlier run's logs: they are renamed
    to metrics.N.jsonl and tensorboard.N/ (N: the first number neither name has), with a warning saying
    so, and this run starts new ones. Returns N, or None when there was nothing to keep (no file, or
    empty ones)."""
    found = [name for name in LOGS if _has_content(os.path.join(output_dir, name))]
    if not found:
        return None
    n = 1
    while any(os.path.lexists(os.path.join(output_dir, _numbered(name, n))) for name in LOGS):
        n += 1
    for name in found:
        os.replace(os.path.join(output_dir, name), os.path.join(output_dir, _numbered(name, n)))
    log.warning("train.output_dir=%s holds the logs of an earlier run and this run continues no checkpoint of it: "
                "kept as %s; this run writes a new %s (resume with checkpoint.resume=true to continue a run's log "
                "instead)", output_dir, " and ".join(_numbered(name, n) for name in found), " and ".join(found))
    return n


def _numbered(name: str, n: int) -> str:
    stem, ext = os.path.splitext(name)
    return f"{stem}.{n}{ext}"


def _has_content(path: str) -> bool:
    if os.path.isdir(path):
        return bool(os.listdir(path))
    return os.path.isfile(path) and os.path.getsize(path) > 0


def truncate_jsonl(path: str, first_step: int) -> int:
    """Keep only the rows of ``path`` whose step is below ``first_step`` (a line cut short by a kill
    goes too); returns how many rows were dropped. Replaced atomically: a crash here loses nothing."""
    if not os.path.isfile(path):
        return 0
    # errors="replace": a damaged byte spoils its own row (dropped below), not the resume
    with open(path, encoding="utf-8", errors="replace") as f:
        lines = f.read().splitlines()
    keep = []
    for line in lines:
        try:
            if json.loads(line)["step"] < first_step:
                keep.append(line)
        except (ValueError, KeyError, TypeError):
            continue
    dropped = sum(1 for line in lines if line.strip()) - len(keep)
    if dropped:
        tmp = path + ".tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write("".join(line + "\n" for line in keep))
        os.replace(tmp, path)
    return dropped


def progress_line(step: int, total: int, m: Mapping[str, Value]) -> str:
    """One compact line: the numbers an RL practitioner watches."""

    def g(k: str, fmt: str = ".3f") -> Optional[str]:
        v = m.get(k)
        if v is None or (isinstance(v, torch.Tensor) and v.numel() != 1):
            return None
        return format(float(v), fmt)

    parts = [f"step {step}/{total}"]
    for label, key, fmt in (
        ("reward", "rollout/reward_mean", ".3f"),
        ("loss", "loss/loss", ".4g"),
        ("clip", "loss/clip_frac", ".3f"),
        ("kl", "loss/approx_kl", ".2e"),
        ("ent", "loss/entropy", ".3f"),
        ("gnorm", "train/grad_norm", ".3f"),
        ("lr", "train/lr", ".2e"),
        ("len", "rollout/response_length_mean", ".1f"),
        ("turns", "rollout/turns_mean", ".2f"),
        ("tools", "rollout/tool_calls_mean", ".2f"),
        ("route_chg", "routing/routing_change_frac", ".3f"),
        ("|lp-lp_gen|", "rollout/logprob_diff_max", ".1e"),
        ("eval acc", "eval/greedy_accuracy", ".3f"),
        *((k[len("eval/"):], k, ".3f") for k in m if k.startswith("eval/pass@")),
        ("gen tok/s", "perf/gen_tokens_per_s", ".0f"),
        ("s/step", "perf/step_time_s", ".2f"),
    ):
        s = g(key, fmt)
        if s is not None:
            parts.append(f"{label} {s}")
    return " | ".join(parts)


class Timer:
    """Wall-clock sections of a step: ``with timer("generate"): ...``; ``timer.pop()`` -> dict.
    On a CUDA ``device`` each section waits for the device's queued work at both ends, so a section
    is charged with the GPU time it launched."""

    def __init__(self, device: torch.device = torch.device("cpu")) -> None:
        self.times: dict[str, float] = {}
        self.cuda = torch.device(device).type == "cuda"

    def __call__(self, name: str):
        @contextlib.contextmanager
        def section():
            if self.cuda:
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            yield
            if self.cuda:
                torch.cuda.synchronize()
            self.times[name] = self.times.get(name, 0.0) + time.perf_counter() - t0

        return section()

    def record(self, name: str, seconds: float) -> None:
        """Section ``name`` took ``seconds``, measured elsewhere (an async job's rollout ranks generate)."""
        self.times[name] = seconds

    def pop(self) -> dict[str, float]:
        t, self.times = self.times, {}
        return t


def perf_metrics(timer: Timer, gen_tokens: float, step_time: float) -> dict:
    """perf/*: the step's timed sections (``timer`` is emptied), its wall time, the process's RSS and the
    generation throughput (``gen_tokens``: the step's perf/gen_tokens)."""
    times = timer.pop()
    out = {f"perf/{k}_s": v for k, v in times.items()}
    out["perf/step_time_s"] = step_time
    out["perf/rss_mb"] = current_rss() / 2**20
    out["perf/gen_tokens_per_s"] = gen_tokens / max(times.get("generate", 0.0), 1e-9)
    return out


def data_metrics(before: dict, after: dict, step: int, data_cfg, log_it: bool) -> dict:
    """Prompts that data.overlong_prompt_policy dropped or cut this step, and since the start of the
    run (the sampler's counters survive a resume); said once per step when any, never silently.
    Every DP rank draws the same prompts, so the counts need no reduction."""
    out = {"data/dropped_prompts": after["num_dropped"] - before["num_dropped"],
           "data/truncated_prompts": after["num_truncated"] - before["num_truncated"],
           "data/dropped_prompts_total": after["num_dropped"], "data/truncated_prompts_total": after["num_truncated"]}
    if log_it and (out["data/dropped_prompts"] or out["data/truncated_prompts"]):
        log.warning("step %d: %d prompt(s) dropped and %d left-truncated for exceeding data.max_prompt_length=%d "
                    "tokens (data.overlong_prompt_policy=%s; %d dropped, %d truncated since the start)",
                    step, out["data/dropped_prompts"], out["data/truncated_prompts"], data_cfg.max_prompt_length,
                    data_cfg.overlong_prompt_policy, after["num_dropped"], after["num_truncated"])
    return out
