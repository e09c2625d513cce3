"""The calculator demo's plot: reward and held-out greedy accuracy with the calculator and without it, and the
tool calls per row. python examples/tools/plot_demo.py TOOLS_RUN/metrics.jsonl NO_TOOLS_RUN/metrics.jsonl OUT.png"""

import json
import sys

from megatron_gspo.runtime.plotting import pyplot, save_figure, smooth


def rows(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def main(tools: str, no_tools: str, out: str) -> None:
    plt = pyplot()
    fig, (ax, calls) = plt.subplots(1, 2, figsize=(10, 3.6), dpi=120, gridspec_kw={"width_ratios": [2, 1]})
    for path, name, color in ((tools, "with the calculator", "#08519c"), (no_tools, "without tools", "#a50f15")):
        r = rows(path)
        steps, reward = [x["step"] for x in r], [x["rollout/reward_mean"] for x in r]
        first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
        ax.plot(steps, smooth(reward, 5), color=color, lw=2, label=f"{name}: reward {first:.2f} -> {last:.2f}")
        ev = [x for x in r if "eval/greedy_accuracy" in x]
        ax.plot([x["step"] for x in ev], [x["eval/greedy_accuracy"] for x in ev], "o--", color=color, lw=1,
                label=f"{name}: held-out greedy accuracy")
        if "rollout/tool_calls_mean" in r[0]:
            calls.plot(steps, [x["rollout/tool_calls_mean"] for x in r], color=color, lw=1.5, label="tool calls per row")
            calls.plot(steps, [x["rollout/tool_errors"] / 64 for x in r], color="#fd8d3c", lw=1,
                       label="failed calls per row")
    ax.set_xlabel("GSPO step (after the supervised warm start)")
    ax.set_ylabel("exact-match reward (5-step mean) / accuracy")
    ax.set_ylim(0, 1)
    ax.legend(loc="upper left", fontsize=7)
    calls.set_xlabel("GSPO step")
    calls.set_ylim(0, 1.1)
    calls.legend(loc="center right", fontsize=7)
    save_figure(fig, out)


if __name__ == "__main__":
    main(*sys.argv[1:4])
