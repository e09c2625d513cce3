"""Demo job with dynamic sampling off vs on: reward and held-out accuracy per step, and a table.

    python docs/plot_dynamic_sampling.py OFF/metrics.jsonl ON/metrics.jsonl docs/img/dynamic_sampling.png

The reward plotted for both runs is that of every generated response (with dynamic sampling on,
``dynamic_sampling/generated_reward_mean``: ``rollout/reward_mean`` is then the kept groups' only,
biased toward mid-range rewards by the selection). Prints the markdown table of docs/algorithms.md.
"""

import json
import sys

from megatron_gspo.runtime.plotting import pyplot, save_figure, smooth


def load(path: str) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def generated_reward(r: dict) -> float:
    return r.get("dynamic_sampling/generated_reward_mean", r["rollout/reward_mean"])


def main(off: str, on: str, out: str) -> None:
    runs = {"dynamic sampling off": load(off), "dynamic sampling on": load(on)}
    plt = pyplot()
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=120)
    for (label, rows), color in zip(runs.items(), ("#08519c", "#d94801")):
        steps = [r["step"] for r in rows]
        ax1.plot(steps, smooth([generated_reward(r) for r in rows], 5), color=color, lw=2, label=label)
        ev = [r for r in rows if "eval/greedy_accuracy" in r]
        ax2.plot([r["step"] for r in ev], [r["eval/greedy_accuracy"] for r in ev], "o-", color=color,
                 label=f"{label}: greedy")
        k = next((key for key in ev[0] if key.startswith("eval/pass@")), None) if ev else None
        if k:
            ax2.plot([r["step"] for r in ev], [r[k] for r in ev], "s--", color=color, alpha=0.6,
                     label=f"{label}: {k[5:]}")
    ax1.set_xlabel("GSPO step")
    ax1.set_ylabel("reward of all generated responses (5-step mean)")
    ax1.set_ylim(0, 1)
    ax1.legend(loc="lower right")
    ax2.set_xlabel("GSPO step")
    ax2.set_ylabel("held-out accuracy (64 prompts)")
    ax2.set_ylim(0, 1)
    ax2.legend(loc="lower right", fontsize=8)
    fig.suptitle("demo job (tiny MoE, arithmetic), same seed: DAPO dynamic sampling off vs on")
    save_figure(fig, out)

    print("| run | final reward (last 10 steps) | final greedy acc. | final pass@k | rounds / step | dropped groups | wall time of the train.py run |")
    print("|---|---|---|---|---|---|---|")
    for label, rows in runs.items():
        last = rows[-10:]
        rew = sum(generated_reward(r) for r in last) / len(last)
        ev = [r for r in rows if "eval/greedy_accuracy" in r][-1]
        k = next(key for key in ev if key.startswith("eval/pass@"))
        rounds = sum(r.get("dynamic_sampling/rounds", 1) for r in rows) / len(rows)
        drop = sum(r.get("dynamic_sampling/dropped_group_frac", 0) for r in rows) / len(rows)
        print(f"| {label} | {rew:.3f} | {ev['eval/greedy_accuracy']:.3f} | {ev[k]:.3f} ({k[5:]}) | {rounds:.2f} | "
              f"{drop:.2f} | (see text) |")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3])
