"""The comparison's figures: one PNG per quantity in ``OUT/plots/`` and ``overview.png`` with every panel.

With several seeds a curve is the mean over seeds (the reward gets a min-max band); reward curves
are smoothed with a trailing moving mean over a tenth of the run.
"""

from __future__ import annotations

import math
import os
from typing import Optional

from experiments.compare._shared import finite, mean, smooth
from experiments.compare.results import col, logged_layers, probe_per_step
from experiments.compare.variants import clip_unit, label

PLOTS = ("reward_step", "reward_tokens", "clip_frac", "seq_ratio", "routing_change", "grad_norm", "entropy",
         "overview")
# colour, line style: gspo_token is dashed because it lies on top of gspo
STYLE = {"gspo": ("tab:blue", "-"), "gspo_token": ("tab:cyan", "--"), "grpo": ("tab:red", "-"),
         "grpo_r2": ("tab:orange", "-"), "grpo_r3": ("tab:purple", "-"), "sapo": ("tab:green", "-"),
         "cispo": ("tab:brown", "-"), "gmpo": ("tab:pink", "-"), "luspo": ("tab:olive", "-")}


def _over_seeds(series: list[dict]) -> tuple[list, list, list, list]:
    """[{x: y} per seed] -> (xs, mean, min, max) over the seeds that have each x."""
    xs = sorted(set().union(*[set(s) for s in series])) if series else []
    avg, lo, hi = [], [], []
    for x in xs:
        ys = [s[x] for s in series if x in s and finite(s[x])]
        avg.append(mean(ys))
        lo.append(min(ys) if ys else math.nan)
        hi.append(max(ys) if ys else math.nan)
    return xs, avg, lo, hi


def make_plots(runs: dict[str, list[dict]], plot_dir: str, title: str = "") -> dict[str, str]:
    """Write every plot of PLOTS for ``runs`` (results.load_runs) into ``plot_dir``; -> {name: path}."""
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
        return dict(color=c, linestyle=ls, label=label(v))

    def per_step(v, key):
        return _over_seeds([{r["step"]: r.get(key, math.nan) for r in run["rows"]} for run in runs[v]])

    def reward_step(ax):
        for v in runs:
            xs, y, lo, hi = per_step(v, "rollout/reward_mean")
            if not xs:
                continue
            w = max(1, len(y) // 10)
            if n_seeds > 1:
                ax.fill_between(xs, smooth(lo, w), smooth(hi, w), color=style(v)["color"], alpha=0.12)
            else:
                ax.plot(xs, y, alpha=0.25, color=style(v)["color"], linewidth=0.8)
            ax.plot(xs, smooth(y, w), **style(v))
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
                tot += t if finite(t) else 0.0
                cum.append(tot)
            ax.plot(cum, smooth(y, max(1, len(y) // 10)), **style(v))
        ax.set(xlabel="generated tokens (cumulative" + (", mean over seeds)" if n_seeds > 1 else ")"),
               ylabel="mean reward (moving mean)", title="reward vs generated tokens")

    def clip(ax):
        for v in runs:
            xs, y, _, _ = per_step(v, "loss/clip_frac")
            st = style(v)
            st["label"] += f" (over {clip_unit(v)})"
            ax.plot(xs, y, **st)
        ax.set(xlabel="RL step", ylabel="clipped fraction", title="clip fraction (GSPO: sequences, GRPO: tokens)")
        integer_x(ax)

    def seq_ratio(ax):
        for v in runs:
            series = [{r["step"]: r.get("loss/seq_ratio/max", math.nan) - r.get("loss/seq_ratio/min", math.nan)
                       for r in run["rows"]} for run in runs[v]]
            xs, y, _, _ = _over_seeds(series)
            ax.plot(xs, [s if finite(s) and s > 0 else math.nan for s in y], **style(v))
        ax.set_yscale("log")
        ax.set(xlabel="RL step", ylabel="max - min of s_i over the step's sequences",
               title="sequence-ratio spread (how far off-policy)")
        integer_x(ax)

    def routing(ax_step, ax_layer):
        for v in runs:
            st = style(v)
            pps = [probe_per_step(run["probe"]) for run in runs[v]]
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
                ax_layer.plot(ls, [mean(probe_layers[l]) for l in ls], marker="o", color=st["color"],
                              linestyle=st["linestyle"], label=f"{st['label']}: probe")
            logged = sorted(set().union(*[set(logged_layers(run["rows"], "routing/routing_change_frac"))
                                          for run in runs[v]]))
            if logged:
                ax_layer.plot(logged, [mean([x for run in runs[v] for x in
                                             col(run["rows"], f"routing/routing_change_frac/layer_{l}")])
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
