"""Scaling plot from a benchmarks/run.py JSON: tokens/s vs batch size and vs sequence length, our
model and transformers', training step and log-prob pass.

    python benchmarks/plot.py [benchmarks/results/cpu_latest.json] [-o docs/perf_scaling.png]
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from megatron_gspo.runtime.plotting import pyplot, save_figure

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

STYLE = {("ours", "train_step"): ("tab:blue", "-", "ours: train step"),
         ("hf", "train_step"): ("tab:orange", "-", "transformers: train step"),
         ("ours", "logprob_pass"): ("tab:blue", "--", "ours: log-prob pass"),
         ("hf", "logprob_pass"): ("tab:orange", "--", "transformers: log-prob pass")}


def plot(result: dict, out: str) -> str:
    rows = result.get("scaling") or []
    if not rows:
        raise ValueError("the result has no 'scaling' rows (run benchmarks/run.py without --smoke / --no-scaling)")
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    for ax, axis, xlabel, fixed in ((axes[0], "batch", "batch size (sequences)", "seq"),
                                    (axes[1], "seq", "sequence length (tokens)", "batch")):
        pts = [r for r in rows if r["axis"] == axis]
        for (side, kind), (color, ls, label) in STYLE.items():
            sel = sorted((r[axis], r["tokens_per_s"]) for r in pts if r["side"] == side and r["kind"] == kind)
            if sel:
                ax.plot([x for x, _ in sel], [y for _, y in sel], color=color, linestyle=ls, marker="o", label=label)
        if pts:
            ax.set_title(f"{fixed} = {pts[0][fixed]}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel(xlabel)
        ax.set_ylabel("tokens / s")
        ax.grid(True, alpha=0.3)
    axes[0].legend(fontsize=8)
    m = result.get("machine", {})
    cfg = result.get("config", {}).get("model", {})
    fig.suptitle(f"Qwen3-MoE ({cfg.get('num_layers')} layers, hidden {cfg.get('hidden_size')}, "
                 f"{cfg.get('num_moe_experts')} experts top-{cfg.get('moe_router_topk')}, {result.get('config', {}).get('precision')}) "
                 f"on {m.get('cpu_model') if m.get('device') == 'cpu' else m.get('gpu')}, "
                 f"torch threads={result.get('torch_threads')}, {result.get('date', '')[:10]}", fontsize=9)
    return save_figure(fig, out, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("json", nargs="?", default=os.path.join(REPO, "benchmarks", "results", "cpu_latest.json"))
    ap.add_argument("-o", "--out", default=os.path.join(REPO, "docs", "perf_scaling.png"))
    a = ap.parse_args(argv)
    with open(a.json, encoding="utf-8") as f:
        result = json.load(f)
    print(f"wrote {plot(result, a.out)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
