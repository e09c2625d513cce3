"""rollout.mode=async on vLLM (rollout/worker.py), in the vLLM tier's interpreter: torchrun, gloo, the CPU; one
trainer rank and one rollout rank whose vLLM engine is built from its Megatron model (the tiny model with head
size 32: vLLM's CPU attention has no kernel for the preset's 16) and given every weight push of the trainer.

* Staleness 0: the rollout rank generates step s with the weights of the trainer's step s, so the trainer's
  recomputed log-probs of the engine's samples equal the engine's (rollout/logprob_diff_max, fp32, < 1e-5 as in
  the colocated job, tests/vllm/test_vllm_job.py): the engine samples from the pushed weights, every step. The
  step's metrics: the bridge's push (async/weight_sync_*), the rollout rank's sync time (async/rollout_sync_s,
  the engine's reload included), the bytes the engine took (rollout/weight_sync_bytes: the whole model in fp32)
  and its prefix cache's hit rate.
* SIGTERM to the rollout rank as its generation of step 2 begins: the trainer saves step 1 and exits 75, the
  rollout rank leaves its engine's decode loop at the trainer's stop; the job resumes from the checkpoint.
The engine-level behaviour of a push in the middle of a generation (partial_rollouts finish / drop, the prefix
cache) is tested in-process: tests/vllm/test_vllm_engine.py."""

import json
import os
import subprocess
import sys
import time

from megatron_gspo.checkpoint.directory import latest_complete
from megatron_gspo.config import load_job_config

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
JOB = ["model.kv_channels=32", "rollout.engine=vllm", "rollout.mode=async", "rollout.world_size=1",
       "rollout.max_staleness=0", "train.sft_steps=0", "train.prompts_per_step=4", "generation.n_samples_per_prompt=4",
       "train.micro_batch_size=8", "train.num_minibatches=2", "optimizer.lr=1e-3", "eval.interval=0",
       f"reward.name={TESTS}/reward_plugins.py:digit_fraction"]


def _job(run_dist, out, *args, check=True):
    """run_job.py (tests/dist_scripts) on 2 ranks; ``args``: overrides, then run_job.py's fault options."""
    first = next((i for i, x in enumerate(args) if x.startswith("--")), len(args))
    return run_dist("run_job.py", 2, "--out", str(out), *args[first:], "--", *JOB, *args[:first], timeout=600,
                    check=check)


def _metrics(out):
    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


def _model_bytes(overrides) -> int:
    """The HF tensors of the mapping in fp32: the model's weights less the vocabulary padding (as
    tests/vllm/test_vllm_job.py counts them)."""
    m = load_job_config(None, overrides).model
    per_layer = (m.hidden_size * (m.num_attention_heads + 2 * m.num_query_groups) * m.kv_channels
                 + m.num_attention_heads * m.kv_channels * m.hidden_size + 2 * m.kv_channels + 2 * m.hidden_size
                 + m.num_moe_experts * (m.hidden_size + 3 * m.moe_ffn_hidden_size * m.hidden_size))
    return 4 * (m.num_layers * per_layer + 2 * m.vocab_size * m.hidden_size + m.hidden_size)


def test_an_async_job_on_vllm_samples_from_the_pushed_weights_every_step(run_dist, tmp_path):
    out = tmp_path / "run"
    t0 = time.monotonic()
    p = _job(run_dist, out, "train.num_steps=3", "generation.max_new_tokens=8")
    print(f"3 async steps on vLLM: {time.monotonic() - t0:.0f} s (with start-up)")
    text = p.stdout + p.stderr
    assert "asynchronous rollouts: 1 more rank(s) generate" in text, text[-3000:]
    rows = _metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    weights = _model_bytes(JOB)
    for r in rows:
        print(f"step {r['step']}: |lp - lp_gen| max {r['rollout/logprob_diff_max']:.3g}, push {r['async/weight_sync_s']:.3f} s "
              f"({r['async/weight_sync_bytes']:.0f} bytes), rollout sync {r['async/rollout_sync_s']:.3f} s, engine took "
              f"{r['rollout/weight_sync_bytes']:.0f} bytes, prefix hits {r['rollout/prefix_cache_hit_rate']:.2f}")
        assert r["rollout/logprob_diff_max"] < 1e-5
        assert r["async/staleness_max"] == 0 and r["async/mixed_version_rows"] == 0
        assert r["rollout/weight_sync_bytes"] == weights
        assert r["async/weight_sync_bytes"] > 0 and r["async/weight_sync_s"] > 0 and r["async/rollout_sync_s"] > 0
        assert 0 <= r["rollout/prefix_cache_hit_rate"] <= 1 and r["perf/gen_tokens"] > 0


def _watched_job(out, *args):
    """``_job`` through Popen: (exit code, output, seconds from the rollout rank's "closed, exiting" line to its
    process's end: its pid from run_job.py's rank1.pid, polled every 50 ms)."""
    from conftest import multi_rank_env

    first = next((i for i, x in enumerate(args) if x.startswith("--")), len(args))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           os.path.join(TESTS, "dist_scripts", "run_job.py"), "--out", str(out), *args[first:], "--", *JOB, *args[:first]]
    lines, gone = [], None
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=multi_rank_env(),
                          cwd=os.path.dirname(TESTS)) as p:
        for line in p.stdout:
            lines.append(line)
            if "rollout rank 1: closed, exiting" in line:
                t0, pid = time.monotonic(), int(open(os.path.join(out, "rank1.pid")).read())
                while _alive(pid) and time.monotonic() - t0 < 60:
                    time.sleep(0.05)
                gone = time.monotonic() - t0
        code = p.wait(timeout=600)
    return code, "".join(lines), gone


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/status") as f:
            return "zombie" not in f.read()
    except FileNotFoundError:
        return False


def test_sigterm_to_a_rollout_rank_in_a_vllm_generation_stops_the_job_with_a_checkpoint_that_resumes(tmp_path):
    """The rollout rank ends its process as soon as it is done (exit_status.leave: no interpreter finalization,
    which with vLLM loaded took 6 s; torchrun's SIGTERM to a lingering rank is ignored once its exit is decided)."""
    out, ckpt = tmp_path / "run", tmp_path / "ckpt"
    # long responses: the trainer's stop reaches the rollout rank inside its engine's decode loop
    job = ["train.num_steps=3", "generation.max_new_tokens=440", "generation.ignore_eos=true", f"checkpoint.save={ckpt}"]
    code, text, gone = _watched_job(out, *job, "--sigterm-rollout-at", "2:1")
    line = next((x for x in text.splitlines() if x.startswith("STOPPED exit")), "")
    print(line)
    assert line.startswith("STOPPED exit 75: ") and "preempted by signal SIGTERM (on rollout rank 1)" in line, text[-4000:]
    assert "while generating: rollout rank 1 ends" in text, [x for x in text.splitlines() if "rollout rank 1" in x][-3:]
    print(f"the rollout rank's process ended {gone:.2f} s after its last line")
    assert gone is not None and gone < 2.0, text[-3000:]
    assert latest_complete(str(ckpt)) == 1 and [r["step"] for r in _metrics(out)] == [1]
    code, text, _ = _watched_job(out, *job, "checkpoint.resume=true")
    assert code == 0, text[-4000:]
    assert [r["step"] for r in _metrics(out)] == [1, 2, 3] and latest_complete(str(ckpt)) == 3
