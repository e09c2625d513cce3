"""Generation on a long-tailed length workload: the static batch, finished-row compaction, and refill.

Reasoning RL rollouts are long-tailed: most responses end early, a few run to ``max_new_tokens``.
A static batch decodes every row until the longest one ends; ``generation.compact_finished_rows``
drops finished rows from the decode batch and its KV cache; ``generation.max_batch_rows`` (continuous
batching) decodes at most that many rows at once and hands a finished row's place to a waiting row.
This runner measures them, plus the decode path (``generation.decode_impl``: megatron's GPTModel
forward vs the lean step), on the benchmark model of docs/performance.md with random weights:

* workload: ``--prompts`` x ``--samples`` rows, ``--prompt-len`` prompt tokens, up to
  ``--max-new`` new tokens, temperature 1. The stop set is the tokens the model samples most often
  (found by a first run with no stop tokens) until they carry ``--stop-prob`` of the sampled mass,
  so each token ends its response with about that probability: geometric lengths (default mean
  ~100 of 256), most short, a few cut at the maximum.
  The length distribution is printed and stored;
* variants, alternated run by run (``--rounds``; ``--variants`` picks some): static + megatron (the
  landed code's behaviour), static + lean, compaction + megatron, compaction + lean (the default:
  every row in one decode batch, which shrinks as rows finish), and refill + lean
  (``max_batch_rows=--batch-rows``, compaction on once no row waits), and the same cap without refill
  (``waves_lean``: the rows in successive calls of --batch-rows rows). Every variant must give
  the same tokens as the static batch of its decode path (checked: the runner fails otherwise);
  the two decode paths agree to float rounding, so a rare near-tie draw may differ between them:
  counted and reported (``lean_vs_megatron``);
* reported: wall and process CPU seconds per generate() call (median), decode row-steps, the decode
  batch's fill (live rows / rows fed, over the decode steps: perf/decode_batch_fill), generated
  tokens per second (median wall), speedup against the first variant run (static megatron by
  default); the load average before and after.

    python -m benchmarks.long_tail_generation --threads 1 --json benchmarks/results/long_tail.json
    python -m benchmarks.long_tail_generation --variants compact_lean,refill_lean --batch-rows 16
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
import warnings
from types import SimpleNamespace

warnings.filterwarnings("ignore")

import torch  # noqa: E402

from megatron_gspo.runtime import parallel  # noqa: E402
from megatron_gspo.config import ParallelConfig, model_config_from_preset  # noqa: E402
from megatron_gspo.generation.generator import GenerationConfig, generate  # noqa: E402
from megatron_gspo.model.gpt import build_model  # noqa: E402
from megatron_gspo.runtime.sysinfo import load_avg, machine_info  # noqa: E402

from benchmarks.trl_side_by_side import SHAPES  # noqa: E402

VARIANTS = {  # name -> (compact_finished_rows, decode_impl, refilled: max_batch_rows=--batch-rows)
    "static_megatron": (0.0, "megatron", False),
    "static_lean": (0.0, "lean", False),
    "compact_megatron": (0.25, "megatron", False),
    "compact_lean": (0.25, "lean", False),
    "refill_lean": (0.25, "lean", True),
    # what a decode batch of --batch-rows rows does without refill: the rows in successive batches of that many
    # (whole prompts), each with compaction, each until its own longest row ends
    "waves_lean": (0.25, "lean", "waves"),
}


def generate_waves(model, prompts, gcfg, rows_per_wave: int, V: int, st):
    """``prompts`` x G rows in successive generate() calls of rows_per_wave rows (whole prompts, global row keys:
    each row's tokens are the one-batch ones), as one output: tokens right-padded to the longest, counts summed."""
    G = gcfg.n_samples_per_prompt
    k = max(1, rows_per_wave // G)
    outs = [generate(model, prompts[i:i + k], gcfg, vocab_size=V, state=st, row_keys=range(i * G, (i + len(prompts[i:i + k])) * G))
            for i in range(0, len(prompts), k)]
    T = max(o.tokens.shape[1] for o in outs)
    tokens = torch.cat([torch.nn.functional.pad(o.tokens, (0, T - o.tokens.shape[1]), value=gcfg.pad_id) for o in outs])
    return SimpleNamespace(tokens=tokens, response_lengths=torch.cat([o.response_lengths for o in outs]),
                           **{c: sum(getattr(o, c) for o in outs) for c in ("decode_row_steps", "decode_live_row_steps",
                                                                            "num_forwards")})


def divergence(a, b) -> dict:
    """Rows whose tokens differ between two decode paths, and the largest log-prob difference on
    the positions before each row's first difference. The two paths compute the same logits to
    float rounding, so a sample can only differ where the draw falls within rounding of a boundary
    of the inverse CDF (a near-tie, once in tens of thousands of draws); everything before it agrees."""
    T = min(a.tokens.shape[1], b.tokens.shape[1])
    diff = a.tokens[:, :T] != b.tokens[:, :T]
    first = torch.where(diff.any(1), diff.float().argmax(1), torch.full_like(a.prompt_lengths, T))
    cols = torch.arange(T)[None, :]
    agree = (cols < first[:, None]) & a.response_mask[:, :T] & b.response_mask[:, :T]
    return {"rows_diverged": int(diff.any(1).sum()), "draws": int(a.response_lengths.sum()),
            "max_logprob_diff_before": float((a.logprobs[:, :T] - b.logprobs[:, :T])[agree].abs().max())}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="bench")
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--prompt-len", type=int, default=32)
    p.add_argument("--max-new", type=int, default=256)
    p.add_argument("--stop-prob", type=float, default=0.01,
                   help="sampled-token mass of the stop set: the per-token chance that a response ends")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--variants", default=",".join(VARIANTS), help=f"comma-separated, of {list(VARIANTS)}")
    p.add_argument("--batch-rows", type=int, default=16, help="generation.max_batch_rows of refill_lean")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", default=None)
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    variants = {k: VARIANTS[k] for k in args.variants.split(",") if k in VARIANTS}
    if not variants or len(variants) != len(args.variants.split(",")):
        raise SystemExit(f"--variants {args.variants!r}: comma-separated, of {list(VARIANTS)}")
    torch.set_num_threads(args.threads)
    shape = SHAPES[args.shape]
    cfg = model_config_from_preset("tiny", **shape)
    par = ParallelConfig(seed=args.seed)
    st = parallel.initialize(cfg, par)
    model = build_model(cfg, par, st)
    V = shape["vocab_size"]
    g = torch.Generator().manual_seed(args.seed)
    prompts = torch.randint(3, V, (args.prompts, args.prompt_len), generator=g).tolist()
    base = dict(max_new_tokens=args.max_new, temperature=1.0, n_samples_per_prompt=args.samples, seed=args.seed + 1)

    free = generate(model, prompts, GenerationConfig(**base), vocab_size=V, state=st)
    # the most frequent tokens until they carry --stop-prob of the sampled mass: each response token
    # then ends the response with about that probability (geometric lengths, mean ~ 1 / stop-prob)
    freq = torch.bincount(free.tokens[free.response_mask], minlength=V).double()
    order = freq.argsort(descending=True)
    mass = (freq[order].cumsum(0) / freq.sum())
    n_stop = int((mass < args.stop_prob).sum()) + 1
    stop = order[:n_stop].tolist()
    base["stop_token_ids"] = stop

    runs: dict = {k: [] for k in variants}
    firsts: dict = {}
    load_start = load_avg()
    for r in range(args.rounds):
        for name, (compact, impl, refill) in variants.items():
            gcfg = GenerationConfig(**base, compact_finished_rows=compact, decode_impl=impl,
                                    max_batch_rows=args.batch_rows if refill is True else 0)
            c0, t0 = time.process_time(), time.perf_counter()
            if refill == "waves":
                out = generate_waves(model, prompts, gcfg, args.batch_rows, V, st)
            else:
                out = generate(model, prompts, gcfg, vocab_size=V, state=st)
            runs[name].append({"wall_s": time.perf_counter() - t0, "cpu_s": time.process_time() - c0,
                               "decode_row_steps": out.decode_row_steps, "forwards": out.num_forwards,
                               "decode_batch_fill": out.decode_live_row_steps / max(out.decode_row_steps, 1)})
            # compaction and refill must not change a single token of their decode path's one batch
            ref_name = next((k for k in (f"static_{impl}", f"compact_{impl}") if k in firsts), None)
            if ref_name is not None and not torch.equal(out.tokens, firsts[ref_name].tokens):
                raise SystemExit(f"{name} produced other tokens than {ref_name}: a bug, not a benchmark")
            firsts.setdefault(name, out)
            print(f"round {r + 1}/{args.rounds} {name}: {runs[name][-1]['wall_s']:.3f} s", flush=True)
    ref = next(iter(firsts.values()))
    lengths = ref.response_lengths.float()
    res = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info("cpu"), "threads": args.threads, "load_avg_start": load_start, "load_avg_end": load_avg(),
        "config": {k: getattr(args, k) for k in ("shape", "prompts", "samples", "prompt_len", "max_new", "stop_prob",
                                                 "rounds", "seed", "variants", "batch_rows")},
        "stop_tokens": n_stop,
        "lengths": {"median": float(lengths.median()), "mean": float(lengths.mean()),
                    "p90": float(lengths.quantile(0.9)), "max": int(lengths.max()),
                    "share_at_max": float((lengths == args.max_new).float().mean()),
                    "tokens": int(lengths.sum()), "rows": int(lengths.numel())},
        "results": {},
    }
    if "static_megatron" in firsts and "static_lean" in firsts:
        res["lean_vs_megatron"] = divergence(firsts["static_megatron"], firsts["static_lean"])
    first = next(iter(runs.values()))
    base_wall = statistics.median(x["wall_s"] for x in first)
    base_cpu = statistics.median(x["cpu_s"] for x in first)
    for name, recs in runs.items():
        wall, cpu = statistics.median(x["wall_s"] for x in recs), statistics.median(x["cpu_s"] for x in recs)
        res["results"][name] = {"wall_s": round(wall, 4), "cpu_s": round(cpu, 4), "decode_row_steps": recs[0]["decode_row_steps"],
                                "decode_batch_fill": round(recs[0]["decode_batch_fill"], 4),
                                "tokens_per_s": round(res["lengths"]["tokens"] / wall, 1),
                                "speedup_wall": round(base_wall / wall, 3), "speedup_cpu": round(base_cpu / cpu, 3),
                                "runs": recs}
    shown = ("wall_s", "cpu_s", "decode_row_steps", "decode_batch_fill", "tokens_per_s", "speedup_wall", "speedup_cpu")
    print(json.dumps({"lengths": res["lengths"], "lean_vs_megatron": res.get("lean_vs_megatron"),
                      **{k: {kk: v[kk] for kk in shown} for k, v in res["results"].items()}}, indent=1))
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w", encoding="utf-8") as f:
            json.dump(res, f, indent=1)
    parallel.destroy()
    return 0


if __name__ == "__main__":
    sys.exit(main())
