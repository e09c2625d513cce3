"""Reward curve of one run for the README: python docs/plot_reward.py RUN_DIR/metrics.jsonl OUT.png"""

import json
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def main(jsonl: str, out: str) -> None:
    rows = [json.loads(line) for line in open(jsonl)]
    steps = [r["step"] for r in rows]
    reward = [r["rollout/reward_mean"] for r in rows]
    w = 5
    smooth = [sum(reward[max(0, i - w + 1):i + 1]) / len(reward[max(0, i - w + 1):i + 1]) for i in range(len(reward))]
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=120)
    ax.plot(steps, reward, color="#9ecae1", lw=1, label="reward (per step)")
    ax.plot(steps, smooth, color="#08519c", lw=2, label=f"{w}-step mean")
    ax.axhline(first, color="gray", ls=":", lw=1)
    ax.axhline(last, color="gray", ls="--", lw=1)
    ax.set_xlabel("GSPO step (after the supervised warm start)")
    ax.set_ylabel("exact-match reward")
    ax.set_title(f"default job: first 10 steps {first:.3f} -> last 10 steps {last:.3f}")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
