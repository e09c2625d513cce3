"""GSPO vs GSPO-token vs GRPO vs GRPO + routing replay, side by side, reproducibly.

    python -m megatron_gspo.compare [config.yaml] [section.key=value ...]
        [--variants gspo,gspo_token,grpo,grpo_r2] [--out DIR] [--steps N] [--seeds 1234,1,2]
        [--stress [--stress-minibatches 8] [--stress-lr-mult 2]] [--nproc-per-node N] [--docs]
        [--no-probe] [--probe-rows 64] [--threads N] [--in-process] [--report-only]

What it does, in order:
  1. validates the job (the config, or the packaged demo job, plus the overrides) for every variant;
  2. builds the initial model ONCE -- the SFT warm start when ``train.sft_steps > 0``, otherwise
     the seeded initialization (or ``checkpoint.load``) -- and saves it with
     ``checkpoint.save_model`` to ``OUT/init_checkpoint``;
  3. runs every variant in a fresh process (``python -m megatron_gspo.compare _worker ...``, a thin
     wrapper of ``megatron_gspo.train``'s Trainer, or torchrun with ``--nproc-per-node`` > 1) with
     ``checkpoint.load=OUT/init_checkpoint train.sft_steps=0`` and the job's seeds (or each of
     ``--seeds``: train.seed and generation.seed), so every variant starts from the same weights and
     sees the same prompts in the same order;
  4. writes ``OUT/<variant>/{metrics.jsonl,tensorboard/,probe.jsonl,train.log}`` (``tensorboard
     --logdir OUT`` shows the runs side by side), PNG plots in ``OUT/plots/`` and a markdown table in
     ``OUT/summary.md`` (``OUT/summary.json`` for programs); with ``--docs`` also
     ``docs/comparison.md`` and ``docs/img/comparison_*.png``.

Variants (``VARIANTS``): ``gspo`` (loss.name=gspo), ``gspo_token`` (loss.name=gspo_token; same
gradient as gspo for per-sequence advantages), ``grpo`` (token-level PPO clip, default 0.2 / 0.2,
no routing replay), ``grpo_r2`` (grpo + ``train.routing_replay=R2``), and ``grpo_r3`` (opt-in).
Each variant uses its loss's default clip range (GSPO 3e-4 / 4e-4, GRPO 0.2 / 0.2): the job's own
clip settings are reset, since a GSPO range is meaningless for GRPO and vice versa. Per-variant
settings: ``--variant-override grpo:loss.clip_ratio_high=0.28``.

Routing volatility. Two different quantities are reported (docs/comparison.md explains them):
  * ``routing/routing_change_frac`` (logged by the trainer): share of (token, expert) choices of
    the old-log-prob pass that the training forward of the same micro-batch does not make. The
    first minibatch of a rollout is trained before any update (change 0), minibatch k after k
    updates, so it is an average over 0..num_minibatches-1 updates. Under routing replay the
    training forward *uses* the recorded routes: exactly 0.
  * the probe (``probe/*``, this module): after every optimizer update, one extra forward (no
    grad) of a fixed probe batch -- the first ``--probe-rows`` sequences of the first rollout --
    with the router free (replay is only active inside the trainer's training forward), compared
    with the same forward before the update: the share of (token, expert) choices and the share of
    tokens whose top-k expert set changed in one update, per layer, and the drift since the
    initial model. This is the paper's "~10% of the activated experts change per update" number;
    replay does not change it (it hides the drift from the loss, it does not stop it).

``--stress`` makes off-policy effects visible on small models: ``train.num_minibatches`` 8 (the
last minibatch is 7 updates stale) and the learning rate x 2 (``--stress-minibatches``, ``--stress-lr-mult``).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import logging
import math
import os
import platform
import re
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from typing import Optional

log = logging.getLogger("megatron_gspo")

# ----------------------------------------------------------------------------------------------
# Variants
# ----------------------------------------------------------------------------------------------
# Applied after the job's own overrides. Clip ranges are reset to the loss's defaults (see above).
_RESET_CLIP = ["loss.clip_ratio_low=null", "loss.clip_ratio_high=null"]
# Quoted: overrides are parsed as YAML scalars, and YAML 1.1 reads a bare `off` as the boolean false.
_REPLAY_OFF = "train.routing_replay='off'"
VARIANTS: dict[str, dict] = {
    "gspo": dict(overrides=["loss.name=gspo", _REPLAY_OFF, *_RESET_CLIP],
                 label="GSPO", clip_unit="sequences"),
    "gspo_token": dict(overrides=["loss.name=gspo_token", _REPLAY_OFF, *_RESET_CLIP],
                       label="GSPO-token", clip_unit="sequences"),
    "grpo": dict(overrides=["loss.name=grpo", _REPLAY_OFF, *_RESET_CLIP],
                 label="GRPO", clip_unit="tokens"),
    "grpo_r2": dict(overrides=["loss.name=grpo", "train.routing_replay=R2", *_RESET_CLIP],
                    label="GRPO + R2 replay", clip_unit="tokens"),
    "grpo_r3": dict(overrides=["loss.name=grpo", "train.routing_replay=R3", *_RESET_CLIP],
                    label="GRPO + R3 replay", clip_unit="tokens"),
}
DEFAULT_VARIANTS = ("gspo", "gspo_token", "grpo", "grpo_r2")
STYLE = {  # colour, line style: gspo_token is dashed because it lies on top of gspo
    "gspo": ("tab:blue", "-"), "gspo_token": ("tab:cyan", "--"), "grpo": ("tab:red", "-"),
    "grpo_r2": ("tab:orange", "-"), "grpo_r3": ("tab:purple", "-"),
}
STRESS_MINIBATCHES = 8
STRESS_LR_MULT = 2.0
INIT_DIR = "init_checkpoint"
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ----------------------------------------------------------------------------------------------
# Routing-volatility probe (runs inside the worker process)
# ----------------------------------------------------------------------------------------------


class RoutingProbe:
    """Routing change per optimizer update on a fixed probe batch, with the router running free.

    The probe batch is the first ``rows`` sequences of the first rollout (this rank's share); its
    routes are taken once before the first update and again after every applied update (the
    trainer steps the LR scheduler exactly when an update was applied). Only the positions the
    training forward reads are counted: prompt and response tokens, not right padding.
    Rows written to ``path`` (rank 0), one per update: the share of (token, expert) choices that
    changed (``change_frac``, RoutingMonitor's measure), the share of tokens whose top-k expert
    *set* changed (``token_change_frac``), both per layer, and the same against the initial model.
    """

    def __init__(self, trainer, path: str, rows: int = 64):
        from megatron_gspo.routing import RoutingMonitor

        self.trainer = trainer
        self.path = path
        self.rows = rows
        self.monitor = RoutingMonitor(trainer.ddp, aux_loss=False)
        self.tokens = None
        self.valid: Optional[list] = None  # per probe micro-batch: [T_router] bool, router layout
        self.init_routes = None
        self.prev_routes = None
        self.updates = 0
        self.file = None
        self.tb = None
        self._step_rows: list[dict] = []
        self._step = None

    # -- batch and routes -----------------------------------------------------------------------
    def set_batch(self, batch) -> None:
        import torch

        if self.tokens is not None:
            return
        n = min(self.rows, batch.num_rows)
        self.tokens = batch.tokens[:n]
        mask = batch.mask[:n]  # [n, T-1] response targets
        # input position j is read by the loss iff j <= the last response target (prompt + response)
        valid = mask.flip(-1).cumsum(-1).flip(-1) > 0
        st = self.trainer.state
        mbs = self.trainer.cfg.train.micro_batch_size
        self.valid = []
        for lo in range(0, n, mbs):
            v = valid[lo:lo + mbs].transpose(0, 1)  # [s, b]: the router's sequence-major layout
            if st.sequence_parallel and st.tp > 1:
                c = v.shape[0] // st.tp
                v = v[st.tp_rank * c:(st.tp_rank + 1) * c]
            self.valid.append(v.reshape(-1))
        self.valid = torch.cat(self.valid)
        self.init_routes = self.prev_routes = self._routes()

    def _routes(self):
        import torch

        from megatron_gspo.model import forward_logits

        mbs = self.trainer.cfg.train.micro_batch_size
        tag = ("probe", self.updates)
        with torch.no_grad(), self.monitor.capture(tag, store=True):
            for lo in range(0, self.tokens.shape[0], mbs):
                forward_logits(self.trainer.ddp, self.tokens[lo:lo + mbs, :-1])
        routes = [r[self.valid.to(r.device)].long() for r in self.monitor.routes(tag)]
        self.monitor.drop(tag)
        return routes

    def _compare(self, ref, cur) -> dict:
        import torch

        from megatron_gspo import comm
        from megatron_gspo.routing import change_counts

        E = self.monitor.num_experts
        counts = torch.zeros(len(ref), 4, dtype=torch.float64, device=ref[0].device)  # changed, compared, tok changed, tokens
        for l, (a, b) in enumerate(zip(ref, cur)):
            changed, compared = change_counts(a, b, E)
            tok = (a.sort(dim=1).values != b.sort(dim=1).values).any(dim=1)
            counts[l] = torch.tensor([float(changed), float(compared), float(tok.sum()), float(tok.numel())])
        # TP ranks without sequence parallel see the same tokens: duplicates scale both sums
        comm.all_reduce(counts, "sum", None, what="comparison probe: routing change counts")
        frac = lambda num, den: float(num / den) if den > 0 else math.nan  # noqa: E731
        slots = self.monitor.slots
        out = {"change_frac": frac(counts[:, 0].sum(), counts[:, 1].sum()),
               "token_change_frac": frac(counts[:, 2].sum(), counts[:, 3].sum()),
               "tokens": float(counts[:, 3].sum() / max(1, len(ref)))}
        out["layers"] = {str(slots[l]): {"change_frac": frac(counts[l, 0], counts[l, 1]),
                                         "token_change_frac": frac(counts[l, 2], counts[l, 3])}
                         for l in range(len(ref))}
        return out

    def after_update(self) -> None:
        if self.prev_routes is None:
            return
        self.updates += 1
        cur = self._routes()
        row = {"step": self.trainer.step + 1, "update": self.updates}
        row.update(self._compare(self.prev_routes, cur))
        vs = self._compare(self.init_routes, cur)
        row["vs_init"] = {"change_frac": vs["change_frac"], "token_change_frac": vs["token_change_frac"],
                          "layers": vs["layers"]}
        self.prev_routes = cur
        self._write(row)

    # -- output -------------------------------------------------------------------------------
    def _write(self, row: dict) -> None:
        if not self.trainer.state.is_main:
            return
        if self.file is None:
            os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
            self.file = open(self.path, "a", encoding="utf-8")
        self.file.write(json.dumps(row) + "\n")
        self.file.flush()
        if self._step is not None and row["step"] != self._step:
            self._flush_tb()
        self._step = row["step"]
        self._step_rows.append(row)

    def _flush_tb(self) -> None:
        """Per RL step (the trainer's x axis): mean over the step's updates, into the run's tensorboard."""
        rows, self._step_rows = self._step_rows, []
        if not rows or not self.trainer.cfg.train.tensorboard:
            return
        if self.tb is None:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(os.path.join(self.trainer.cfg.train.output_dir, "tensorboard"),
                                    filename_suffix=".probe")
        step = rows[0]["step"]
        mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
        self.tb.add_scalar("probe/routing_change_per_update", mean([r["change_frac"] for r in rows]), step)
        self.tb.add_scalar("probe/token_change_per_update", mean([r["token_change_frac"] for r in rows]), step)
        self.tb.add_scalar("probe/routing_change_vs_init", rows[-1]["vs_init"]["change_frac"], step)
        for layer in rows[0]["layers"]:
            vals = [r["layers"][layer]["change_frac"] for r in rows]
            self.tb.add_scalar(f"probe/routing_change_per_update/layer_{layer}", mean(vals), step)
        self.tb.flush()

    def close(self) -> None:
        self._flush_tb()
        self.monitor.close()
        if self.tb is not None:
            self.tb.close()
        if self.file is not None:
            self.file.close()


def _probed_trainer(cfg, probe_path: str, probe_rows: int):
    """A Trainer (megatron_gspo.train, unchanged) with the routing probe attached: the first
    rollout gives the probe batch, the scheduler step (taken only after an applied update) runs it."""
    from megatron_gspo.train import Trainer

    class ProbedTrainer(Trainer):
        def __init__(self, cfg):
            super().__init__(cfg)
            self.probe = RoutingProbe(self, probe_path, probe_rows)

        def setup_optimizer(self) -> None:
            super().setup_optimizer()
            step = self.scheduler.step

            def step_and_probe(*args, **kwargs):
                out = step(*args, **kwargs)
                self.probe.after_update()
                return out

            self.scheduler.step = step_and_probe

        def rollout(self):
            batch = super().rollout()
            self.probe.set_batch(batch)  # first rollout only; before any update of this run
            return batch

    return ProbedTrainer(cfg)


def worker_main(argv: list[str]) -> int:
    """``python -m megatron_gspo.compare _worker [--probe PATH] [--probe-rows N] [--save-init DIR]
    config.yaml [overrides]``: one run of the comparison, as ``megatron_gspo.train.main`` does it."""
    from megatron_gspo import parallel, train
    from megatron_gspo.config import load_job_config
    from megatron_gspo.train import Trainer

    p = argparse.ArgumentParser(prog="megatron_gspo.compare _worker")
    p.add_argument("--probe", default=None)
    p.add_argument("--probe-rows", type=int, default=64)
    p.add_argument("--save-init", default=None)
    p.add_argument("config")
    args, overrides = p.parse_known_args(argv)
    cfg = load_job_config(args.config, overrides)
    if args.save_init:
        from megatron_gspo.checkpoint import save_model
        from megatron_gspo.sft import sft_warm_start

        trainer = Trainer(cfg)
        try:
            if cfg.train.sft_steps > 0:
                sft_warm_start(trainer)
            save_model(trainer.ddp, args.save_init)
            log.info("initial model saved to %s (SFT steps: %d)", args.save_init, cfg.train.sft_steps)
        finally:
            trainer.logger.close()
            parallel.destroy()
        return 0
    trainer = _probed_trainer(cfg, args.probe, args.probe_rows) if args.probe else Trainer(cfg)
    return train.run_trainer(trainer, on_exit=trainer.probe.close if args.probe else None)


# ----------------------------------------------------------------------------------------------
# Orchestration
# ----------------------------------------------------------------------------------------------


def _machine() -> dict:
    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count()}
    try:
        from importlib.metadata import version

        info["megatron_core"] = version("megatron-core")
    except Exception:  # pragma: no cover - metadata missing
        pass
    if torch.cuda.is_available():
        info["gpus"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}"
    else:
        info["gpus"] = "none (CPU)"
        try:
            with open("/proc/cpuinfo", encoding="utf-8") as f:
                names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
            if names:
                info["cpu_model"] = names[0]
        except OSError:
            pass
    with contextlib.suppress(OSError):
        info["load_avg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    return info


def _launcher(nproc: int) -> list[str]:
    if nproc > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
                "-m", "megatron_gspo.compare", "_worker"]
    return [sys.executable, "-m", "megatron_gspo.compare", "_worker"]


def _run(cmd: list[str], log_path: str, env: dict, tag: str, quiet: bool) -> tuple[int, float]:
    """Run ``cmd``, its output to ``log_path`` (and progress lines to stdout). -> (rc, wall seconds)."""
    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as f:
        f.write("$ " + shlex.join(cmd) + "\n")
        f.flush()
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                                cwd=REPO_ROOT, bufsize=1)
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


def _run_in_process(wargs: list[str], log_path: str, threads: Optional[int], tag: str) -> tuple[int, float]:
    """``--in-process``: the worker in this process (parallel.destroy() between runs). Faster to start
    (one import of torch and megatron), used by the tests; subprocesses isolate runs better."""
    import traceback

    import torch

    os.makedirs(os.path.dirname(log_path), exist_ok=True)
    prev_threads = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    t0 = time.perf_counter()
    with open(log_path, "w", encoding="utf-8") as f, contextlib.redirect_stdout(f):
        print("$ (in process) megatron_gspo.compare _worker " + shlex.join(wargs), flush=True)
        try:
            rc = worker_main(wargs)
        except SystemExit as e:
            rc = e.code if isinstance(e.code, int) else 1
        except Exception:  # a failed run is a result of the comparison, not a crash of it
            traceback.print_exc(file=f)
            rc = 1
            with contextlib.suppress(Exception):
                from megatron_gspo import parallel

                parallel.destroy()
    # the trainer pointed logging at the (now closed) log file
    logging.basicConfig(level=logging.INFO, format="%(message)s", stream=sys.stdout, force=True)
    torch.set_num_threads(prev_threads)
    if rc != 0:
        print(f"[{tag}] FAILED rc={rc}; see {log_path}", file=sys.stderr, flush=True)
    return rc, time.perf_counter() - t0


def _env(threads: Optional[int]) -> dict:
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONWARNINGS": "ignore"}
    if threads is not None:
        env["OMP_NUM_THREADS"] = str(threads)
    return env


def build_overrides(path: str, user: list[str], *, steps: Optional[int], stress: bool,
                    stress_minibatches: int = STRESS_MINIBATCHES, stress_lr_mult: float = STRESS_LR_MULT) -> list[str]:
    """The job's overrides for every variant: the user's, then --steps and --stress."""
    from megatron_gspo.config import load_job_config

    out = list(user)
    if steps is not None:
        out.append(f"train.num_steps={steps}")
    if stress:
        base = load_job_config(path, out)
        rows = base.train.prompts_per_step * base.generation.n_samples_per_prompt
        n_mb = stress_minibatches
        while rows % n_mb:  # largest divisor of the rollout <= the requested count
            n_mb -= 1
        out += [f"train.num_minibatches={n_mb}", f"optimizer.lr={base.optimizer.lr * stress_lr_mult:g}"]
    return out


def variant_overrides(name: str, extra: dict[str, list[str]]) -> list[str]:
    if name not in VARIANTS:
        raise SystemExit(f"unknown variant {name!r}; valid: {', '.join(VARIANTS)}")
    return VARIANTS[name]["overrides"] + extra.get(name, [])


def run_comparison(args, overrides: list[str]) -> dict:
    from megatron_gspo.config import load_job_config

    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    variants = args.variants
    extra: dict[str, list[str]] = {}
    for item in args.variant_override:
        name, _, kv = item.partition(":")
        extra.setdefault(name, []).append(kv)
    # 1. validate every variant before running anything
    cfgs = {v: load_job_config(args.config, overrides + variant_overrides(v, extra)) for v in variants}
    base = load_job_config(args.config, overrides)
    meta = {
        "command": "python -m megatron_gspo.compare " + shlex.join(args.argv),
        "config": os.path.relpath(args.config, REPO_ROOT) if args.config.startswith(REPO_ROOT) else args.config,
        "overrides": overrides, "variants": variants, "variant_overrides": extra, "stress": args.stress,
        "stress_minibatches": args.stress_minibatches if args.stress else None,
        "stress_lr_mult": args.stress_lr_mult if args.stress else None,
        "nproc_per_node": args.nproc_per_node, "probe": not args.no_probe, "probe_rows": args.probe_rows,
        "threads": args.threads, "in_process": args.in_process, "machine": _machine(),
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "seeds": args.seeds or [base.generation.seed], "num_steps": base.train.num_steps, "sft_steps": base.train.sft_steps,
        "num_minibatches": base.train.num_minibatches, "lr": base.optimizer.lr,
        "rollout": f"{base.train.prompts_per_step} prompts x {base.generation.n_samples_per_prompt} samples",
        "model": f"{base.model.preset or 'custom'}: {base.model.num_layers} layers, {base.model.num_moe_experts} "
                 f"experts top-{base.model.moe_router_topk}, hidden {base.model.hidden_size}",
        "runs": {},
    }
    env = _env(args.threads)
    launcher = _launcher(args.nproc_per_node)
    if args.in_process and args.nproc_per_node > 1:
        raise SystemExit("--in-process runs one rank; use subprocesses (the default) with --nproc-per-node > 1")

    def run(wargs: list[str], log_path: str, tag: str) -> tuple[int, float]:
        if args.in_process:
            return _run_in_process(wargs, log_path, args.threads, tag)
        return _run(launcher + wargs, log_path, env, tag, args.quiet)
    t_all = time.perf_counter()
    # 2. the initial model, once
    if base.train.sft_steps == 0 and base.checkpoint.load and not args.fresh_init:
        init = base.checkpoint.load
        meta["init"] = {"path": init, "how": "checkpoint.load of the job"}
    else:
        init = os.path.join(out, INIT_DIR)
        shutil.rmtree(init, ignore_errors=True)
        wargs = ["--save-init", init, args.config, *overrides, f"train.output_dir={os.path.join(out, 'init')}"]
        rc, wall = run(wargs, os.path.join(out, "init.log"), "init")
        if rc != 0:
            raise SystemExit(f"building the initial model failed (rc={rc}); see {os.path.join(out, 'init.log')}")
        meta["init"] = {"path": init, "how": f"SFT warm start ({base.train.sft_steps} steps)" if base.train.sft_steps
                        else "seeded initialization", "wall_s": wall}
    # 3. the variants (x seeds): the seeds vary the RL sampling; the initial model and the prompt
    #    order (data.seed) are shared
    seeds = args.seeds or [None]
    for v in variants:
        shutil.rmtree(os.path.join(out, v), ignore_errors=True)  # metrics.jsonl appends: never mix two runs
        entries = []
        for seed in seeds:
            rel = v if seed is None else os.path.join(v, f"seed_{seed}")
            vdir = os.path.join(out, rel)
            # train.seed: the trainer's torch/numpy/python RNG; generation.seed: the sampling stream
            seeded = [] if seed is None else [f"train.seed={seed}", f"generation.seed={seed}"]
            run_over = overrides + variant_overrides(v, extra) + seeded + [
                f"train.output_dir={vdir}", f"checkpoint.load={init}", "train.sft_steps=0", "checkpoint.resume=false",
                "checkpoint.save=null", "checkpoint.save_interval=0"]
            probe = [] if args.no_probe else ["--probe", os.path.join(vdir, "probe.jsonl"),
                                              "--probe-rows", str(args.probe_rows)]
            print(f"[compare] {v}{'' if seed is None else f' seed {seed}'}: {cfgs[v].loss.name}, clip "
                  f"{cfgs[v].loss.clip_range()}, routing replay {cfgs[v].train.routing_replay}", flush=True)
            tag = v if seed is None else f"{v}/{seed}"
            rc, wall = run(probe + [args.config, *run_over], os.path.join(vdir, "train.log"), tag)
            entries.append({"seed": base.generation.seed if seed is None else seed, "dir": rel, "rc": rc, "wall_s": wall,
                            "overrides": run_over})
        meta["runs"][v] = {"rc": next((e["rc"] for e in entries if e["rc"] != 0), 0),
                           "wall_s": sum(e["wall_s"] for e in entries), "seeds": entries}
    meta["total_wall_s"] = time.perf_counter() - t_all
    with open(os.path.join(out, "compare.json"), "w", encoding="utf-8") as f:
        json.dump(meta, f, indent=1)
    return meta


# ----------------------------------------------------------------------------------------------
# Reading results
# ----------------------------------------------------------------------------------------------


def _read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def _mean(xs) -> float:
    xs = [x for x in xs if _finite(x)]
    return sum(xs) / len(xs) if xs else math.nan


def load_runs(out: str, meta: Optional[dict] = None) -> dict[str, list[dict]]:
    """-> {variant: [one dict per seed: seed, rows (metrics.jsonl), probe (probe.jsonl), rc, wall_s]}."""
    meta = meta or {}
    variants = meta.get("variants") or [v for v in VARIANTS if os.path.isdir(os.path.join(out, v))]
    runs: dict[str, list[dict]] = {}
    for v in variants:
        info = meta.get("runs", {}).get(v)
        if info is not None:
            entries = info.get("seeds") or [{"seed": None, "dir": v, "rc": info.get("rc"), "wall_s": info.get("wall_s")}]
        else:  # no metadata: one run in OUT/v, or one per OUT/v/seed_*
            sub = sorted(d for d in os.listdir(os.path.join(out, v)) if d.startswith("seed_")) \
                if os.path.isdir(os.path.join(out, v)) else []
            entries = [{"seed": int(d[5:]), "dir": os.path.join(v, d)} for d in sub] or [{"seed": None, "dir": v}]
        runs[v] = []
        for e in entries:
            d = os.path.join(out, e["dir"])
            runs[v].append({"seed": e.get("seed"), "rows": _read_jsonl(os.path.join(d, "metrics.jsonl")),
                            "probe": _read_jsonl(os.path.join(d, "probe.jsonl")), "rc": e.get("rc"),
                            "wall_s": e.get("wall_s", math.nan)})
    return runs


def _col(rows: list[dict], key: str) -> list[float]:
    return [r.get(key, math.nan) for r in rows]


def _layers(rows: list[dict], prefix: str) -> list[int]:
    ls = set()
    for r in rows:
        for k in r:
            if k.startswith(prefix + "/layer_"):
                ls.add(int(k.rsplit("_", 1)[1]))
    return sorted(ls)


def _probe_per_step(probe: list[dict]) -> dict:
    """Mean over each RL step's updates -> {step: {...}} (per-layer included)."""
    by: dict[int, list[dict]] = {}
    for r in probe:
        by.setdefault(r["step"], []).append(r)
    out = {}
    for s, rs in sorted(by.items()):
        layers = sorted(rs[0]["layers"], key=int)
        out[s] = {"change_frac": _mean([r["change_frac"] for r in rs]),
                  "layers": {int(l): _mean([r["layers"][l]["change_frac"] for r in rs]) for l in layers}}
    return out


def _run_stats(run: dict) -> dict:
    """The summary numbers of one run (one variant, one seed)."""
    rows, probe = run["rows"], run["probe"]
    reward = _col(rows, "rollout/reward_mean")
    k = min(10, len(reward))
    loss, gnorm = _col(rows, "loss/loss"), _col(rows, "train/grad_norm")
    change = _col(rows, "routing/routing_change_frac")
    return {
        "steps": len(rows),
        "final_reward": _mean(reward[-k:]) if k else math.nan,
        "reward_auc": _mean(reward),
        "first_reward": reward[0] if reward else math.nan,
        "gen_tokens": sum(x for x in _col(rows, "perf/gen_tokens") if _finite(x)),
        "clip_frac": _mean(_col(rows, "loss/clip_frac")),
        "clip_frac_low": _mean(_col(rows, "loss/clip_frac_low")),
        "clip_frac_high": _mean(_col(rows, "loss/clip_frac_high")),
        "seq_ratio_spread": _mean([a - b for a, b in zip(_col(rows, "loss/seq_ratio/max"),
                                                           _col(rows, "loss/seq_ratio/min"))]),
        "routing_change": _mean(change),
        "routing_change_max": max([x for x in change if _finite(x)], default=math.nan),
        "routing_change_layers": {l: _mean(_col(rows, f"routing/routing_change_frac/layer_{l}"))
                                  for l in _layers(rows, "routing/routing_change_frac")},
        "probe_change": _mean([r["change_frac"] for r in probe]),
        "probe_token_change": _mean([r["token_change_frac"] for r in probe]),
        "probe_vs_init_final": probe[-1]["vs_init"]["change_frac"] if probe else math.nan,
        "probe_layers": {int(l): _mean([r["layers"][l]["change_frac"] for r in probe])
                         for l in (probe[0]["layers"] if probe else {})},
        "probe_updates": len(probe),
        "skipped_updates": int(sum(x for x in _col(rows, "train/skipped_updates") if _finite(x))),
        "nonfinite_steps": sum(1 for a, b in zip(loss, gnorm) if not (_finite(a) and _finite(b))),
        "grad_norm": _mean(gnorm),
        "entropy_final": _mean(_col(rows, "loss/entropy")[-k:]) if k else math.nan,
        "step_time_s": _mean(_col(rows, "perf/step_time_s")),
        "wall_s": run.get("wall_s", math.nan),
        "rc": run.get("rc"),
    }


def _std(xs) -> float:
    xs = [x for x in xs if _finite(x)]
    if len(xs) < 2:
        return math.nan
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def summarize_runs(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per variant: the numbers of the summary table, averaged over seeds (sums for counts), with
    the seed-to-seed standard deviation of the rewards when there are several seeds."""
    table = {}
    for v, seeds in runs.items():
        per = [_run_stats(r) for r in seeds]
        t: dict = {"label": VARIANTS.get(v, {}).get("label", v), "clip_unit": VARIANTS.get(v, {}).get("clip_unit", "?"),
                   "seeds": [r["seed"] for r in seeds]}
        for key, val in per[0].items():
            vals = [p[key] for p in per]
            if key in ("skipped_updates", "nonfinite_steps", "probe_updates"):
                t[key] = sum(vals)
            elif key == "steps":
                t[key] = min(vals)
            elif key == "rc":
                t[key] = next((x for x in vals if x not in (None, 0)), vals[0])
            elif isinstance(val, dict):
                t[key] = {l: _mean([p[key].get(l, math.nan) for p in per]) for l in val}
            else:
                t[key] = _mean(vals)
        t["final_reward_std"] = _std([p["final_reward"] for p in per])
        t["reward_auc_std"] = _std([p["reward_auc"] for p in per])
        t["per_seed"] = [{"seed": r["seed"], "final_reward": p["final_reward"], "reward_auc": p["reward_auc"],
                          "steps": p["steps"], "rc": p["rc"]} for r, p in zip(seeds, per)]
        table[v] = t
    return table


DIVERGED_REL_GRAD_NORM = 1e-3


def consistency(runs: dict[str, list[dict]]) -> dict:
    """GSPO vs GSPO-token (seed by seed): they differ only in how the same gradient is written, so
    the runs agree to float rounding until a rounding difference flips one sampled token; from then
    on they are two different samples of the same algorithm. The divergence step is the first step
    whose reward or mean response length differs, or whose grad norm differs by more than
    DIVERGED_REL_GRAD_NORM (a different rollout with the same mean reward)."""
    out = {}
    if "gspo" in runs and "gspo_token" in runs:
        pairs = []
        for ra, rb in zip(runs["gspo"], runs["gspo_token"]):
            a, b = ra["rows"], rb["rows"]
            n = min(len(a), len(b))

            def rel_g(x, y):
                return abs(x["train/grad_norm"] - y["train/grad_norm"]) / max(abs(x["train/grad_norm"]), 1e-12)

            diverged = next((i + 1 for i in range(n)
                             if a[i].get("rollout/reward_mean") != b[i].get("rollout/reward_mean")
                             or a[i].get("rollout/response_length_mean") != b[i].get("rollout/response_length_mean")
                             or not rel_g(a[i], b[i]) <= DIVERGED_REL_GRAD_NORM), None)
            upto = (diverged - 1) if diverged else n
            g = sorted(rel_g(x, y) for x, y in zip(a[:upto], b[:upto]))
            dl = [abs(x["loss/loss"] - y["loss/loss"]) for x, y in zip(a[:upto], b[:upto])]
            pairs.append({"seed": ra["seed"], "steps": n, "divergence_step": diverged, "identical_steps": upto,
                          "median_rel_diff_grad_norm": g[len(g) // 2] if g else math.nan,
                          "max_abs_diff_loss": max(dl) if dl else math.nan,
                          "step1_abs_diff_loss": abs(a[0]["loss/loss"] - b[0]["loss/loss"]) if n else math.nan,
                          "step1_rel_diff_grad_norm": rel_g(a[0], b[0]) if n else math.nan})
        out["gspo_vs_gspo_token"] = {
            "pairs": pairs, "steps": min(p["steps"] for p in pairs),
            "identical_steps": min(p["identical_steps"] for p in pairs),
            "divergence_steps": [p["divergence_step"] for p in pairs],
            "median_rel_diff_grad_norm": max(p["median_rel_diff_grad_norm"] for p in pairs),
            "max_abs_diff_loss": max(p["max_abs_diff_loss"] for p in pairs),
            "step1_abs_diff_loss": max(p["step1_abs_diff_loss"] for p in pairs),
            "step1_rel_diff_grad_norm": max(p["step1_rel_diff_grad_norm"] for p in pairs),
        }
    if "grpo_r2" in runs:
        ch = [r.get("routing/routing_change_frac", math.nan) for run in runs["grpo_r2"] for r in run["rows"]]
        out["grpo_r2_routing_change_max"] = max(ch) if ch else math.nan
    return out


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------

PLOTS = ("reward_step", "reward_tokens", "clip_frac", "seq_ratio", "routing_change", "grad_norm", "entropy",
         "overview")


def _smooth(y: list[float], w: int) -> list[float]:
    return [_mean(y[max(0, i - w + 1):i + 1]) for i in range(len(y))]


def _over_seeds(series: list[dict]) -> tuple[list, list, list, list]:
    """[{x: y} per seed] -> (xs, mean, min, max) over the seeds that have each x."""
    xs = sorted(set().union(*[set(s) for s in series])) if series else []
    mean, lo, hi = [], [], []
    for x in xs:
        ys = [s[x] for s in series if x in s and _finite(s[x])]
        mean.append(_mean(ys))
        lo.append(min(ys) if ys else math.nan)
        hi.append(max(ys) if ys else math.nan)
    return xs, mean, lo, hi


def make_plots(runs: dict[str, list[dict]], plot_dir: str, title: str = "") -> dict[str, str]:
    """One PNG per quantity (and an overview); with several seeds: the mean over seeds, and a
    min-max band for the reward."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    os.makedirs(plot_dir, exist_ok=True)
    paths = {}
    n_seeds = max((len(s) for s in runs.values()), default=1)

    def integer_x(ax):  # RL steps and layer numbers are whole numbers
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))

    def style(v):
        c, ls = STYLE.get(v, ("black", "-"))
        return dict(color=c, linestyle=ls, label=VARIANTS.get(v, {}).get("label", v))

    def per_step(v, key):
        return _over_seeds([{r["step"]: r.get(key, math.nan) for r in run["rows"]} for run in runs[v]])

    def reward_step(ax):
        for v in runs:
            xs, y, lo, hi = per_step(v, "rollout/reward_mean")
            if not xs:
                continue
            w = max(1, len(y) // 10)
            if n_seeds > 1:
                ax.fill_between(xs, _smooth(lo, w), _smooth(hi, w), color=style(v)["color"], alpha=0.12)
            else:
                ax.plot(xs, y, alpha=0.25, color=style(v)["color"], linewidth=0.8)
            ax.plot(xs, _smooth(y, w), **style(v))
        what = f"mean of {n_seeds} seeds, band: min-max (moving mean)" if n_seeds > 1 else "thin: raw, thick: moving mean"
        ax.set(xlabel="RL step", ylabel="mean reward", title=f"reward vs step ({what})")
        integer_x(ax)

    def reward_tokens(ax):
        for v in runs:
            xs, y, _, _ = per_step(v, "rollout/reward_mean")
            _, g, _, _ = per_step(v, "perf/gen_tokens")
            if not xs:
                continue
            cum, tot = [], 0.0
            for t in g:
                tot += t if _finite(t) else 0.0
                cum.append(tot)
            ax.plot(cum, _smooth(y, max(1, len(y) // 10)), **style(v))
        ax.set(xlabel="generated tokens (cumulative" + (", mean over seeds)" if n_seeds > 1 else ")"),
               ylabel="mean reward (moving mean)", title="reward vs generated tokens")

    def clip(ax):
        for v in runs:
            xs, y, _, _ = per_step(v, "loss/clip_frac")
            st = style(v)
            st["label"] += f" (over {VARIANTS.get(v, {}).get('clip_unit', '?')})"
            ax.plot(xs, y, **st)
        ax.set(xlabel="RL step", ylabel="clipped fraction", title="clip fraction (GSPO: sequences, GRPO: tokens)")
        integer_x(ax)

    def seq_ratio(ax):
        for v in runs:
            series = [{r["step"]: r.get("loss/seq_ratio/max", math.nan) - r.get("loss/seq_ratio/min", math.nan)
                       for r in run["rows"]} for run in runs[v]]
            xs, y, _, _ = _over_seeds(series)
            ax.plot(xs, [s if _finite(s) and s > 0 else math.nan for s in y], **style(v))
        ax.set_yscale("log")
        ax.set(xlabel="RL step", ylabel="max - min of s_i over the step's sequences",
               title="sequence-ratio spread (how far off-policy)")
        integer_x(ax)

    def routing(ax_step, ax_layer):
        for v in runs:
            st = style(v)
            pps = [_probe_per_step(run["probe"]) for run in runs[v]]
            xs, y, _, _ = _over_seeds([{s: p["change_frac"] for s, p in pp.items()} for pp in pps])
            if xs:
                ax_step.plot(xs, y, color=st["color"], linestyle=st["linestyle"], label=f"{st['label']}: probe, per update")
            xs, y, _, _ = per_step(v, "routing/routing_change_frac")
            ax_step.plot(xs, y, color=st["color"], linestyle=":", alpha=0.8, label=f"{st['label']}: old -> train forward")
            probe_layers: dict[int, list] = {}
            for pp in pps:
                for p in pp.values():
                    for l, x in p["layers"].items():
                        probe_layers.setdefault(l, []).append(x)
            if probe_layers:
                ls = sorted(probe_layers)
                ax_layer.plot(ls, [_mean(probe_layers[l]) for l in ls], marker="o", color=st["color"],
                              linestyle=st["linestyle"], label=f"{st['label']}: probe")
            logged = sorted(set().union(*[set(_layers(run["rows"], "routing/routing_change_frac")) for run in runs[v]]))
            if logged:
                ax_layer.plot(logged, [_mean([x for run in runs[v] for x in
                                              _col(run["rows"], f"routing/routing_change_frac/layer_{l}")])
                                       for l in logged],
                              marker="x", color=st["color"], linestyle=":", label=f"{st['label']}: old -> train")
        ax_step.set(xlabel="RL step", ylabel="share of (token, expert) choices changed",
                    title="routing change (solid: probe, 1 update; dotted: old -> train)")
        ax_layer.set(xlabel="MoE layer", ylabel="mean over the run", title="routing change per layer")
        integer_x(ax_step)
        integer_x(ax_layer)

    def simple(key, ylabel, title_):
        def f(ax):
            for v in runs:
                xs, y, _, _ = per_step(v, key)
                ax.plot(xs, y, **style(v))
            ax.set(xlabel="RL step", ylabel=ylabel, title=title_)
            integer_x(ax)
        return f

    grad = simple("train/grad_norm", "grad norm (before clipping)", "gradient norm (mean over the step's updates)")
    ent = simple("loss/entropy", "mean token entropy (nats)", "policy entropy on the rollout")

    def finish(fig, axes, name: str, legend_size: int, dpi: int, title_size: Optional[int] = None) -> None:
        for ax in axes:
            ax.grid(alpha=0.3)
            ax.legend(fontsize=legend_size)
        if title:
            fig.suptitle(title, **({"fontsize": title_size} if title_size else {}))
        fig.tight_layout()
        paths[name] = os.path.join(plot_dir, f"{name}.png")
        fig.savefig(paths[name], dpi=dpi)
        plt.close(fig)

    singles = {"reward_step": reward_step, "reward_tokens": reward_tokens, "clip_frac": clip, "seq_ratio": seq_ratio,
               "grad_norm": grad, "entropy": ent}
    for name, fn in singles.items():
        fig, ax = plt.subplots(figsize=(7, 4.2))
        fn(ax)
        finish(fig, [ax], name, legend_size=7, dpi=110, title_size=9)
    fig, axes = plt.subplots(1, 2, figsize=(13, 4.5))
    routing(*axes)
    finish(fig, axes, "routing_change", legend_size=6, dpi=110, title_size=9)
    fig, axes = plt.subplots(2, 4, figsize=(22, 9))
    for ax, fn in zip(axes.flat, singles.values()):
        fn(ax)
    routing(axes.flat[6], axes.flat[7])
    finish(fig, axes.flat, "overview", legend_size=6, dpi=90)
    return paths


# ----------------------------------------------------------------------------------------------
# Tables and docs
# ----------------------------------------------------------------------------------------------


def _f(x, fmt=".3f") -> str:
    return format(x, fmt) if _finite(x) else "n/a"


def _pm(x, sd, fmt=".3f") -> str:
    return _f(x, fmt) + (f" ± {format(sd, fmt)}" if _finite(sd) else "")


def _pct(x, digits=1) -> str:
    return f"{100 * x:.{digits}f}%" if _finite(x) else "n/a"


def _duration(s) -> str:
    if not _finite(s):
        return "n/a"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def summary_markdown(table: dict[str, dict], cons: dict) -> str:
    n_seeds = max((len(t["seeds"]) for t in table.values()), default=1)
    sd = f" (mean ± sd over {n_seeds} seeds)" if n_seeds > 1 else ""
    lines = [
        f"| variant | steps | final reward (last 10){sd} | reward AUC (mean over steps){sd} | mean clip fraction | "
        "routing change old->train | probe: change per update (choices / tokens) | probe: vs initial (end) | "
        "skipped updates / non-finite steps | s / step | wall time per run |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v, t in table.items():
        status = "" if t["rc"] in (None, 0) else f" (exit {t['rc']})"
        lines.append(
            f"| {t['label']}{status} | {t['steps']} | {_pm(t['final_reward'], t['final_reward_std'])} | "
            f"{_pm(t['reward_auc'], t['reward_auc_std'])} | {_pct(t['clip_frac'], 2)} of {t['clip_unit']} | "
            f"{_pct(t['routing_change'], 2)} | {_pct(t['probe_change'], 2)} / {_pct(t['probe_token_change'], 2)} | "
            f"{_pct(t['probe_vs_init_final'], 1)} | {t['skipped_updates']} / {t['nonfinite_steps']} | "
            f"{_f(t['step_time_s'], '.2f')} | {_duration(t['wall_s'])} |")
    if n_seeds > 1:
        lines += ["", "Per seed (final reward / reward AUC):", "",
                  "| variant | " + " | ".join(f"seed {p['seed']}" for p in next(iter(table.values()))["per_seed"]) + " |",
                  "|---|" + "---|" * n_seeds]
        for t in table.values():
            lines.append(f"| {t['label']} | " + " | ".join(f"{_f(p['final_reward'])} / {_f(p['reward_auc'])}"
                                                          for p in t["per_seed"]) + " |")
    per_layer = [v for v in table if table[v]["probe_layers"] or table[v]["routing_change_layers"]]
    if per_layer:
        layers = sorted(set().union(*[set(table[v]["probe_layers"]) | set(table[v]["routing_change_layers"])
                                      for v in per_layer]))
        lines += ["", "Routing change per MoE layer, mean over the run (probe: one update, router free / "
                      "logged: old-log-prob pass -> training forward):", "",
                  "| variant | " + " | ".join(f"layer {l}: probe / logged" for l in layers) + " |",
                  "|---|" + "---|" * len(layers)]
        for v in per_layer:
            t = table[v]
            lines.append(f"| {t['label']} | " + " | ".join(
                f"{_pct(t['probe_layers'].get(l, math.nan), 2)} / {_pct(t['routing_change_layers'].get(l, math.nan), 2)}"
                for l in layers) + " |")
    g = cons.get("gspo_vs_gspo_token")
    if g:
        div = [d for d in g["divergence_steps"] if d]
        seeds = ", ".join(f"seed {p['seed']}: {p['divergence_step'] or 'never'}" for p in g["pairs"])
        lines += ["", f"GSPO vs GSPO-token (same seed, same initial model): step 1 loss difference "
                      f"{g['step1_abs_diff_loss']:.1e} (absolute), grad norm {g['step1_rel_diff_grad_norm']:.1e} "
                      f"(relative): the same gradient to float32 rounding. The runs stay together (median grad-norm "
                      f"difference {g['median_rel_diff_grad_norm']:.0e}, loss within {g['max_abs_diff_loss']:.0e}) "
                  + (f"until a rounding difference flips a sampled token and the trajectories separate (first "
                     f"differing step, {seeds}); after that they are two samples of the same algorithm."
                     if div else f"over all {g['steps']} steps.")]
    if "grpo_r2_routing_change_max" in cons:
        lines += ["", f"GRPO + R2: largest logged old -> train routing change over all steps: "
                      f"{cons['grpo_r2_routing_change_max']:g} (the training forward replays the recorded routes)."]
    return "\n".join(lines) + "\n"


def observations(table: dict[str, dict]) -> list[str]:
    """Plain statements read off the numbers (no interpretation beyond them)."""
    obs = []
    ok = {v: t for v, t in table.items() if t["steps"]}
    if not ok:
        return obs
    best = max(ok, key=lambda v: ok[v]["final_reward"] if _finite(ok[v]["final_reward"]) else -math.inf)
    obs.append("Final reward (mean of the last 10 steps): " + ", ".join(
        f"{t['label']} {_pm(t['final_reward'], t['final_reward_std'])}" for t in ok.values())
        + f"; highest: {ok[best]['label']}.")
    obs.append("Reward AUC (mean over all steps): " + ", ".join(
        f"{t['label']} {_pm(t['reward_auc'], t['reward_auc_std'])}" for t in ok.values()) + ".")
    finals = [t["final_reward"] for t in ok.values() if _finite(t["final_reward"])]
    sds = [t["final_reward_std"] for t in ok.values() if _finite(t["final_reward_std"])]
    if len(finals) > 1:
        spread = max(finals) - min(finals)
        if sds:
            n = min(len(t["seeds"]) for t in ok.values())
            se = _mean(sds) * math.sqrt(2.0 / n)  # standard error of a difference of two means of n seeds
            obs.append(f"Between variants the final rewards differ by at most {spread:.3f}; the seed-to-seed "
                       f"standard deviation within a variant is {_mean(sds):.3f} on average, i.e. a standard "
                       f"error of {se:.3f} for the difference of two variants' means over {n} seeds"
                       + (" (the differences are within about 2 standard errors: not significant)." if spread < 2 * se
                          else " (the largest difference exceeds 2 standard errors)."))
        else:
            obs.append(f"Between variants the final rewards differ by at most {spread:.3f} (one seed per variant: "
                       "the seed-to-seed spread is not measured here; run with --seeds to measure it).")
    gs = [t for v, t in ok.items() if t["clip_unit"] == "sequences"]
    gr = [t for v, t in ok.items() if t["clip_unit"] == "tokens"]
    if gs and gr:
        obs.append("Clipping: " + ", ".join(f"{t['label']} {_pct(t['clip_frac'], 2)} of {t['clip_unit']}"
                                            for t in gs + gr) + ".")
    pr = [t for t in ok.values() if t["probe_updates"]]
    if pr:
        obs.append("Routing volatility probe (one optimizer update, router free): " + ", ".join(
            f"{t['label']} {_pct(t['probe_change'], 2)} of (token, expert) choices / {_pct(t['probe_token_change'], 2)} "
            f"of tokens" for t in pr) + "; after the whole run, vs the initial model: " + ", ".join(
            f"{t['label']} {_pct(t['probe_vs_init_final'], 1)}" for t in pr) + ".")
    obs.append("Logged routing change old-log-prob pass -> training forward: " + ", ".join(
        f"{t['label']} {_pct(t['routing_change'], 2)}" for t in ok.values()) + ".")
    bad = [t for t in ok.values() if t["skipped_updates"] or t["nonfinite_steps"] or t["rc"] not in (None, 0)]
    obs.append("Skipped updates / non-finite steps: " + ("none." if not bad else ", ".join(
        f"{t['label']} {t['skipped_updates']} / {t['nonfinite_steps']}" + (f" (exit {t['rc']})" if t["rc"] else "")
        for t in bad) + "."))
    return obs


def _kind(meta: dict) -> str:
    """The docs section of a run: "default", "stress" (default stress knobs), or "stress_<mb>mb_lr<x>x"."""
    if not meta.get("stress"):
        return "default"
    mb, mult = meta.get("stress_minibatches"), meta.get("stress_lr_mult")
    if mb in (None, STRESS_MINIBATCHES) and mult in (None, STRESS_LR_MULT):
        return "stress"
    return f"stress_{mb}mb_lr{mult:g}x"


def _stress_text(meta: dict) -> str:
    return (f"--stress: {meta.get('num_minibatches')} minibatches per rollout, "
            f"lr x {meta.get('stress_lr_mult') or STRESS_LR_MULT:g}")


def run_section(meta: dict, summary_md: str, obs: list[str], images: dict[str, str]) -> str:
    m = meta["machine"]
    kind = _kind(meta)
    lines = [f"## {'Stress' if kind != 'default' else 'Default'} comparison: {meta.get('config')}"
             + (f" ({_stress_text(meta)})" if kind != "default" else ""), ""]
    lines += ["```bash", meta["command"], "```", ""]
    machine = (f"{m.get('cpu_model', '')} ({m.get('cpus')} logical CPUs), GPUs: {m.get('gpus')}; "
               f"{m.get('platform')}, Python {m.get('python')}, torch {m.get('torch')}, "
               f"megatron-core {m.get('megatron_core', '?')}")
    lines += [
        f"* date: {meta['date']}; machine: {machine}",
        f"* load average when the run started: {m.get('load_avg_at_start')} "
        f"(the machine was shared; torch intra-op threads per run: {meta.get('threads') or 'default'})",
        f"* job: {meta['model']}; {meta['num_steps']} RL steps of {meta['rollout']}, "
        f"{meta['num_minibatches']} minibatches (optimizer updates) per rollout, lr {meta['lr']:g}; "
        f"initial model: {meta.get('init', {}).get('how', '?')}, built once and shared by every run",
        f"* seeds (train.seed and generation.seed; the initial model and the prompt order are shared): "
        f"{', '.join(str(x) for x in meta.get('seeds', [])) or 'the job seed'}",
        f"* overrides: `{' '.join(meta['overrides']) or '(none)'}`",
        f"* total time: {meta['total_wall_s'] / 60:.1f} min for the initial model and {len(meta['variants'])} variants, "
        "sequentially",
        "",
    ]
    lines += [summary_md, "What the numbers say (generated from the table):", ""]
    lines += [f"* {o}" for o in obs] + [""]
    names = {"reward_step": "reward vs step", "reward_tokens": "reward vs generated tokens",
             "clip_frac": "clip fraction", "seq_ratio": "sequence-ratio spread",
             "routing_change": "routing change per layer", "grad_norm": "grad norm", "entropy": "entropy"}
    for key in ("reward_step", "reward_tokens", "clip_frac", "seq_ratio", "routing_change", "grad_norm", "entropy"):
        if key in images:
            lines += [f"![{names[key]}](img/{os.path.basename(images[key])})", ""]
    return "\n".join(lines)


DOC_HEAD = """# GSPO vs GSPO-token vs GRPO vs GRPO + routing replay

This page is generated by `python -m megatron_gspo.compare ... --docs` (`megatron_gspo/compare.py`):
each section below comes from a real run and states its command, machine, date and duration. Rerun
a section with its command; `python -m megatron_gspo.compare --report-only --out DIR --docs` rebuilds
it from a finished run directory. The text up to the first section is fixed; the sections' tables and
"What the numbers say" lists are generated from the runs' `metrics.jsonl` / `probe.jsonl`.

## How the comparison is run

* The initial model is built **once**: the job's SFT warm start (`train.sft_steps`) runs in its own
  process and is saved with `checkpoint.save_model` to `OUT/init_checkpoint`; every run then starts
  from it (`checkpoint.load=OUT/init_checkpoint train.sft_steps=0`). All runs see the same prompts in
  the same order (`data.seed`); with `--seeds a,b,c` each variant runs once per seed
  (`train.seed` and `generation.seed`, i.e. different sampled responses), and the tables give the
  mean ± standard deviation over seeds.
* Variants: **GSPO** (`loss.name=gspo`: sequence ratio, clip 3e-4 / 4e-4), **GSPO-token**
  (`loss.name=gspo_token`, same clip; with per-sequence advantages its value and gradient equal
  GSPO's), **GRPO** (`loss.name=grpo`: token ratios, clip 0.2 / 0.2, no routing replay) and
  **GRPO + R2** (`train.routing_replay=R2`: the training forward reuses the top-k experts recorded in
  the old-log-prob pass). Each loss uses its own default clip range.
* Each run is a fresh process (`python -m megatron_gspo.compare _worker`, the unmodified `Trainer` of
  `megatron_gspo/train.py` plus the routing probe below; under torchrun with `--nproc-per-node N`),
  one after the other. Without a GPU each run gets `OMP_NUM_THREADS=1` (`--threads`): on a shared CPU,
  torch's default intra-op threads oversubscribe the cores: a small-batch step of the tiny model took
  10 s instead of 0.4 s on the loaded 2-core machine below.
* Outputs in `--out` (default `runs/compare`): one directory per run with `metrics.jsonl`,
  `tensorboard/` (`tensorboard --logdir runs/compare` shows the variants side by side),
  `probe.jsonl` and `train.log`; `plots/*.png` (and `plots/overview.png`, all panels), `summary.md`,
  `summary.json`, `compare.json` (command, machine, overrides, wall times).

## Which routing number is which

Two quantities measure how much MoE routing moves; the tables report both.

* **Logged `routing/routing_change_frac`** (the trainer, every run): the share of (token, expert)
  choices made in the old-log-prob pass that the *training forward* of the same micro-batch does not
  make. A rollout is split into `train.num_minibatches` minibatches, one optimizer update each: the
  first minibatch is trained before any update (change 0), minibatch *k* after *k* updates. The
  logged value is an average over 0 .. n-1 updates: about half of one update's change with the
  default 2 minibatches, several updates' worth with 8. This is the routing noise that enters GRPO's
  token ratios. **Under routing replay it is 0 by construction** (the training forward uses the
  recorded routes): GRPO + R2 logs exactly 0 at every step, a structural check of the replay.
* **Probe** (`probe/*`, written by `compare.py`): after every optimizer update, one extra no-grad
  forward of a fixed probe batch (the first 64 sequences of the first rollout, prompt and response
  positions only) with the router running free, compared with the same forward before the update:
  the share of (token, expert) choices that changed (same measure as above), the share of tokens whose
  top-k expert *set* changed, per layer, and the drift against the initial model. This is the
  quantity behind the GSPO paper's remark that about 10% of the activated experts change after one
  update of the 48-layer Qwen3-30B-A3B. **Replay does not change it**: replay makes the loss see the
  old routes, the router itself keeps drifting (GRPO + R2's probe numbers are the same size as
  GRPO's). The probe does not perturb training (a run with and without it logs identical metrics).

What replay buys and costs: GRPO's per-token ratio pi_theta(y_t)/pi_old(y_t) mixes a policy change
with a routing change (a token sent to other experts gets another probability even if no expert
moved); R2 removes the routing part from the loss, at the price of training through routes that the
current router would not choose. GSPO needs none of it: its sequence ratio is the geometric mean of
the token ratios, which averages per-token routing noise, and it clips whole sequences.

## Clip fractions are not the same unit

`loss/clip_frac` is the share of **sequences** whose clipped branch is active for GSPO and
GSPO-token (a sequence is clipped as a whole; the fraction is a multiple of 1 / sequences) and the
share of **tokens** for GRPO (a multiple of 1 / tokens); `tests/test_compare.py` checks both. The GSPO
paper reports that GSPO clips far more than GRPO (tens of percent vs a few percent) and still learns
at least as efficiently: its clip range (3e-4 / 4e-4 on a per-token geometric mean) is tiny, so
modest off-policyness pushes whole sequences out of it.

## Reading the results (runs of 2026-11-23 below)

* **Mechanics, reproduced in every run**: GSPO and GSPO-token compute the same gradient (step 1
  agrees to float32 rounding: 1e-8 to 1e-7 in the loss, 1e-7 to 1e-6 relative in the grad norm) and stay together
  until a rounding difference flips one sampled token, after which they are two samples of the same
  algorithm; GRPO + R2 logs exactly zero old -> train routing change; GSPO clips 15-35% of
  sequences where GRPO clips 1-6% of tokens.
* **Routing volatility**: one optimizer update changes about 3% of the (token, expert) choices of
  the probe batch (about 6% of the tokens change their top-2 set) in the default job, 3-4% under
  `--stress`, for every variant, replay included. This 2-layer, 4-expert model is far from the paper's
  48-layer, 128-expert, top-8 model (~10% per update); the number grows with depth and expert count
  (more near-ties between experts).
* **Rewards**: GSPO and GSPO-token are the same algorithm, so the gap between them is a built-in
  measure of run-to-run noise (0.02 in final reward in the default job, 0.06-0.09 under stress). In
  the default job GSPO, GSPO-token and GRPO end within 0.03 of each other: indistinguishable on this
  task. GRPO + R2 ends lowest in all three settings (default, `--stress`, staleness-only stress): by
  0.03-0.05 in the default job (the largest gap, 0.052, is about 2.5 standard errors of a 3-seed
  difference) and by more under stress. The direction is consistent over 9 runs per variant, but
  with 3 seeds per setting and several comparisons it is a hint, not a result.
* **Stress**: 8 minibatches at twice the learning rate hurts every variant within the first ~10
  steps (reward 0.54 -> ~0.1-0.2) and they recover slowly; the GSPO pair recovers more than GRPO,
  while one GRPO seed and two GRPO + R2 seeds stay near 0.06-0.08. Staleness alone (8 minibatches, the default lr) costs
  every variant about 0.3 reward at step 100 versus the default job. Clipping does not protect
  against too large steps here: with Adam every update moves each weight by about the learning rate,
  however few sequences or tokens keep a gradient.

## What a tiny CPU run shows, and what it does not

The default job is a 2-layer MoE with 4 experts (top-2, 91K parameters) learning single-digit
addition with answers of 1-3 tokens. It runs on two CPU cores in minutes, so it shows the *mechanics*
with real numbers: the same-seed identity of GSPO and GSPO-token, replay zeroing the old -> train
routing change but not the router's drift, the clip-fraction units and magnitudes, how much routing
moves per update, and how the variants' reward curves compare on this task. It does **not**
reproduce the paper's large-model claims: with 2 layers, 4 experts and answers of a few tokens the
sequence ratio is nearly the token ratio, routing noise cannot accumulate over long responses, and
GRPO shows no instability in the default job. The instability GSPO removes shows up on 30B-class MoE
models, long responses and many off-policy minibatches; run this comparison on a GPU recipe
(`launch/recipes/*.yaml`, `--nproc-per-node`) for that.

`--stress` (8 minibatches per rollout, so the last is trained 7 updates off-policy, and 2x the
learning rate; `--stress-minibatches`, `--stress-lr-mult`) makes off-policy effects visible on the
small model: larger clip fractions, sequence-ratio spread and old -> train routing change, and
whether a variant destabilizes (skipped / non-finite updates, reward collapse). It is still a tiny
model on a toy task: a stable or unstable stress run here says nothing definitive about a 30B MoE.
"""

_SECTION_BEGIN = "<!-- compare:{kind}:begin -->"
_SECTION_END = "<!-- compare:{kind}:end -->"


def write_docs(meta: dict, summary_md: str, obs: list[str], plots: dict[str, str], docs_dir: str) -> str:
    kind = _kind(meta)
    img_dir = os.path.join(docs_dir, "img")
    os.makedirs(img_dir, exist_ok=True)
    prefix = "comparison_" if kind == "default" else f"comparison_{kind}_"
    images = {}
    for key, path in plots.items():
        if key == "overview":  # OUT/plots/overview.png; the page shows the single plots
            continue
        dst = os.path.join(img_dir, f"{prefix}{key}.png")
        shutil.copyfile(path, dst)
        images[key] = dst
    doc = os.path.join(docs_dir, "comparison.md")
    sections = {}
    if os.path.isfile(doc):
        text = open(doc, encoding="utf-8").read()
        for k in re.findall(r"<!-- compare:(\S+):begin -->", text):
            b, e = _SECTION_BEGIN.format(kind=k), _SECTION_END.format(kind=k)
            if e in text:
                sections[k] = text[text.index(b):text.index(e) + len(e)]
    body = run_section(meta, summary_md, obs, images)
    sections[kind] = f"{_SECTION_BEGIN.format(kind=kind)}\n{body}\n{_SECTION_END.format(kind=kind)}"
    order = ["default", "stress"] + sorted(k for k in sections if k not in ("default", "stress"))
    with open(doc, "w", encoding="utf-8") as f:
        f.write(DOC_HEAD)
        for k in order:
            if k in sections:
                f.write("\n" + sections[k] + "\n")
    return doc


def report(out: str, docs: bool = False, docs_dir: Optional[str] = None, quiet: bool = False) -> dict:
    """Plots, summary.md / summary.json (and docs) from a finished comparison directory."""
    meta_path = os.path.join(out, "compare.json")
    meta = json.load(open(meta_path, encoding="utf-8")) if os.path.isfile(meta_path) else {}
    runs = load_runs(out, meta)
    table = summarize_runs(runs)
    cons = consistency(runs)
    n_seeds = max((len(r) for r in runs.values()), default=1)
    title = (f"{meta.get('config', '')} {'(' + _stress_text(meta) + ') ' if meta.get('stress') else ''}"
             f"({meta.get('num_steps', '?')} steps"
             + (f", {n_seeds} seeds" if n_seeds > 1 else "") + ")")
    plots = make_plots(runs, os.path.join(out, "plots"), title=title)
    md, obs = summary_markdown(table, cons), observations(table)
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(f"# Comparison in {out}\n\n")
        if meta:
            f.write(f"```bash\n{meta['command']}\n```\n\n")
        f.write(md + "\n" + "\n".join(f"* {o}" for o in obs) + "\n")
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump({"table": table, "consistency": cons, "plots": plots}, f, indent=1,
                  default=lambda x: None)
    result = {"table": table, "consistency": cons, "plots": plots, "summary": os.path.join(out, "summary.md")}
    if docs:
        if not meta:
            raise SystemExit(f"{meta_path} is missing: --docs needs the run's metadata")
        result["docs"] = write_docs(meta, md, obs, plots, docs_dir or os.path.join(REPO_ROOT, "docs"))
    if not quiet:
        print(md)
    return result


# ----------------------------------------------------------------------------------------------
# CLI
# ----------------------------------------------------------------------------------------------


def parse_args(argv: list[str]):
    p = argparse.ArgumentParser(
        prog="python -m megatron_gspo.compare",
        description="Run GSPO / GSPO-token / GRPO / GRPO+R2 from the same initial model and compare them.")
    p.add_argument("--variants", default=",".join(DEFAULT_VARIANTS),
                   help=f"comma-separated, from {', '.join(VARIANTS)} (default: %(default)s)")
    p.add_argument("--out", default="runs/compare", help="output directory (default: %(default)s)")
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
    p.add_argument("--docs", action="store_true", help="also write docs/comparison.md and docs/img/comparison_*.png")
    p.add_argument("--docs-dir", default=None, help=argparse.SUPPRESS)
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
    p.add_argument("--report-only", action="store_true", help="only rebuild plots/tables (and docs) from --out")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    args, rest = p.parse_known_args(argv)
    bad = [r for r in rest if r.startswith("--")]
    if bad:
        p.error(f"unknown option(s) {bad}; job overrides are written section.key=value")
    config = None
    if rest and "=" not in rest[0]:
        config = rest.pop(0)
    args.config = os.path.abspath(config) if config else None
    args.overrides = rest
    args.variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    try:
        args.seeds = [int(x) for x in args.seeds.split(",") if x.strip()] if args.seeds else None
    except ValueError:
        p.error(f"--seeds takes comma-separated integers, got {args.seeds!r}")
    for v in args.variants:
        if v not in VARIANTS:
            p.error(f"unknown variant {v!r}; valid: {', '.join(VARIANTS)}")
    if args.threads is None and "OMP_NUM_THREADS" not in os.environ:
        import torch

        args.threads = None if torch.cuda.is_available() else 1
    args.argv = argv
    return args


def main(argv: Optional[list[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "_worker":
        return worker_main(argv[1:])
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if threading.current_thread() is threading.main_thread():
        # SIGTERM -> SystemExit, so the running child process is terminated too (see _run)
        signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    args = parse_args(argv)
    if args.report_only:
        report(os.path.abspath(args.out), docs=args.docs, docs_dir=args.docs_dir)
        return 0
    from megatron_gspo.train import DEMO_CONFIG

    args.config = args.config or DEMO_CONFIG
    overrides = build_overrides(args.config, args.overrides, steps=args.steps, stress=args.stress,
                                stress_minibatches=args.stress_minibatches, stress_lr_mult=args.stress_lr_mult)
    meta = run_comparison(args, overrides)
    res = report(os.path.abspath(args.out), docs=args.docs, docs_dir=args.docs_dir)
    print(f"[compare] {len(meta['variants'])} variants in {meta['total_wall_s'] / 60:.1f} min; summary: {res['summary']}"
          + (f"; docs: {res['docs']}" if "docs" in res else ""), flush=True)
    failed = {v: r["rc"] for v, r in meta["runs"].items() if r["rc"] != 0}
    if failed:
        print(f"[compare] runs that did not finish: {failed}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
