"""Reward curve of one run for the README: python docs/plot_reward.py RUN_DIR/metrics.jsonl OUT.png"""

import json
import sys

from megatron_gspo.plotting import pyplot, save_figure, smooth


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
    ax.axhline(first, color="gray", ls=":", lw=1)
    ax.axhline(last, color="gray", ls="--", lw=1)
    ax.set_xlabel("GSPO step (after the supervised warm start)")
    ax.set_ylabel("exact-match reward")
    ax.set_title(f"default job: first 10 steps {first:.3f} -> last 10 steps {last:.3f}")
    ax.set_ylim(0, 1)
    ax.legend(loc="lower right")
    save_figure(fig, out)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
