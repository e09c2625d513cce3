"""Colocated against asynchronous rollouts on the same number of ranks (run by hand).

Each run is the real entry point under torchrun (``python -m torch.distributed.run --standalone
--nproc-per-node N -m megatron_gspo.train ...``) on the CPU, one torch thread per rank:

* colocated   N ranks, data-parallel: every rank generates its share of a step's rollout, then trains
* async<k>    the same N ranks split: N - R train, R = ``--rollout-ranks`` generate, rollout.max_staleness=k
              (k > 0 with rollout_correction.mode=tis, the decoupled objective)

Same job otherwise (the built-in arithmetic task, GSPO, ``--prompts`` x ``--samples`` rows of up to
``--new-tokens`` tokens per step), so every step trains on the same number of samples: the reward
curves compare at equal samples. Every run starts from the same weights: a supervised warm start
(``--sft-steps``, so that rewards move) and one RL step, run once on one rank and saved; each mode loads
them (``checkpoint.load``), so step 1 samples the same rollouts in every mode. Modes alternate within each
round (``--rounds``), so they see the same machine load. Reported per run: median wall seconds per
step (perf/step_time_s, first step excluded), the run's wall and CPU seconds (every rank, from
getrusage of the children), the trainer's and the rollout ranks' idle fractions and the weight-sync
seconds and bytes (async/*), the mean staleness and the reward of every step.

    python -m benchmarks.async_rollout --shape tiny --steps 30 --rounds 2 --json benchmarks/results/async_tiny.json
    python -m benchmarks.async_rollout --shape bench --steps 8 --rounds 1 --json benchmarks/results/async_bench.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.torchrun_job import run_job  # noqa: E402
from benchmarks.trl_side_by_side import SHAPES  # noqa: E402
from megatron_gspo.runtime.sysinfo import load_avg, machine_info  # noqa: E402


def job(shape: str, a) -> list[str]:
    model = [f"model.{k}={v}" for k, v in SHAPES[shape].items()]
    return model + [
        "data.source=builtin:arithmetic", "data.task_num_digits=1", "reward.name=exact_match",
        f"train.prompts_per_step={a.prompts}", f"generation.n_samples_per_prompt={a.samples}",
        f"generation.max_new_tokens={a.new_tokens}", "train.num_minibatches=2", f"train.micro_batch_size={a.prompts * a.samples}",
        f"train.num_steps={a.steps}", "train.sft_batch_size=32", "optimizer.lr=1e-3",
        "eval.interval=0", "train.tensorboard=false", "parallel.device=cpu",
    ]


def mode_overrides(mode: str, rollout_ranks: int) -> list[str]:
    if mode == "colocated":
        return []
    k = int(mode[len("async"):])
    extra = ["rollout_correction.mode=tis"] if k > 0 else []
    return ["rollout.mode=async", f"rollout.world_size={rollout_ranks}", f"rollout.max_staleness={k}", *extra]


def warm_start(shape: str, a, out_dir: str) -> str:
    """The common starting weights: the SFT warm start and one RL step on one rank, saved."""
    args = job(shape, a) + [f"train.sft_steps={a.sft_steps}", "train.num_steps=1", f"train.output_dir={out_dir}",
                            f"checkpoint.save={out_dir}/ckpt"]
    env = {**os.environ, "OMP_NUM_THREADS": str(a.threads), "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, "-m", "megatron_gspo.train", *args], capture_output=True, text=True, env=env,
                       cwd=REPO)
    if p.returncode != 0:
        raise SystemExit(f"warm start failed:\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return f"{out_dir}/ckpt"


def run(shape: str, mode: str, a, out_dir: str, start: str) -> dict:
    args = job(shape, a) + mode_overrides(mode, a.rollout_ranks) + [
        f"train.output_dir={out_dir}", "train.sft_steps=0", f"checkpoint.load={start}"]
    r = run_job(args, out_dir, nproc=a.nproc, threads=a.threads, tree=REPO, label=mode, pythonpath=False)
    return {
        "mode": mode, "wall_s": r.wall_s, "cpu_s": r.cpu_s,
        "step_s_median": statistics.median(x["perf/step_time_s"] for x in r.timed),
        "step_s_all": [x["perf/step_time_s"] for x in r.rows],
        "reward": [x["rollout/reward_mean"] for x in r.rows],
        "trainer_idle_frac": r.stat("async/trainer_idle_frac", statistics.fmean),
        "rollout_idle_frac": r.stat("async/rollout_idle_frac", statistics.fmean),
        "weight_sync_s": r.stat("async/weight_sync_s", statistics.fmean),
        "weight_sync_bytes": r.stat("async/weight_sync_bytes", statistics.fmean),
        "staleness_mean": r.stat("async/staleness_mean", statistics.fmean),
        "partial_finished_rows": sum(x.get("async/partial_finished_rows", 0) for x in r.rows),
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    p.add_argument("--modes", default="colocated,async0,async1")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--rollout-ranks", type=int, default=1)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--sft-steps", type=int, default=100)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=None, help="default: tiny 8, bench 16")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    a.new_tokens = a.new_tokens or {"tiny": 8, "bench": 16}[a.shape]
    modes = a.modes.split(",")
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine_info("cpu"),
              "command": "python -m benchmarks.async_rollout " + " ".join(sys.argv[1:] if argv is None else argv),
              "config": {k: getattr(a, k) for k in ("shape", "nproc", "rollout_ranks", "steps", "sft_steps", "prompts",
                                                    "samples", "new_tokens", "rounds", "threads")},
              "model": SHAPES[a.shape], "load_avg_start": load_avg(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        start = warm_start(a.shape, a, os.path.join(tmp, "start"))
        for rnd in range(a.rounds):
            for mode in modes:
                r = run(a.shape, mode, a, os.path.join(tmp, f"{mode}-{rnd}"), start)
                r["round"] = rnd
                result["runs"].append(r)
                print(f"round {rnd} {mode:10s} step {r['step_s_median']:.3f} s (median) | wall {r['wall_s']:.1f} s, "
                      f"cpu {r['cpu_s']:.1f} s | idle trainer {r['trainer_idle_frac']} rollout {r['rollout_idle_frac']} | "
                      f"staleness {r['staleness_mean']} | reward {r['reward'][0]:.3f} -> {r['reward'][-1]:.3f}", flush=True)
    result["load_avg_end"] = load_avg()
    summary = {}
    for mode in modes:
        runs = [r for r in result["runs"] if r["mode"] == mode]
        summary[mode] = {
            "step_s_median": statistics.median(x for r in runs for x in r["step_s_all"][1:]),
            "wall_s": statistics.fmean(r["wall_s"] for r in runs), "cpu_s": statistics.fmean(r["cpu_s"] for r in runs),
            "trainer_idle_frac": runs[0]["trainer_idle_frac"] and statistics.fmean(r["trainer_idle_frac"] for r in runs),
            "rollout_idle_frac": runs[0]["rollout_idle_frac"] and statistics.fmean(r["rollout_idle_frac"] for r in runs),
            "reward_curve": [statistics.fmean(r["reward"][i] for r in runs) for i in range(a.steps)],
        }
    result["summary"] = summary
    print(json.dumps({m: {k: v for k, v in s.items() if k != "reward_curve"} for m, s in summary.items()}, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
