"""The default job (README's run command) with a shortened GSPO phase: the reward must rise during
GSPO itself. Asserts on reward, never on seconds."""

import json
import os
import subprocess
import sys
import pytest

pytestmark = pytest.mark.slow  # trainer subprocesses under torchrun / the launcher


def test_default_job_reward_rises_during_gspo(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}
    # the full default job runs 100 GSPO steps (+0.28 on the 0..1 reward); 50 keep CI short
    p = subprocess.run([sys.executable, "-m", "megatron_gspo.train", "train.num_steps=50",
                        f"train.output_dir={out}", "train.tensorboard=false"],
                       capture_output=True, text=True, env=env, timeout=3000)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "demo_gspo.yaml" in p.stdout  # no YAML given: the built-in demo job
    rows = [json.loads(x) for x in open(out / "metrics.jsonl")]
    assert len(rows) == 50
    reward = [r["rollout/reward_mean"] for r in rows]
    first, last = sum(reward[:10]) / 10, sum(reward[-10:]) / 10
    assert last - first >= 0.1, (first, last, reward)
    assert "mean reward of the first 10 GSPO steps" in p.stdout
    # GSPO clips whole sequences: a visible fraction of them once off-policy (2 minibatches)
    assert max(r["loss/clip_frac"] for r in rows) > 0.05
