"""A GSPO job with rollout.engine=vllm (python -m megatron_gspo.train, one rank, the CPU), in the vLLM tier's
interpreter: the tiny model with head size 32 (vLLM's CPU attention has no kernel for the preset's 16), a short
SFT warm start, three GSPO steps of two optimizer updates each. At every step the Megatron model's recomputed
log-probs of the engine's samples equal the engine's (rollout/logprob_diff_max, fp32: measured 1e-6): the
engine samples from the weights of the warm start and of every update, handed over before each step's
generation (perf/weight_sync_s, rollout/weight_sync_bytes)."""

import json
import os
import subprocess
import sys

from megatron_gspo.config import load_job_config

OVERRIDES = ["parallel.device=cpu", "model.kv_channels=32", "rollout.engine=vllm", "train.num_steps=3",
             "train.sft_steps=20", "train.prompts_per_step=8", "train.micro_batch_size=32", "eval.interval=0"]


def test_a_gspo_job_on_vllm_samples_from_the_trained_weights_every_step(tmp_path):
    out = tmp_path / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    p = subprocess.run([sys.executable, "-m", "megatron_gspo.train", *OVERRIDES, f"train.output_dir={out}"],
                       capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    assert "old log-probs: recomputed by the training model (auto: rollout.engine=vllm" in p.stdout + p.stderr
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 3
    cfg = load_job_config(None, OVERRIDES)
    m = cfg.model
    per_layer = (m.hidden_size * (m.num_attention_heads + 2 * m.num_query_groups) * m.kv_channels  # q, k, v
                 + m.num_attention_heads * m.kv_channels * m.hidden_size + 2 * m.kv_channels + 2 * m.hidden_size
                 + m.num_moe_experts * (m.hidden_size + 3 * m.moe_ffn_hidden_size * m.hidden_size))
    weights = m.num_layers * per_layer + 2 * m.vocab_size * m.hidden_size + m.hidden_size
    for r in rows:
        print(f"step {r['step']}: |lp - lp_gen| max {r['rollout/logprob_diff_max']:.3g}, weight sync "
              f"{r['perf/weight_sync_s']:.3f} s, {r['rollout/weight_sync_bytes']:.0f} bytes")
        assert r["rollout/logprob_diff_max"] < 1e-5
        assert r["rollout/mismatch_k3"] < 1e-10 and "rollout/mismatch_ratio_out_frac" in r
        assert r["rollout/weight_sync_bytes"] == 4 * weights and r["perf/weight_sync_s"] > 0
        assert r["perf/gen_tokens"] > 0
