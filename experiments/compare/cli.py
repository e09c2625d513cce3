"""The command line: ``python -m experiments.compare [config.yaml] [section.key=value ...] [options]``.

Parses the options, then either rebuilds the report of a finished directory (``--report-only``),
runs one worker (``_worker``, started by run.py), or runs the whole comparison and reports it.
Everything is written under ``--out``; ``--docs-dir DIR`` also copies the generated tables and
plots into ``DIR/comparison.md`` and ``DIR/img/``.
"""

from __future__ import annotations

import argparse
import logging
import os
import re
import signal
import sys
import threading
from typing import Optional

from experiments.compare.variants import (
    DEFAULT_VARIANTS,
    STRESS_LR_MULT,
    STRESS_MINIBATCHES,
    VARIANTS,
    build_overrides,
)


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(
        prog="python -m experiments.compare", allow_abbrev=False,  # --docs must not silently mean --docs-dir
        description="Run GSPO / GSPO-token / GRPO / GRPO+R2 (and SAPO / CISPO / GMPO / LUSPO) from the same "
                    "initial model and compare them. "
                    "Positional: an optional job YAML (default: the packaged demo job), then section.key=value "
                    "overrides for every variant.")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, from {', '.join(VARIANTS)} (default: %(default)s)")
    p.add_argument("--out", default="runs/compare", help="output directory, the only one written (default: %(default)s)")
    p.add_argument("--steps", type=int, default=None, help="train.num_steps for every variant")
    p.add_argument("--stress", action="store_true",
                   help=f"{STRESS_MINIBATCHES} minibatches per rollout (more off-policy) and {STRESS_LR_MULT:g}x the lr")
    p.add_argument("--seeds", default=None,
                   help="comma-separated seeds (train.seed and generation.seed): every variant runs once per seed "
                        "(same initial model and prompt order; the sampling differs), the table gives mean ± sd "
                        "(default: the job's seeds, one run per variant)")
    p.add_argument("--stress-minibatches", type=int, default=STRESS_MINIBATCHES,
                   help="minibatches per rollout under --stress (default: %(default)s)")
    p.add_argument("--stress-lr-mult", type=float, default=STRESS_LR_MULT,
                   help="learning-rate multiplier under --stress (default: %(default)s)")
    p.add_argument("--nproc-per-node", type=int, default=1, help="> 1: each run under torchrun")
    p.add_argument("--docs-dir", default=None, metavar="DIR",
                   help="also copy the generated tables and plots into DIR/comparison.md (between its "
                        "<!-- compare:KIND:begin/end --> markers) and DIR/img/comparison_*.png, e.g. --docs-dir docs")
    p.add_argument("--section", default=None, metavar="NAME",
                   help="the docs section (<!-- compare:NAME:begin/end -->) and image prefix this run fills with "
                        "--docs-dir (default: default, stress or stress_<mb>mb_lr<x>x from the stress knobs); "
                        "letters, digits, _ and - only")
    p.add_argument("--no-probe", action="store_true", help="skip the per-update routing-volatility probe")
    p.add_argument("--probe-rows", type=int, default=64, help="sequences of the first rollout in the probe batch")
    p.add_argument("--threads", type=int, default=None,
                   help="OMP_NUM_THREADS of each run (default: the environment's, else 1 without a GPU: torch's "
                        "intra-op threads oversubscribe a shared CPU badly)")
    p.add_argument("--variant-override", action="append", default=[], metavar="VARIANT:key=value",
                   help="an override for one variant only (repeatable)")
    p.add_argument("--in-process", action="store_true",
                   help="run the variants in this process (parallel.destroy() between runs) instead of fresh "
                        "processes: faster start, less isolation (tests)")
    p.add_argument("--fresh-init", action="store_true", help="build the initial model even if the job sets checkpoint.load")
    p.add_argument("--report-only", action="store_true", help="only rebuild plots/tables (and --docs-dir) from --out")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args, rest = p.parse_known_args(argv)
    if "--docs" in rest:
        p.error("--docs is now --docs-dir DIR: the command writes only into --out unless told where the docs are "
                "(from the repository root: --docs-dir docs)")
    bad = [r for r in rest if r.startswith("--")]
    if bad:
        p.error(f"unknown option(s) {bad}; job overrides are written section.key=value")
    config = None
    if rest and "=" not in rest[0]:
        config = rest.pop(0)
    args.config = os.path.abspath(config) if config else None
    args.overrides = rest
    raw_variants, args.variants = args.variants, [v.strip() for v in args.variants.split(",") if v.strip()]
    if args.section is not None and not re.fullmatch(r"[A-Za-z0-9_-]+", args.section):
        p.error(f"--section {args.section!r}: letters, digits, _ and - only (it names a docs marker and image files)")
    try:
        args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()] if args.seeds else None
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    if not args.variants:
        p.error(f"--variants {raw_variants!r} names no variant; give a comma-separated list from {', '.join(VARIANTS)}")
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; valid: {', '.join(VARIANTS)}")
    _check_variant_overrides(p, args.variant_override, args.variants)
    if args.threads is None and "OMP_NUM_THREADS" not in os.environ:
        from megatron_gspo.config import ParallelConfig
        from megatron_gspo.runtime.parallel import resolve_device

        # CPU workers share the machine's cores: one thread each (the runs' own device decision, with
        # parallel.device as the overrides set it)
        device = next((o.split("=", 1)[1] for o in rest if o.lstrip("-").startswith("parallel.device=")), "auto")
        args.threads = None if resolve_device(ParallelConfig(device=device)).type == "cuda" else 1
    args.argv = argv
    return args


def _check_variant_overrides(p, overrides: list[str], variants: list[str]) -> None:
    """Each --variant-override is VARIANT:section.key=value for a variant this comparison runs (one for a
    variant left out would be ignored without a word)."""
    for item in overrides:
        name, sep, kv = item.partition(":")
        if not sep or "=" not in kv:
            p.error(f"--variant-override {item!r}: write VARIANT:section.key=value, e.g. grpo:optimizer.lr=1e-6")
        if name not in variants:
            p.error(f"--variant-override {item!r}: variant {name!r} is not run by this comparison "
                    f"(--variants {','.join(variants)}); add it to --variants or drop the override")


def check_outputs(args) -> None:
    """--out and --docs-dir writable before any work (runtime/writable.py: the real cause); ConfigError."""
    from megatron_gspo.errors import ConfigError
    from megatron_gspo.runtime.writable import check_writable

    check_writable(args.out, f"--out {args.out}", error=ConfigError)
    if args.docs_dir:
        check_writable(args.docs_dir, f"--docs-dir {args.docs_dir}", error=ConfigError)


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_worker":
        from experiments.compare.worker import worker_main

        return worker_main(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if threading.current_thread() is threading.main_thread():
        # SIGTERM -> SystemExit, so the running child process is terminated too (run.run_subprocess)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args = parse_args(argv)
    from megatron_gspo.errors import USER_ERRORS

    try:
        check_outputs(args)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from experiments.compare.report import report

    if args.report_only:
        report(os.path.abspath(args.out), docs_dir=args.docs_dir)
        return 0
    from megatron_gspo.train import DEMO_CONFIG

    from experiments.compare.run import run_comparison

    args.config = args.config or DEMO_CONFIG
    try:  # every variant's config is validated before anything runs: a mistake is one line, exit 2
        overrides = build_overrides(args.config, args.overrides, steps=args.steps, stress=args.stress,
                                    stress_minibatches=args.stress_minibatches, stress_lr_mult=args.stress_lr_mult)
        meta = run_comparison(args, overrides)
    except USER_ERRORS as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    res = report(os.path.abspath(args.out), docs_dir=args.docs_dir)
    print(f"[compare] {len(meta['variants'])} variants in {meta['total_wall_s'] / 60:.1f} min; summary: {res['summary']}"
          + (f"; docs: {res['docs']}" if "docs" in res else ""), flush=True)
    failed = {v: r["rc"] for v, r in meta["runs"].items() if r["rc"] != 0}
    if failed:
        print(f"[compare] runs that did not finish: {failed}", file=sys.stderr)
        return 1
    return 0
