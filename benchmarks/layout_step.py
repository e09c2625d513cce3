"""One RL step at TP 2 and at EP 2 on the CPU, this code against another commit's (run by hand).

Each run is the real entry point under torchrun (``python -m torch.distributed.run --standalone
--nproc-per-node 2 -m megatron_gspo.train ...``) on 2 CPU ranks, one torch thread each, with the same
job: the built-in arithmetic task, GSPO, ``--prompts`` x ``--samples`` rows of up to ``--new-tokens``
tokens per step, 2 minibatches, ``--steps`` steps (the first is not timed). Sides:

* after     this checkout (generation.decode_impl=auto: the lean decoder over the TP / EP shards)
* before    the checkout ``--baseline-repo`` (a commit where auto fell back to megatron's
            StaticInferenceContext path at TP / EP > 1), run from its own directory
* megatron  this checkout with generation.decode_impl=megatron (the decode path alone changed)

Sides alternate within each round (``--rounds``), so they see the same machine load. Reported per run:
the median wall seconds per step (perf/step_time_s) and of its generation (perf/generate_s; the
old-log-prob pass and the updates are in the JSON), and the CPU seconds per step of both ranks: the
CPU time (getrusage of the children) of the ``--steps``-step run minus that of a 1-step run of the same
side right after it, over ``--steps`` - 1 (start-up, model building and the first step cancel out). On a
machine shared with other work the wall times move with its load; the CPU times much less.

    python -m benchmarks.layout_step --layouts tp2,ep2 --baseline-repo /tmp/base --rounds 2 \\
        --json benchmarks/results/layout_step_cpu.json
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.torchrun_job import run_job  # noqa: E402
from benchmarks.trl_side_by_side import SHAPES  # noqa: E402
from megatron_gspo.runtime.sysinfo import load_avg, machine_info  # noqa: E402

LAYOUTS = {"tp2": ["parallel.tensor_model_parallel_size=2"], "ep2": ["parallel.expert_model_parallel_size=2"]}


def job(a, layout: str, side: str, out_dir: str, steps: int) -> list[str]:
    model = [f"model.{k}={v}" for k, v in SHAPES[a.shape].items()]
    decode = ["generation.decode_impl=megatron"] if side == "megatron" else []
    return model + LAYOUTS[layout] + decode + [
        "data.source=builtin:arithmetic", "data.task_num_digits=1", "reward.name=exact_match",
        f"train.prompts_per_step={a.prompts}", f"generation.n_samples_per_prompt={a.samples}",
        f"generation.max_new_tokens={a.new_tokens}", "train.num_minibatches=2",
        f"train.micro_batch_size={a.prompts * a.samples // 2}", f"train.num_steps={steps}", "train.sft_steps=0",
        "optimizer.lr=1e-3", "eval.interval=0", "train.tensorboard=false", "parallel.device=cpu",
        f"train.output_dir={out_dir}",
    ]


def run(a, layout: str, side: str, out_dir: str, steps: int) -> dict:
    repo = os.path.abspath(a.baseline_repo) if side == "before" else REPO
    r = run_job(job(a, layout, side, out_dir, steps), out_dir, nproc=2, threads=a.threads, tree=repo,
                label=f"{layout} {side}")
    return {"layout": layout, "side": side, "wall_s": r.wall_s, "cpu_s": r.cpu_s,
            "step_s_median": r.stat("perf/step_time_s"), "generate_s_median": r.stat("perf/generate_s"),
            "old_logprob_s_median": r.stat("perf/old_logprob_s"), "train_s_median": r.stat("perf/train_s"),
            "step_s_all": [x["perf/step_time_s"] for x in r.rows],
            "reward": [x["rollout/reward_mean"] for x in r.rows],
            "response_length": [x.get("rollout/response_length_mean") for x in r.rows]}


def summarize(runs: list[dict], layouts: list[str], sides: list[str]) -> dict:
    out = {}
    for layout in layouts:
        for side in sides:
            rs = [r for r in runs if r["layout"] == layout and r["side"] == side]
            out[f"{layout}/{side}"] = {
                "step_s_median": statistics.median(x for r in rs for x in r["step_s_all"][1:]),
                "generate_s_median": statistics.median(r["generate_s_median"] for r in rs),
                "cpu_s_per_step": statistics.fmean(r["cpu_s_per_step"] for r in rs), "runs": len(rs)}
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    p.add_argument("--layouts", default="tp2,ep2")
    p.add_argument("--sides", default="before,after")
    p.add_argument("--baseline-repo", default=None, help="a checkout of the commit to compare with (side 'before')")
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    layouts, sides = a.layouts.split(","), a.sides.split(",")
    if ("before" in sides) != bool(a.baseline_repo):
        p.error("side 'before' and --baseline-repo go together")
    if a.steps < 2:
        p.error("--steps must be >= 2 (the CPU time per step is that of --steps steps minus one step)")
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine_info("cpu"),
              "command": "python -m benchmarks.layout_step " + " ".join(sys.argv[1:] if argv is None else argv),
              "config": {k: getattr(a, k) for k in ("shape", "layouts", "sides", "steps", "prompts", "samples",
                                                    "new_tokens", "rounds", "threads", "baseline_repo")},
              "model": SHAPES[a.shape], "load_avg_start": load_avg(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for layout in layouts:
                for side in sides:
                    r = run(a, layout, side, os.path.join(tmp, f"{layout}-{side}-{rnd}"), a.steps)
                    one = run(a, layout, side, os.path.join(tmp, f"{layout}-{side}-{rnd}-1"), 1)
                    r["cpu_s_one_step"] = one["cpu_s"]
                    r["cpu_s_per_step"] = (r["cpu_s"] - one["cpu_s"]) / (a.steps - 1)
                    r["round"], r["load_avg"] = rnd, load_avg()
                    result["runs"].append(r)
                    print(f"round {rnd} {layout} {side:8s} step {r['step_s_median']:.3f} s, generate "
                          f"{r['generate_s_median']:.3f} s (medians) | cpu {r['cpu_s_per_step']:.2f} s/step "
                          f"(both ranks) | load {r['load_avg']}", flush=True)
    result["load_avg_end"] = load_avg()
    result["summary"] = summarize(result["runs"], layouts, sides)
    print(json.dumps(result["summary"], indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
