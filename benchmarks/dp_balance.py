"""The RL step at DP 2 on long-tailed response lengths: rows trained where they were generated against rows
dealt to the ranks by token count (run by hand; docs/performance.md has the results).

Each run is the real entry point under torchrun (``python -m torch.distributed.run --standalone
--nproc-per-node 2 -m megatron_gspo.train ...``) on the CPU, one torch thread per rank, gloo. The job: the
benchmark model of docs/performance.md (``--shape bench``: hidden 256, 4 layers, 16 experts top-4, vocabulary
8192) with random weights, ``--prompts`` x ``--samples`` rows a step of up to ``--new-tokens`` tokens; a
response ends at any of ``--stop-count`` stop tokens, so with the near-uniform draws of random weights the
lengths are geometric (long-tailed: most short, a few at the limit), as reasoning rollouts are. Variants,
alternated within each round (``--rounds``) so that they see the same machine load:

* before     the tree at ``--before`` (a checkout of the commit before the global batch, e.g. ``git archive
             8af29a5``): every rank trains the rows it generated (``local_rows``)
* unbalanced this tree with ``train.balance_batch=false``: the same deal as before, no row moves
* balanced   this tree (``train.balance_batch=true``, the default): each minibatch's rows dealt by tokens

Every variant samples the same rows (sampling noise is keyed by the global row). Reported per run: median
seconds per step (``perf/step_time_s``, the first step excluded), the update's (``perf/train_s``) and the
old-log-prob pass's (``perf/old_logprob_s``) seconds on rank 0 (which waits for the slower rank at every
gradient all-reduce), the run's wall and CPU seconds, and (this tree) ``rollout/dp_token_imbalance`` /
``_unbalanced``: the heaviest rank's tokens over the mean, summed over minibatches.

    python -m benchmarks.dp_balance --before /tmp/gspo-8af29a5 --rounds 2 --json benchmarks/results/dp_balance.json

``--critical-path``: the update's critical path at DP 2 measured in one process, where other processes'
load cannot single out one rank: one rollout of the same job (DP 1), then, alternated ``--repeats`` times,
each simulated rank's forward + backward over its rows (the trainer's micro-batch plan of them) under the
contiguous split and under the deal; the critical path is, per minibatch, the slower rank's time, summed
(each minibatch's optimizer step waits for its slower rank at the gradient all-reduce).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from benchmarks.torchrun_job import run_job  # noqa: E402
from benchmarks.trl_side_by_side import SHAPES  # noqa: E402
from megatron_gspo.runtime.sysinfo import load_avg, machine_info  # noqa: E402

VARIANTS = {"before": [], "unbalanced": ["train.balance_batch=false"], "balanced": ["train.balance_batch=true"]}


def job(a) -> list[str]:
    model = [f"model.{k}={v}" for k, v in SHAPES[a.shape].items()]
    return model + [
        "data.source=builtin:arithmetic", "data.task_num_digits=1", "reward.name=exact_match", "train.sft_steps=0",
        f"train.prompts_per_step={a.prompts}", f"generation.n_samples_per_prompt={a.samples}",
        f"generation.max_new_tokens={a.new_tokens}",
        f"generation.stop_token_ids=[{','.join(str(i) for i in range(5, 5 + a.stop_count))}]",
        "train.num_minibatches=2", f"train.micro_batch_size={a.micro_batch_size}", "train.old_logprobs=recompute",
        f"train.num_steps={a.steps}", "optimizer.lr=1e-4", "eval.interval=0", "train.tensorboard=false",
        "parallel.device=cpu",
    ]


def run(variant: str, a, out_dir: str) -> dict:
    tree = a.before if variant == "before" else REPO
    args = job(a) + VARIANTS[variant] + [f"train.output_dir={out_dir}"]
    r = run_job(args, out_dir, nproc=2, threads=a.threads, tree=tree, label=variant)
    return {"variant": variant, "tree": tree, "wall_s": r.wall_s, "cpu_s": r.cpu_s,
            "step_s_median": r.stat("perf/step_time_s"), "train_s_median": r.stat("perf/train_s"),
            "old_logprob_s_median": r.stat("perf/old_logprob_s"), "generate_s_median": r.stat("perf/generate_s"),
            "step_s_all": [x["perf/step_time_s"] for x in r.rows],
            "imbalance": r.stat("rollout/dp_token_imbalance"),
            "imbalance_unbalanced": r.stat("rollout/dp_token_imbalance_unbalanced"),
            "response_length_mean": r.stat("rollout/response_length_mean"),
            "response_length_max": r.stat("rollout/response_length_max"),
            "loss": [x["loss/loss"] for x in r.rows]}


def _update_s(trainer, record, rows: list[int], micro_batch_size: int) -> float:
    """Seconds of the forward + backward of ``rows`` of ``record`` in the trainer's micro-batch plan."""
    import torch

    from megatron_gspo.model.gpt import forward_logprobs, input_padding_mask
    from megatron_gspo.rollout.prepare import plan_micro_batches

    lengths = record.seq_lengths.tolist()
    perm, plan, widths = plan_micro_batches([lengths[i] for i in rows], 1, micro_batch_size, None, 1)
    order = torch.tensor([rows[i] for i in perm])
    t0 = time.perf_counter()
    for sl, w in zip(plan[0], widths):
        idx = order[sl]
        tokens = torch.nn.functional.pad(record.tokens[idx], (0, max(0, w - record.tokens.shape[1])))[:, :w]
        lp, _ = forward_logprobs(trainer.ddp, tokens[:, :-1], tokens[:, 1:], trainer.cfg.model.vocab_size,
                                 padding_mask=input_padding_mask(record.seq_lengths[idx], w - 1))
        lp.sum().backward()
    return time.perf_counter() - t0


def critical_path(a) -> dict:
    """The update's critical path at DP 2 under the contiguous split and the deal (module doc)."""
    import torch

    from megatron_gspo.config import load_job_config
    from megatron_gspo.rollout.rows import deal_rows, token_imbalance
    from megatron_gspo.runtime import parallel
    from megatron_gspo.trainer.loop import Trainer

    torch.set_num_threads(a.threads)
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(load_job_config(None, job(a) + [f"train.output_dir={tmp}"]))
        try:
            record = trainer.source.collect(0)
            lengths = record.seq_lengths.tolist()
            deals = {"contiguous": deal_rows(lengths, 2, 2, balance=False), "balanced": deal_rows(lengths, 2, 2)}
            share = len(lengths) // 4
            runs = {name: [] for name in deals}
            for _ in range(a.repeats):
                for name, deal in deals.items():
                    per_rank = [[_update_s(trainer, record, rows[k * share:(k + 1) * share], a.micro_batch_size)
                                 for k in range(2)] for rows in deal]
                    runs[name].append({"critical_s": sum(max(r[k] for r in per_rank) for k in range(2)),
                                       "total_s": sum(map(sum, per_rank)), "per_rank_s": per_rank})
                trainer.ddp.zero_grad_buffer()
        finally:
            trainer.close()
            parallel.destroy()
    return {name: summarize_critical(rs) | {"token_imbalance": token_imbalance(lengths, deals[name], 2), "runs": rs}
            for name, rs in runs.items()} | {"lengths": lengths}


def summarize_critical(runs: list[dict]) -> dict:
    """Medians over the repeats: the critical path, all ranks' work, and the critical path over the mean rank's
    work (1.0: a perfect split; a ratio of two times measured back to back, steadier under load than either)."""
    return {"critical_s_median": statistics.median(r["critical_s"] for r in runs),
            "total_s_median": statistics.median(r["total_s"] for r in runs),
            "critical_over_mean_median": statistics.median(r["critical_s"] / (r["total_s"] / 2) for r in runs)}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--before", default=None, help="a checkout of the code before the global batch (variant 'before')")
    p.add_argument("--variants", default="before,unbalanced,balanced")
    p.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--new-tokens", type=int, default=192)
    p.add_argument("--stop-count", type=int, default=160,
                   help="token ids 5 .. 5 + N - 1 end a response: about one draw in 8192 / N under random weights")
    p.add_argument("--micro-batch-size", type=int, default=8)
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--json", default=None)
    p.add_argument("--critical-path", action="store_true", help="measure the update's critical path in one process")
    p.add_argument("--repeats", type=int, default=5)
    a = p.parse_args(argv)
    if a.critical_path:
        result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine_info("cpu"),
                  "command": "python -m benchmarks.dp_balance " + " ".join(sys.argv[1:] if argv is None else argv),
                  "load_avg_start": load_avg(), "critical_path": critical_path(a), "load_avg_end": load_avg()}
        for name, r in result["critical_path"].items():
            if name != "lengths":
                print(f"{name:10s} critical path {r['critical_s_median']:.3f} s (median of {a.repeats}) | all ranks' "
                      f"work {r['total_s_median']:.3f} s | critical / mean rank {r['critical_over_mean_median']:.3f} | "
                      f"token imbalance {r['token_imbalance']:.4f}", flush=True)
        if a.json:
            with open(a.json, "w", encoding="utf-8") as f:
                json.dump(result, f, indent=1)
        return 0
    variants = [v for v in a.variants.split(",") if v != "before" or a.before]
    result = {"date": datetime.datetime.now().isoformat(timespec="seconds"), "machine": machine_info("cpu"),
              "command": "python -m benchmarks.dp_balance " + " ".join(sys.argv[1:] if argv is None else argv),
              "config": {k: getattr(a, k) for k in ("shape", "steps", "prompts", "samples", "new_tokens", "stop_count",
                                                    "micro_batch_size", "rounds", "threads", "before")},
              "model": SHAPES[a.shape], "load_avg_start": load_avg(), "runs": []}
    with tempfile.TemporaryDirectory() as tmp:
        for rnd in range(a.rounds):
            for v in variants:
                r = run(v, a, os.path.join(tmp, f"{v}-{rnd}"))
                r["round"] = rnd
                result["runs"].append(r)
                print(f"round {rnd} {v:10s} step {r['step_s_median']:.3f} s | train {r['train_s_median']:.3f} s | "
                      f"old-lp {r['old_logprob_s_median']:.3f} s | wall {r['wall_s']:.1f} s cpu {r['cpu_s']:.1f} s | "
                      f"imbalance {r['imbalance']} (unbalanced {r['imbalance_unbalanced']}) | "
                      f"length mean {r['response_length_mean']} max {r['response_length_max']}", flush=True)
    result["load_avg_end"] = load_avg()
    result["summary"] = {v: {k: statistics.median(r[k] for r in result["runs"] if r["variant"] == v)
                             for k in ("step_s_median", "train_s_median", "old_logprob_s_median", "wall_s", "cpu_s")}
                         for v in variants}
    print(json.dumps(result["summary"], indent=1))
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
