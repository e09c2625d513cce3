"""Orchestration: the shared initial model once, then every variant (x seed), each in a fresh process.

    1. validate the job (its config plus the overrides) for every variant before running anything;
    2. build the initial model ONCE (worker ``--save-init``): the SFT warm start when
       ``train.sft_steps > 0``, else the seeded initialization (or the job's ``checkpoint.load``),
       saved to ``OUT/init_checkpoint``;
    3. run each variant (and seed) from it (``checkpoint.load=OUT/init_checkpoint train.sft_steps=0``):
       ``python -m experiments.compare _worker``, under torchrun with ``--nproc-per-node`` > 1, or in
       this process with ``--in-process``; every run writes ``OUT/<variant>[/seed_<s>]/``;
    4. write ``OUT/compare.json``: the command, machine, overrides, seeds and wall times the report reads.

Every variant starts from the same weights and sees the same prompts in the same order (data.seed);
``--seeds`` varies train.seed and generation.seed, i.e. the sampled responses.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import logging
import os
import shlex
import shutil
import subprocess
import sys
import time
from typing import Optional

from experiments.compare._shared import machine_info
from experiments.compare.variants import variant_overrides

INIT_DIR = "init_checkpoint"
# The directory holding the `experiments` package: the workers import it from there, whatever the
# caller's working directory (relative paths in the job's overrides stay the caller's).
SOURCE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
WORKER = ["-m", "experiments.compare", "_worker"]


def run_comparison(args, overrides: list[str]) -> dict:
    """Run every variant of ``args`` (cli.parse_args) with the job ``overrides``; -> the metadata
    also written to ``OUT/compare.json``."""
    from megatron_gspo.config.losses import describe_loss
    from megatron_gspo.config import load_job_config

    out = os.path.abspath(args.out)
    if args.in_process and args.nproc_per_node > 1:
        raise SystemExit("--in-process runs one rank; use subprocesses (the default) with --nproc-per-node > 1")
    extra: dict[str, list[str]] = {}
    for item in args.variant_override:
        name, _, kv = item.partition(":")
        extra.setdefault(name, []).append(kv)
    # 1. validate every variant before running anything
    cfgs = {v: load_job_config(args.config, overrides + variant_overrides(v, extra)) for v in args.variants}
    base = load_job_config(args.config, overrides)
    # only now: a comparison refused above (--steps 0, a typo in an override) leaves no --out behind
    os.makedirs(out, exist_ok=True)
    meta = _metadata(args, overrides, extra, base)
    launch = _launcher(args)
    t_all = time.perf_counter()
    # 2. the initial model, once
    if base.train.sft_steps == 0 and base.checkpoint.load and not args.fresh_init:
        init = base.checkpoint.load
        meta["init"] = {"path": init, "how": "checkpoint.load of the job"}
    else:
        init = os.path.join(out, INIT_DIR)
        shutil.rmtree(init, ignore_errors=True)
        wargs = ["--save-init", init, args.config, *overrides, f"train.output_dir={os.path.join(out, 'init')}"]
        rc, wall = launch(wargs, os.path.join(out, "init.log"), "init")
        if rc != 0:
            raise SystemExit(f"building the initial model failed (rc={rc}); see {os.path.join(out, 'init.log')}")
        meta["init"] = {"path": init, "how": f"SFT warm start ({base.train.sft_steps} steps)" if base.train.sft_steps
                        else "seeded initialization", "wall_s": wall}
    # 3. the variants (x seeds): the seeds vary the RL sampling; the initial model and the prompt
    #    order (data.seed) are shared. Seed by seed, every variant in turn, compare.json rewritten after
    #    each run: a comparison cut short (a time budget, a killed job) has whole seeds of every variant
    #    and reports them (--report-only).
    seeds = args.seeds or [None]
    for v in args.variants:
        shutil.rmtree(os.path.join(out, v), ignore_errors=True)  # metrics.jsonl appends: never mix two runs
    entries_of: dict[str, list[dict]] = {v: [] for v in args.variants}
    for seed in seeds:
        for v in args.variants:
            entries = entries_of[v]
            rel = v if seed is None else os.path.join(v, f"seed_{seed}")
            vdir = os.path.join(out, rel)
            # train.seed: the trainer's torch/numpy/python RNG; generation.seed: the sampling stream
            seeded = [] if seed is None else [f"train.seed={seed}", f"generation.seed={seed}"]
            run_over = overrides + variant_overrides(v, extra) + seeded + [
                f"train.output_dir={vdir}", f"checkpoint.load={init}", "train.sft_steps=0", "checkpoint.resume=false",
                "checkpoint.save=null", "checkpoint.save_interval=0"]
            probe = [] if args.no_probe else ["--probe", os.path.join(vdir, "probe.jsonl"),
                                              "--probe-rows", str(args.probe_rows)]
            print(f"[compare] {v}{'' if seed is None else f' seed {seed}'}: {cfgs[v].loss.name}, "
                  f"{describe_loss(cfgs[v].loss)}, routing replay {cfgs[v].train.routing_replay}", flush=True)
            tag = v if seed is None else f"{v}/{seed}"
            rc, wall = launch(probe + [args.config, *run_over], os.path.join(vdir, "train.log"), tag)
            entries.append({"seed": base.generation.seed if seed is None else seed, "dir": rel, "rc": rc,
                            "wall_s": wall, "overrides": run_over})
            meta["runs"][v] = {"rc": next((e["rc"] for e in entries if e["rc"] != 0), 0),
                               "wall_s": sum(e["wall_s"] for e in entries), "seeds": entries}
            meta["total_wall_s"] = time.perf_counter() - t_all
            _write_meta(out, meta)
    meta["complete"] = True
    _write_meta(out, meta)
    return meta


def _write_meta(out: str, meta: dict) -> None:
    tmp = os.path.join(out, "compare.json.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    os.replace(tmp, os.path.join(out, "compare.json"))


def _metadata(args, overrides: list[str], extra: dict, base) -> dict:
    """What the report states about the comparison: command, machine, job, seeds (compare.json)."""
    import megatron_gspo

    config = args.config
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(megatron_gspo.__file__)))
    if config.startswith(package_root + os.sep):  # a packaged job: shown as megatron_gspo/configs/...
        config = os.path.relpath(config, package_root)
    m = base.model
    return {
        "command": "python -m experiments.compare " + shlex.join(args.argv),
        "config": config, "overrides": overrides, "variants": args.variants, "variant_overrides": extra,
        "stress": args.stress, "stress_minibatches": args.stress_minibatches if args.stress else None,
        "stress_lr_mult": args.stress_lr_mult if args.stress else None, "section": getattr(args, "section", None),
        "nproc_per_node": args.nproc_per_node, "probe": not args.no_probe, "probe_rows": args.probe_rows,
        # --threads, else what the environment set for every run
        "threads": args.threads or (os.environ.get("OMP_NUM_THREADS") and f"{os.environ['OMP_NUM_THREADS']} "
                                                                          "(OMP_NUM_THREADS)"),
        "in_process": args.in_process, "machine": machine_info(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "seeds": args.seeds or [base.generation.seed], "num_steps": base.train.num_steps,
        "sft_steps": base.train.sft_steps, "num_minibatches": base.train.num_minibatches, "lr": base.optimizer.lr,
        "rollout": f"{base.train.prompts_per_step} prompts x {base.generation.n_samples_per_prompt} samples",
        "model": f"{m.preset or 'custom'}: {m.num_layers} layers, {m.num_moe_experts} experts top-{m.moe_router_topk}, "
                 f"hidden {m.hidden_size}",
        "runs": {}, "complete": False,  # True once every run has ended (compare.json is rewritten after each)
    }


def _launcher(args):
    """-> launch(worker args, log path, tag) -> (rc, wall seconds): in this process, or a fresh one."""
    if args.in_process:
        return lambda wargs, log_path, tag: run_in_process(wargs, log_path, args.threads, tag)
    cmd = [sys.executable, *WORKER]
    if args.nproc_per_node > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
               str(args.nproc_per_node), *WORKER]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore",
           "PYTHONPATH": os.pathsep.join(p for p in (SOURCE_ROOT, os.environ.get("PYTHONPATH")) if p)}
    if args.threads is not None:
        env["OMP_NUM_THREADS"] = str(args.threads)
    return lambda wargs, log_path, tag: run_subprocess(cmd + wargs, log_path, env, tag, args.quiet)


def run_subprocess(cmd: list[str], log_path: str, env: dict, tag: str, quiet: bool) -> tuple[int, float]:
    """Run ``cmd``, its output to ``log_path`` (and progress lines to stdout). -> (rc, wall seconds)."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env, bufsize=1)
        tail: list[str] = []
        try:
            for line in proc.stdout:
                f.write(line)
                tail = (tail + [line])[-40:]
                if not quiet and (" step " in line or "ERROR" in line or "Error" in line or "saved" in line):
                    print(f"[{tag}] {line.rstrip()}", flush=True)
            rc = proc.wait()
        except BaseException:  # Ctrl-C / SIGTERM of the comparison: do not leave the run behind
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
            raise
    if rc != 0:
        print(f"[{tag}] FAILED rc={rc}; last lines of {log_path}:\n" + "".join(tail[-20:]), file=sys.stderr, flush=True)
    return rc, time.perf_counter() - t0


def run_in_process(wargs: list[str], log_path: str, threads: Optional[int], tag: str) -> tuple[int, float]:
    """``--in-process``: the worker in this process (run_trainer destroys the process groups after
    each run). Faster to start (one import of torch and megatron), used by the tests; subprocesses
    isolate runs better."""
    import traceback

    import torch

    from experiments.compare.worker import worker_main

    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    prev_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as f, contextlib.redirect_stdout(f):
        print("$ (in process) python -m experiments.compare _worker " + shlex.join(wargs), flush=True)
        try:
            rc = worker_main(wargs)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:  # a failed run is a result of the comparison, not a crash of it
            traceback.print_exc(file=f)
            rc = 1
            with contextlib.suppress(Exception):
                from megatron_gspo.runtime import parallel

                parallel.destroy()
    # the worker pointed logging at the (now closed) log file
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    torch.set_num_threads(prev_threads)
    if rc != 0:
        print(f"[{tag}] FAILED rc={rc}; see {log_path}", file=sys.stderr, flush=True)
    return rc, time.perf_counter() - t0
