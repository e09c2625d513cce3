"""Stops during a vLLM generation (rollout.engine=vllm), in the vLLM tier's interpreter: a GSPO job (python -m
megatron_gspo.train through tests/vllm/fault_job.py, one rank, the CPU) whose second step's generation is hit
inside the engine's decode loop, at a given engine step whatever the machine's load.

* SIGTERM: the engine's requests are stepped one engine step at a time with the stop flag read in between, so
  no engine step runs after the signal; the step is abandoned, step 1's state saved, exit 75 within seconds,
  and the resumed job runs to its end.
* The engine raises (an out-of-memory kernel, a dead engine core): one line naming the engine and its error,
  step 1's state saved, exit 1 (a failure), no traceback."""

import json
import os
import subprocess
import sys
import time

from megatron_gspo.checkpoint.directory import latest_complete

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = ["parallel.device=cpu", "model.kv_channels=32", "rollout.engine=vllm", "train.num_steps=3", "train.sft_steps=5",
       "train.prompts_per_step=8", "train.micro_batch_size=32", "eval.interval=0", "generation.max_new_tokens=64",
       "generation.ignore_eos=true", "train.tensorboard=false"]


def _run(tmp_path, name, args, fault=None):
    out = tmp_path / name
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "FAULT_LOG": str(tmp_path / "fault.json")}
    job = [*JOB, *args, f"train.output_dir={out}", f"checkpoint.save={out}/ckpt"]
    cmd = [sys.executable, os.path.join(HERE, "fault_job.py"), *fault, *job] if fault else \
        [sys.executable, "-m", "megatron_gspo.train", *job]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, env=env)
    return p, time.time(), out


def _steps(out):
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_sigterm_in_a_vllm_generation_exits_75_within_seconds_and_the_checkpoint_resumes(tmp_path):
    p, ended, out = _run(tmp_path, "cut", [], fault=["sigterm", "2", "5"])  # engine step 5 of 64 in step 2
    text = p.stdout + p.stderr
    assert p.returncode == 75, text[-4000:]
    fault = json.loads((tmp_path / "fault.json").read_text())
    assert fault.get("steps_after", 0) == 0  # the stop was read before the next engine step: whatever the load
    line = next(x for x in text.splitlines() if "preempted by signal SIGTERM before step 2" in x)
    assert f"preempted by signal SIGTERM before step 2: checkpoint saved to {out}/ckpt (step 1)" in line, line
    assert "step 2 abandoned in generation round 1, decoding cut short" in line
    # the stop line's own clock: the signal's arrival -> the checkpoint written (measured 0.1 s); the process's
    # exit adds the engine's shutdown (1.3-7 s in all on this 2-core machine at load 15-25; the interpreter's finalization,
    # 3-25 s with vLLM loaded, is skipped: exit_status.leave, which fault_job.py ends with as the job's __main__ does)
    to_saved = float(line.split("signal received ")[1].split(" s earlier")[0])
    took = ended - fault["sent_at"]
    print(f"signal -> checkpoint saved {to_saved:.1f} s, -> exit {took:.1f} s")
    assert to_saved < 5 and took < 120, (to_saved, took)
    assert latest_complete(f"{out}/ckpt") == 1 and _steps(out) == [1]
    p, _, _ = _run(tmp_path, "cut", ["checkpoint.resume=true"])
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert _steps(out) == [1, 2, 3] and latest_complete(f"{out}/ckpt") == 3


def test_a_vllm_engine_that_raises_stops_the_job_in_one_line_with_the_last_step_saved(tmp_path):
    p, _, out = _run(tmp_path, "raised", [], fault=["raise", "2", "3"])
    text = p.stdout + p.stderr
    assert p.returncode == 1, text[-4000:]
    assert "Traceback" not in text, text[-4000:]
    lines = [line for line in text.splitlines() if "the vLLM engine (rollout.engine=vllm) failed" in line]
    assert len(lines) == 1, text[-4000:]
    assert ("stopping before step 2: the vLLM engine (rollout.engine=vllm) failed while generating 64 sequence(s): "
            "RuntimeError: CUDA error: out of memory (injected) (the engine's memory: rollout.vllm.kv_cache_memory_gib"
            in lines[0]), lines[0]
    assert f"; checkpoint saved to {out}/ckpt (resume with checkpoint.resume=true" in lines[0], lines[0]
    assert latest_complete(f"{out}/ckpt") == 1 and _steps(out) == [1]
