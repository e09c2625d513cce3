"""``python -m megatron_gspo.preflight [--quick] [--json out.json] [section.key=value ...]``:
the checks in order, one line each as it finishes, the table at the end, exit 0 / 1 / 2, or 79 when a
stop signal (SIGTERM, Ctrl-C, ...) ended it early: the check in progress ends (a job in it stops as the
trainer does), the rest are skipped, and the table, the JSON and the cleanup still happen."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
from typing import Optional

from megatron_gspo.errors import USER_ERRORS, ConfigError
from megatron_gspo.runtime.exit_status import EXIT_PREEMPTED_NOTHING_SAVED as EXIT_STOPPED
from megatron_gspo.runtime.stop import PreemptionFlag
from megatron_gspo.runtime.writable import check_writable, describe_os_error
from megatron_gspo.preflight import collectives, decoding, environment, fp8, memory, numerics, resume, training
from megatron_gspo.preflight.context import Context, validate_overrides
from megatron_gspo.preflight.runner import (
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    FAILED,
    Check,
    exit_code,
    format_line,
    format_table,
    run_checks,
    stopped_by,
    to_json,
)

log = logging.getLogger("megatron_gspo")

# Cheap and local first, then the model builds, then the long jobs; collectives last so a slow
# rendezvous does not hide the rest. Every rank runs the same list in the same order (the jobs and
# the collectives are collective calls).
CHECKS = [
    Check("env.versions", environment.check_versions),
    Check("env.device", environment.check_device),
    Check("env.bf16", environment.check_bf16),
    Check("env.fp8", environment.check_fp8),
    Check("env.auto_impl", environment.check_auto_impl),
    Check("numerics.te_vs_local", numerics.check_te_vs_local),
    Check("numerics.experts", numerics.check_experts),
    Check("numerics.fused_logprobs", numerics.check_fused_logprobs),
    Check("numerics.fp8_unaligned", fp8.check_fp8_unaligned),
    Check("rl_step", training.check_rl_step),
    Check("rl_step.fp8", training.check_rl_step_fp8),
    Check("checkpoint.resume", resume.check_resume),
    Check("decode.cuda_graphs", decoding.check_cuda_graphs),
    Check("decode.te_spec", decoding.check_te_decode),
    Check("speed.train_bf16", training.check_train_bf16),
    Check("speed.mfu_bf16", training.check_mfu_bf16),
    Check("speed.generation", training.check_generation),
    Check("speed.logprob", training.check_logprob),
    Check("speed.train_fp8", training.check_train_fp8),
    Check("speed.mfu_fp8", training.check_mfu_fp8),
    Check("memory.30b_cut", memory.check_memory),
    Check("dist.all_reduce", collectives.check_all_reduce),
    Check("dist.all_to_all", collectives.check_all_to_all),
]


def parse_args(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m megatron_gspo.preflight", description=(
        "Check and measure megatron-gspo on this node (run it first on new hardware; under torchrun "
        "for the collectives). Overrides apply to every job it runs (the demo job and its variants)."))
    ap.add_argument("--quick", action="store_true", help="cut-down shapes: well under a minute on a CPU")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON (rank 0)")
    ap.add_argument("--keep", action="store_true", help="keep the scratch directory (the jobs' metrics)")
    ap.add_argument("--only", metavar="NAME[,NAME...]", help="run these checks only, in the preflight's order "
                    "(names as the table prints them, e.g. decode.te_spec,memory.30b_cut)")
    args, rest = ap.parse_known_args(argv)
    args.overrides = rest
    return args


def check_args(args: argparse.Namespace) -> None:
    """What the command line got wrong, before any check runs (ConfigError, exit 2): an option the
    preflight does not have (a ``--name`` without a dot is not a ``--section.key`` override either),
    or a --json path it could not write after minutes of checks."""
    for word in args.overrides:
        name = word[2:].split("=", 1)[0] if word.startswith("--") else None
        if word.startswith("-") and (name is None or "." not in name):
            raise ConfigError(f"unknown option {word.split('=', 1)[0]}; the preflight's options are --quick, "
                              "--json PATH, --keep and --only NAMES, and settings are section.key=value (e.g. train.num_steps=2)")
    unknown = [n for n in (args.only or "").split(",") if n and n not in {c.name for c in CHECKS}]
    if unknown:
        raise ConfigError(f"--only: no check named {', '.join(unknown)}; the checks are "
                          f"{', '.join(c.name for c in CHECKS)}")
    if args.json:
        path = os.path.abspath(args.json)
        folder = os.path.dirname(path)
        if os.path.isdir(path):
            raise ConfigError(f"--json {args.json} is a directory; give the path of a file to write")
        if not os.path.isdir(folder):
            raise ConfigError(f"--json {args.json}: folder {folder} does not exist; create it or give another path")
        # tried, not os.access'ed: the real cause (a read-only mount is not "permission denied"), and root
        # passes os.access on a read-only file of /proc or a read-only mount
        check_writable(path, f"--json {args.json}", directory=False, error=ConfigError)


def _workdir() -> str:
    """The same path on every rank of a node (torchrun's run id), so no rank writes elsewhere."""
    run = os.environ.get("TORCHELASTIC_RUN_ID")
    if run is None or "RANK" not in os.environ:
        return tempfile.mkdtemp(prefix="megatron_gspo_preflight.")
    path = os.path.join(tempfile.gettempdir(), f"megatron_gspo_preflight.{run}")
    os.makedirs(path, exist_ok=True)
    return path


def main(argv: Optional[list[str]] = None) -> int:
    from megatron_gspo.runtime import comm, parallel
    from megatron_gspo.runtime.logger import setup_logging

    args = parse_args(list(sys.argv[1:] if argv is None else argv))
    rank = int(os.environ.get("RANK", 0))
    setup_logging(rank)
    try:
        check_args(args)
        # the device every job of the preflight will run on: the jobs' own decision (parallel.device)
        device = parallel.resolve_device(validate_overrides(args.overrides).parallel)
    except USER_ERRORS as e:
        log.error("error: %s", e)
        return EXIT_USAGE
    parallel.init_distributed(device)
    ctx = Context(quick=args.quick, overrides=args.overrides, workdir=_workdir(), device=device)
    if rank == 0:
        print(f"megatron-gspo preflight{' --quick' if args.quick else ''} on {ctx.device} "
              f"({comm.world_size()} rank{'s' if comm.world_size() > 1 else ''}); scratch {ctx.workdir}", flush=True)

    def progress(r):
        if rank == 0:
            print(format_line(r), flush=True)

    flag = PreemptionFlag.install()  # the process's (``python -m`` installed it for every stop signal)

    def stop_vote():
        return flag.name if comm.any_rank(flag.set, ctx.device, what="preflight: stop vote") else None

    try:
        only = set(args.only.split(",")) if args.only else None
        checks = [c for c in CHECKS if only is None or c.name in only]
        results = run_checks(checks, ctx, on_result=progress, should_stop=stop_vote)
        # one verdict for the job: a check that failed on any rank fails the run everywhere
        failed = comm.any_rank(exit_code(results) == EXIT_FAILED, ctx.device, what="preflight verdict")
        stopped = stopped_by(results)  # the same on every rank: the votes were collective
    finally:
        parallel.destroy()
        if not args.keep and rank == 0:
            shutil.rmtree(ctx.workdir, ignore_errors=True)
    code = EXIT_FAILED if failed else EXIT_STOPPED if stopped else EXIT_OK
    if rank == 0:
        print("\n" + format_table(results))
        if failed and not any(r.status == FAILED for r in results):
            print("(a check failed on another rank: see its log)")
        if stopped:
            print(f"stopped by {stopped}: the checks not run are skipped; exit {code}", flush=True)
        if args.json:
            meta = {"exit_code": code, "quick": args.quick, "device": str(ctx.device),
                    "world_size": int(os.environ.get("WORLD_SIZE", 1)), "overrides": args.overrides}
            try:  # writable when the run began (check_args); a disk that filled up since is said in one line
                with open(args.json, "w", encoding="utf-8") as f:
                    f.write(to_json(results, meta))
            except OSError as e:
                log.error("error: --json %s: cannot write the results there (%s); the table above has them",
                          args.json, describe_os_error(e, os.path.dirname(os.path.abspath(args.json))))
                return EXIT_USAGE
    return code
