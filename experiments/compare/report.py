"""The comparison's report, generated from the run directory alone: ``OUT/summary.md`` (run facts,
tables, plain observations, plots), ``OUT/summary.json`` for programs, ``OUT/plots/*.png``; and, with
``--docs-dir DIR``, the same tables and plots copied into ``DIR/comparison.md`` and ``DIR/img/``.

Only generated content is written here. The prose of the docs page (how the comparison is run,
which routing number is which, how to read the results) is written by hand in docs/comparison.md;
this module replaces what lies between a section's ``<!-- compare:<kind>:begin -->`` and
``<!-- compare:<kind>:end -->`` markers and leaves the rest of the page alone.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from typing import Optional

from experiments.compare._shared import finite, mean
from experiments.compare.plots import make_plots
from experiments.compare.results import consistency, load_runs, summarize_runs
from experiments.compare.variants import section_kind, stress_text

# The single plots the reports show, in order, with their alt text (overview.png has them all).
FIGURES = {"reward_step": "reward vs step", "reward_tokens": "reward vs generated tokens",
           "clip_frac": "clip fraction", "seq_ratio": "sequence-ratio spread",
           "routing_change": "routing change per layer", "grad_norm": "grad norm", "entropy": "entropy"}
SECTION_BEGIN = "<!-- compare:{kind}:begin -->"
SECTION_END = "<!-- compare:{kind}:end -->"


def report(out: str, docs_dir: Optional[str] = None, quiet: bool = False) -> dict:
    """Plots, summary.md / summary.json (and the docs sections with ``docs_dir``) from a finished
    comparison directory ``out``. -> {table, consistency, plots, summary[, docs]}."""
    meta_path = os.path.join(out, "compare.json")
    meta = json.load(open(meta_path, encoding="utf-8")) if os.path.isfile(meta_path) else {}
    runs = load_runs(out, meta)
    table = summarize_runs(runs)
    cons = consistency(runs)
    n_seeds = max((len(r) for r in runs.values()), default=1)
    title = (f"{meta.get('config', '')} {'(' + stress_text(meta) + ') ' if meta.get('stress') else ''}"
             f"({meta.get('num_steps', '?')} steps" + (f", {n_seeds} seeds" if n_seeds > 1 else "") + ")")
    plots = make_plots(runs, os.path.join(out, "plots"), title=title)
    tables, obs = summary_markdown(table, cons), observations(table)
    figures = {k: os.path.relpath(plots[k], out) for k in FIGURES if k in plots}
    with open(os.path.join(out, "summary.md"), "w", encoding="utf-8") as f:
        f.write(f"# Comparison in {out}\n\n" + generated_section(meta, tables, obs, figures) + "\n")
    with open(os.path.join(out, "summary.json"), "w", encoding="utf-8") as f:
        json.dump({"table": table, "consistency": cons, "plots": plots}, f, indent=1, default=lambda x: None)
    result = {"table": table, "consistency": cons, "plots": plots, "summary": os.path.join(out, "summary.md")}
    if docs_dir:
        if not meta:
            raise SystemExit(f"{meta_path} is missing: --docs-dir needs the run's metadata")
        result["docs"] = write_docs(meta, tables, obs, plots, docs_dir)
    if not quiet:
        print(tables)
    return result


# ----------------------------------------------------------------------------------------------
# Markdown
# ----------------------------------------------------------------------------------------------


def _f(x, fmt=".3f") -> str:
    return format(x, fmt) if finite(x) else "n/a"


def _pm(x, sd, fmt=".3f") -> str:
    return _f(x, fmt) + (f" ± {format(sd, fmt)}" if finite(sd) else "")


def _pct(x, digits=1) -> str:
    return f"{100 * x:.{digits}f}%" if finite(x) else "n/a"


def _duration(s) -> str:
    if not finite(s):
        return "n/a"
    return f"{s:.0f} s" if s < 120 else f"{s / 60:.1f} min"


def run_facts(meta: dict) -> str:
    """The run's command and a table of where, when and how it ran (compare.json)."""
    m = meta["machine"]
    machine = (f"{m.get('cpu_model', '')} ({m.get('cpus')} logical CPUs), GPUs: {m.get('gpus')}; "
               f"{m.get('platform')}, Python {m.get('python')}, torch {m.get('torch')}, "
               f"megatron-core {m.get('megatron_core', '?')}")
    rows = [
        ("date", meta["date"]),
        ("machine", machine),
        ("load average at the start", m.get("load_avg_at_start")),
        ("torch intra-op threads per run", meta.get("threads") or "default"),
        ("job", f"{meta['model']}; {meta['num_steps']} RL steps of {meta['rollout']}, {meta['num_minibatches']} "
                f"minibatches (optimizer updates) per rollout, lr {meta['lr']:g}"),
        ("initial model (shared by every run)", meta.get("init", {}).get("how", "?")),
        ("seeds (train.seed and generation.seed)", ", ".join(str(x) for x in meta.get("seeds", [])) or "the job seed"),
        ("overrides", f"`{' '.join(meta['overrides']) or '(none)'}`"),
        ("total time, one run after the other", f"{meta['total_wall_s'] / 60:.1f} min for the initial model and "
                                                f"{len(meta['variants'])} variants"),
    ]
    if meta.get("complete") is False:  # cut short: say exactly what ran
        done = sum(len(r.get("seeds") or [r]) for r in meta["runs"].values())
        planned = len(meta["variants"]) * len(meta.get("seeds") or [None])
        rows.append(("runs", f"**{done} of the {planned} planned runs**: the comparison was stopped before the "
                             "rest; the tables give the runs that finished"))
    return "\n".join(["```bash", meta["command"], "```", "", "| run | |", "|---|---|"]
                     + [f"| {k} | {v} |" for k, v in rows]) + "\n"


def generated_section(meta: dict, tables: str, obs: list[str], figures: dict[str, str]) -> str:
    """Run facts (when ``meta`` is known), tables, observations and figures (``{name: relative path}``)."""
    parts = [run_facts(meta)] if meta else []
    parts += [tables, "What the numbers say (generated from the table):\n\n" + "\n".join(f"* {o}" for o in obs) + "\n"]
    parts += [f"![{FIGURES[k]}]({path})\n" for k, path in figures.items()]
    return "\n".join(parts)


def summary_markdown(table: dict[str, dict], cons: dict) -> str:
    n_seeds = max((len(t["seeds"]) for t in table.values()), default=1)
    sd = f" (mean ± sd over {n_seeds} seeds)" if n_seeds > 1 else ""
    lines = [
        f"| variant | steps | final reward (last 10){sd} | reward AUC (mean over steps){sd} | held-out greedy "
        f"accuracy (last eval){sd} | response length (last 10) | mean clip fraction | "
        "routing change old->train | probe: change per update (choices / tokens) | probe: vs initial (end) | "
        "skipped updates / non-finite steps | s / step | wall time per run |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for v, t in table.items():
        status = "" if t["rc"] in (None, 0) else f" (exit {t['rc']})"
        lines.append(
            f"| {t['label']}{status} | {t['steps']} | {_pm(t['final_reward'], t['final_reward_std'])} | "
            f"{_pm(t['reward_auc'], t['reward_auc_std'])} | {_pm(t['heldout_accuracy'], t['heldout_accuracy_std'])} | "
            f"{_f(t['response_length_final'], '.2f')} | {_pct(t['clip_frac'], 2)} of {t['clip_unit']} | "
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
    best = max(ok, key=lambda v: ok[v]["final_reward"] if finite(ok[v]["final_reward"]) else -math.inf)
    obs.append("Final reward (mean of the last 10 steps): " + ", ".join(
        f"{t['label']} {_pm(t['final_reward'], t['final_reward_std'])}" for t in ok.values())
        + f"; highest: {ok[best]['label']}.")
    obs.append("Reward AUC (mean over all steps): " + ", ".join(
        f"{t['label']} {_pm(t['reward_auc'], t['reward_auc_std'])}" for t in ok.values()) + ".")
    finals = [t["final_reward"] for t in ok.values() if finite(t["final_reward"])]
    sds = [t["final_reward_std"] for t in ok.values() if finite(t["final_reward_std"])]
    if len(finals) > 1:
        spread = max(finals) - min(finals)
        if sds:
            n = min(len(t["seeds"]) for t in ok.values())
            se = mean(sds) * math.sqrt(2.0 / n)  # standard error of a difference of two means of n seeds
            obs.append(f"Between variants the final rewards differ by at most {spread:.3f}; the seed-to-seed "
                       f"standard deviation within a variant is {mean(sds):.3f} on average, i.e. a standard "
                       f"error of {se:.3f} for the difference of two variants' means over {n} seeds"
                       + (" (the differences are within about 2 standard errors: not significant)." if spread < 2 * se
                          else " (the largest difference exceeds 2 standard errors)."))
        else:
            obs.append(f"Between variants the final rewards differ by at most {spread:.3f} (one seed per variant: "
                       "the seed-to-seed spread is not measured here; run with --seeds to measure it).")
    if len({t["clip_unit"] for t in ok.values()}) > 1:  # the units differ: say each one
        obs.append("Clipping: " + ", ".join(f"{t['label']} {_pct(t['clip_frac'], 2)} of {t['clip_unit']}"
                                            for t in ok.values()) + ".")
    if any(finite(t["heldout_accuracy"]) for t in ok.values()):
        obs.append("Held-out greedy accuracy at the last evaluation: " + ", ".join(
            f"{t['label']} {_pm(t['heldout_accuracy'], t['heldout_accuracy_std'])}" for t in ok.values()) + ".")
    obs.append("Mean response length over the last 10 steps (tokens): " + ", ".join(
        f"{t['label']} {_f(t['response_length_final'], '.2f')}" for t in ok.values()) + ".")
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


# ----------------------------------------------------------------------------------------------
# --docs-dir
# ----------------------------------------------------------------------------------------------


def write_docs(meta: dict, tables: str, obs: list[str], plots: dict[str, str], docs_dir: str) -> str:
    """Copy the figures to ``docs_dir/img/comparison_[<kind>_]<name>.png`` and put the generated
    section between the run kind's markers of ``docs_dir/comparison.md`` (section_kind: default,
    stress, stress_<mb>mb_lr<x>x). A kind the page has no markers for is appended at the end, under
    a heading to edit; a missing page is created with that section alone. -> the page's path."""
    kind = section_kind(meta)
    img_dir = os.path.join(docs_dir, "img")
    os.makedirs(img_dir, exist_ok=True)
    prefix = "comparison_" if kind == "default" else f"comparison_{kind}_"
    figures = {}
    for key in FIGURES:
        if key in plots:
            shutil.copyfile(plots[key], os.path.join(img_dir, f"{prefix}{key}.png"))
            figures[key] = f"img/{prefix}{key}.png"
    begin, end = SECTION_BEGIN.format(kind=kind), SECTION_END.format(kind=kind)
    block = f"{begin}\n{generated_section(meta, tables, obs, figures)}\n{end}"
    doc = os.path.join(docs_dir, "comparison.md")
    text = open(doc, encoding="utf-8").read() if os.path.isfile(doc) else ""
    if begin in text and end in text.split(begin, 1)[1]:
        head, rest = text.split(begin, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        heading = (f"Default comparison: {meta.get('config')}" if kind == "default"
                   else f"Stress comparison: {meta.get('config')} ({stress_text(meta)})")
        text = (text.rstrip("\n") + "\n\n" if text else "") + f"## {heading}\n\n{block}\n"
        print(f"[compare] {doc}: no section {kind!r} yet; appended it at the end (add its prose above the marker)",
              flush=True)
    with open(doc, "w", encoding="utf-8") as f:
        f.write(text)
    return doc

