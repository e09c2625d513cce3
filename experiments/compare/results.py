"""Reading a finished comparison directory and reducing it to numbers: per run, per variant over
seeds, and the GSPO vs GSPO-token consistency check.

``OUT/<variant>/{metrics.jsonl, probe.jsonl}`` (one seed) or ``OUT/<variant>/seed_<s>/...`` (--seeds);
``OUT/compare.json`` (run.py) says which runs exist and their exit codes and wall times.
"""

from __future__ import annotations

import json
import math
import os
from typing import Optional

from experiments.compare._shared import finite, mean
from experiments.compare.variants import VARIANTS, clip_unit, label

# GSPO and GSPO-token "diverged" at the first step whose grad norms differ by more than this
# (relative): a different rollout with the same mean reward.
DIVERGED_REL_GRAD_NORM = 1e-3


def read_jsonl(path: str) -> list[dict]:
    if not os.path.isfile(path):
        return []
    with open(path, encoding="utf-8") as f:
        return [json.loads(ln) for ln in f if ln.strip()]


def load_runs(out: str, meta: Optional[dict] = None) -> dict[str, list[dict]]:
    """-> {variant: [one dict per seed: seed, rows (metrics.jsonl), probe (probe.jsonl), rc, wall_s]}."""
    meta = meta or {}
    variants = meta.get("variants") or [v for v in VARIANTS if os.path.isdir(os.path.join(out, v))]
    runs: dict[str, list[dict]] = {}
    for v in variants:
        info = meta.get("runs", {}).get(v)
        if info is None and meta.get("complete") is False:
            continue  # a comparison cut short before this variant ran
        if info is not None:
            entries = info.get("seeds") or [{"seed": None, "dir": v, "rc": info.get("rc"), "wall_s": info.get("wall_s")}]
        else:  # no metadata: one run in OUT/v, or one per OUT/v/seed_*
            sub = sorted(d for d in os.listdir(os.path.join(out, v)) if d.startswith("seed_")) \
                if os.path.isdir(os.path.join(out, v)) else []
            entries = [{"seed": int(d[5:]), "dir": os.path.join(v, d)} for d in sub] or [{"seed": None, "dir": v}]
        runs[v] = []
        for e in entries:
            d = os.path.join(out, e["dir"])
            runs[v].append({"seed": e.get("seed"), "rows": read_jsonl(os.path.join(d, "metrics.jsonl")),
                            "probe": read_jsonl(os.path.join(d, "probe.jsonl")), "rc": e.get("rc"),
                            "wall_s": e.get("wall_s", math.nan)})
    return runs


def col(rows: list[dict], key: str) -> list[float]:
    return [r.get(key, math.nan) for r in rows]


def logged_layers(rows: list[dict], prefix: str) -> list[int]:
    """The MoE layers with a ``<prefix>/layer_<n>`` metric in ``rows``."""
    ls = set()
    for r in rows:
        for k in r:
            if k.startswith(prefix + "/layer_"):
                ls.add(int(k.rsplit("_", 1)[1]))
    return sorted(ls)


def probe_per_step(probe: list[dict]) -> dict:
    """Mean over each RL step's updates -> {step: {change_frac, layers: {layer: change_frac}}}."""
    by: dict[int, list[dict]] = {}
    for r in probe:
        by.setdefault(r["step"], []).append(r)
    out = {}
    for s, rs in sorted(by.items()):
        layers = sorted(rs[0]["layers"], key=int)
        out[s] = {"change_frac": mean([r["change_frac"] for r in rs]),
                  "layers": {int(l): mean([r["layers"][l]["change_frac"] for r in rs]) for l in layers}}
    return out


def run_stats(run: dict) -> dict:
    """The summary numbers of one run (one variant, one seed)."""
    rows, probe = run["rows"], run["probe"]
    reward = col(rows, "rollout/reward_mean")
    k = min(10, len(reward))
    loss, gnorm = col(rows, "loss/loss"), col(rows, "train/grad_norm")
    change = col(rows, "routing/routing_change_frac")
    return {
        "steps": len(rows),
        "final_reward": mean(reward[-k:]) if k else math.nan,
        "reward_auc": mean(reward),
        "first_reward": reward[0] if reward else math.nan,
        "gen_tokens": sum(x for x in col(rows, "perf/gen_tokens") if finite(x)),
        # LUSPO's claim is about response length; GSPO's length bias would shrink it
        "response_length_final": mean(col(rows, "rollout/response_length_mean")[-k:]) if k else math.nan,
        # the last held-out evaluation (eval.interval > 0): greedy accuracy on prompts never trained on
        "heldout_accuracy": next((r["eval/greedy_accuracy"] for r in reversed(rows) if "eval/greedy_accuracy" in r),
                                 math.nan),
        "clip_frac": mean(col(rows, "loss/clip_frac")),
        "clip_frac_low": mean(col(rows, "loss/clip_frac_low")),
        "clip_frac_high": mean(col(rows, "loss/clip_frac_high")),
        "seq_ratio_spread": mean([a - b for a, b in zip(col(rows, "loss/seq_ratio/max"),
                                                          col(rows, "loss/seq_ratio/min"))]),
        "routing_change": mean(change),
        "routing_change_max": max([x for x in change if finite(x)], default=math.nan),
        "routing_change_layers": {l: mean(col(rows, f"routing/routing_change_frac/layer_{l}"))
                                  for l in logged_layers(rows, "routing/routing_change_frac")},
        "probe_change": mean([r["change_frac"] for r in probe]),
        "probe_token_change": mean([r["token_change_frac"] for r in probe]),
        "probe_vs_init_final": probe[-1]["vs_init"]["change_frac"] if probe else math.nan,
        "probe_layers": {int(l): mean([r["layers"][l]["change_frac"] for r in probe])
                         for l in (probe[0]["layers"] if probe else {})},
        "probe_updates": len(probe),
        "skipped_updates": int(sum(x for x in col(rows, "train/skipped_updates") if finite(x))),
        "nonfinite_steps": sum(1 for a, b in zip(loss, gnorm) if not (finite(a) and finite(b))),
        "grad_norm": mean(gnorm),
        "entropy_final": mean(col(rows, "loss/entropy")[-k:]) if k else math.nan,
        "step_time_s": mean(col(rows, "perf/step_time_s")),
        "wall_s": run.get("wall_s", math.nan),
        "rc": run.get("rc"),
    }


def _std(xs) -> float:
    xs = [x for x in xs if finite(x)]
    if len(xs) < 2:
        return math.nan
    m = sum(xs) / len(xs)
    return math.sqrt(sum((x - m) ** 2 for x in xs) / (len(xs) - 1))


def summarize_runs(runs: dict[str, list[dict]]) -> dict[str, dict]:
    """Per variant: the numbers of the summary table, averaged over seeds (sums for counts), with
    the seed-to-seed standard deviation of the rewards when there are several seeds."""
    table = {}
    for v, seeds in runs.items():
        per = [run_stats(r) for r in seeds]
        t: dict = {"label": label(v), "clip_unit": clip_unit(v), "seeds": [r["seed"] for r in seeds]}
        for key, val in per[0].items():
            vals = [p[key] for p in per]
            if key in ("skipped_updates", "nonfinite_steps", "probe_updates"):
                t[key] = sum(vals)
            elif key == "steps":
                t[key] = min(vals)
            elif key == "rc":
                t[key] = next((x for x in vals if x not in (None, 0)), vals[0])
            elif isinstance(val, dict):
                t[key] = {l: mean([p[key].get(l, math.nan) for p in per]) for l in val}
            else:
                t[key] = mean(vals)
        t["final_reward_std"] = _std([p["final_reward"] for p in per])
        t["reward_auc_std"] = _std([p["reward_auc"] for p in per])
        t["heldout_accuracy_std"] = _std([p["heldout_accuracy"] for p in per])
        t["per_seed"] = [{"seed": r["seed"], "final_reward": p["final_reward"], "reward_auc": p["reward_auc"],
                          "steps": p["steps"], "rc": p["rc"]} for r, p in zip(seeds, per)]
        table[v] = t
    return table


def consistency(runs: dict[str, list[dict]]) -> dict:
    """GSPO vs GSPO-token (seed by seed): they differ only in how the same gradient is written, so
    the runs agree to float rounding until a rounding difference flips one sampled token; from then
    on they are two different samples of the same algorithm. The divergence step is the first step
    whose reward or mean response length differs, or whose grad norm differs by more than
    DIVERGED_REL_GRAD_NORM. And GRPO + R2's largest logged old -> train routing change (0 by construction)."""
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
