"""Reward curve of one run for the README, with the held-out evaluation (greedy accuracy, pass@k)
where the run evaluated: python docs/plot_reward.py RUN_DIR/metrics.jsonl OUT.png"""

import json
import sys

from megatron_gspo.runtime.plotting import pyplot, save_figure, smooth


def main(jsonl: str, out: str) -> None:
    with open(jsonl, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    steps = [r["step"] for r in rows]
    reward = [r["rollout/reward_mean"] for r in rows]
    w = 5
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    ax.plot(steps, reward, color="#9ecae1", lw=1, label="reward (per step)")
    ax.plot(steps, smooth(reward, w), color="#08519c", lw=2, label=f"{w}-step mean")
    ev = [r for r in rows if "eval/greedy_accuracy" in r]
    if ev:  # held-out problems, never trained on: greedy accuracy and pass@k beside the training reward
        ax.plot([r["step"] for r in ev], [r["eval/greedy_accuracy"] for r in ev], "o-", color="#d94801", lw=1.5,
                label="held-out greedy accuracy")
        k = next((key for key in ev[0] if key.startswith("eval/pass@")), None)
        if k:
            ax.plot([r["step"] for r in ev], [r[k] for r in ev], "s--", color="#fd8d3c", lw=1, label=f"held-out {k[5:]}")
    ax.axhline(first, color="gray", ls=":", lw=1)
    ax.axhline(last, color="gray", ls="--", lw=1)
    ax.set_xlabel("GSPO step (after the supervised warm start)")
    ax.set_ylabel("exact-match reward / accuracy")
    ax.set_title(f"default job: first 10 steps {first:.3f} -> last 10 steps {last:.3f}")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    save_figure(fig, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
