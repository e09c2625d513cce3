"""Crash safety, exact resume after kill -9 / SIGTERM, NaN guards, multi-rank failure, bad inputs,
and a soak run. Runs the real entry point in subprocesses (faults injected via MEGATRON_GSPO_FAULTS)."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch

from megatron_gspo.checkpoint import dist_checkpoint_to_tensors, iter_dir, latest_complete, verify_checkpoint
from megatron_gspo.checkpoint.torch_dist_files import read_common
from megatron_gspo.runtime.stop import EXIT_PREEMPTED, EXIT_TOO_MANY_SKIPS

pytestmark = pytest.mark.slow  # trainer subprocesses under torchrun / the launcher

HERE = os.path.dirname(os.path.abspath(__file__))
JOB = [
    "train.sft_steps=0", "train.prompts_per_step=4", "generation.n_samples_per_prompt=4", "generation.max_new_tokens=4",
    "train.micro_batch_size=8", "train.num_minibatches=2", "optimizer.lr=1e-3", "train.tensorboard=false",
    f"reward.name={HERE}/reward_plugins.py:digit_fraction",
]
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONUNBUFFERED": "1"}


class Run:
    """A trainer subprocess in its own session. Output goes to a file, not a pipe: a SIGKILLed
    trainer can leave dist_checkpointing's writer processes behind holding inherited pipes."""

    def __init__(self, cmd, env, log_path):
        self.log_path = log_path
        self.log = open(log_path, "w")
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True)

    def send_signal(self, sig):
        self.p.send_signal(sig)

    def wait(self, timeout=600):
        try:
            rc = self.p.wait(timeout=timeout)
        finally:
            try:  # reap whatever the run left behind (its whole session)
                os.killpg(self.p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.log.close()
        return rc, open(self.log_path).read()


def train(tmp, name, *extra, faults="", steps=4, wait=True, nproc=1):
    args = JOB + [f"train.num_steps={steps}", f"train.output_dir={tmp}/{name}", f"checkpoint.save={tmp}/{name}/ckpt",
                  "checkpoint.save_interval=1", *extra]
    if nproc == 1:
        cmd = [sys.executable, "-m", "megatron_gspo.train", *args]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc),
               "-m", "megatron_gspo.train", *args]
    env = {**ENV, "MEGATRON_GSPO_FAULTS": faults}
    os.makedirs(f"{tmp}/logs", exist_ok=True)
    run = Run(cmd, env, f"{tmp}/logs/{name}-{len(os.listdir(f'{tmp}/logs'))}.log")
    return run.wait() if wait else run


def final_weights(ckpt_root, step):
    d = dist_checkpoint_to_tensors(iter_dir(ckpt_root, step))
    return {k: v for k, v in d.items() if isinstance(v, torch.Tensor) and not k.startswith("optimizer")}


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("straight")
    rc, out = train(tmp, "a")
    assert rc == 0, out[-3000:]
    return final_weights(f"{tmp}/a/ckpt", 4)


def assert_same(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("fault", ["kill@3", "kill_in_save@2", "random"])
def test_kill9_then_resume_matches_uninterrupted(tmp_path, straight, fault):
    if fault == "random":
        run = train(tmp_path, "b", wait=False)
        time.sleep(random.Random(0).uniform(4.0, 12.0))
        run.send_signal(signal.SIGKILL)
        run.wait()
    else:
        rc, out = train(tmp_path, "b", faults=fault)
        assert rc == -signal.SIGKILL, out[-2000:]
    root = f"{tmp_path}/b/ckpt"
    if fault == "kill_in_save@2":
        # the half-written checkpoint is a .tmp directory, never mistaken for a complete one
        assert os.path.isdir(iter_dir(root, 2) + ".tmp") and latest_complete(root) == 1
    rc, out = train(tmp_path, "b", "checkpoint.resume=true")
    assert rc == 0, out[-3000:]
    assert_same(straight, final_weights(root, 4))
    # steps logged before the kill but after the last checkpoint run again: one row each
    assert [json.loads(x)["step"] for x in open(f"{tmp_path}/b/metrics.jsonl")] == [1, 2, 3, 4]


def test_corrupt_latest_checkpoint_falls_back(tmp_path, straight):
    rc, out = train(tmp_path, "c", steps=3)
    assert rc == 0, out[-2000:]
    root = f"{tmp_path}/c/ckpt"
    victim = next(f for f in sorted(os.listdir(iter_dir(root, 3))) if f.endswith(".distcp"))
    with open(os.path.join(iter_dir(root, 3), victim), "r+b") as f:  # flip bytes in place
        f.seek(100)
        f.write(b"\x00garbage\x00")
    assert "fails its checksum" in verify_checkpoint(iter_dir(root, 3))
    rc, out = train(tmp_path, "c", "checkpoint.resume=true")
    assert rc == 0, out[-3000:]
    assert f"iter_0000003 is incomplete or corrupt (file {victim} fails its checksum)" in out
    assert "resumed from" in out and "iter_0000002" in out
    assert_same(straight, final_weights(root, 4))


def test_sigterm_checkpoints_and_resumes(tmp_path, straight):
    # the same rewards, 50 ms per response: steps 2-4 take seconds, so the signal surely lands mid-run
    run = train(tmp_path, "d", f"reward.name={HERE}/reward_plugins.py:slow_digit_fraction", steps=4, wait=False)
    # wait for the first checkpoint, then preempt
    root = f"{tmp_path}/d/ckpt"
    deadline = time.time() + 300
    while latest_complete(root) is None and time.time() < deadline:
        time.sleep(0.5)
    run.send_signal(signal.SIGTERM)
    rc, out = run.wait(timeout=300)
    assert rc == EXIT_PREEMPTED, out[-2000:]
    assert "preempted by signal SIGTERM" in out
    saved = latest_complete(root)
    # resumed with the fast twin of the reward (same values): a change the resume must be told to accept
    rc, out = train(tmp_path, "d", "checkpoint.resume=true", "checkpoint.allow_config_change=[reward.name]")
    assert rc == 0 and f"iter_{saved:07d}" in out, out[-2000:]
    assert_same(straight, final_weights(root, 4))


def test_nan_skipped_on_every_rank_and_k_in_a_row_stop(tmp_path):
    """Rank 1 alone sees non-finite log-probs at step 2; both ranks skip. Steps 2-4 poisoned on
    rank 1 with K=3: the run stops with EXIT_TOO_MANY_SKIPS and the checkpoint of the last completed step."""
    rc, out = train(tmp_path, "e", "train.max_consecutive_skips=3", "train.num_minibatches=1",
                    faults="nan_logprob@2:1,nan_logprob@3:1,nan_logprob@4:1", steps=5, nproc=2)
    assert rc != 0
    # each skip is logged by every rank (the decision is collective); rank 1 names the sequences
    assert out.count("step 2: non-finite loss/gradients, update skipped on every rank (1 in a row") == 2, out[-4000:]
    assert "sequences with non-finite log-probs on rank 1" in out
    assert "sequences with non-finite log-probs on rank 0" not in out
    assert "stopping: 3 consecutive updates had non-finite loss or gradients" in out
    assert f"exitcode  : {EXIT_TOO_MANY_SKIPS}" in out
    root = f"{tmp_path}/e/ckpt"
    assert latest_complete(root) == 3  # the last completed step (its periodic save) when step 4's skip stopped the run
    assert read_common(iter_dir(root, 3))["extra"]["skips"] == {"consecutive": 2, "total": 2}  # a resume counts on
    rows = [json.loads(x) for x in open(f"{tmp_path}/e/metrics.jsonl")]
    assert [r["train/skipped_updates"] for r in rows] == [0, 1, 1]


def saved_state(root, step):
    """What a resume reads of iter_<step>: every tensor (weights and optimizer), the schedule, the data
    position and the skip count."""
    common = read_common(iter_dir(root, step))
    extra = common.get("extra") or {}
    return (dist_checkpoint_to_tensors(iter_dir(root, step)),
            {"scheduler": common.get("scheduler"), "data": extra.get("data"), "skips": extra.get("skips")})


# 4 minibatches per step, a stop after 3 skips in a row: a step whose first update was applied can end the run
SKIP_STOP = ["train.num_minibatches=4", "train.micro_batch_size=4", "train.max_consecutive_skips=3"]


@pytest.fixture(scope="module")
def stopped_clean_at_2(tmp_path_factory):
    """A SIGTERM as step 3 begins: the checkpoint a clean stop after step 2 leaves (none periodic before it)."""
    tmp = tmp_path_factory.mktemp("clean")
    rc, out = train(tmp, "a", *SKIP_STOP, "checkpoint.save_interval=100", faults="sigterm@3")
    assert rc == EXIT_PREEMPTED, out[-3000:]
    return saved_state(f"{tmp}/a/ckpt", 2)


@pytest.mark.parametrize("interval", [100, 1], ids=["step-2-unsaved", "step-2-saved"])
def test_stop_for_skips_inside_a_step_leaves_the_last_completed_step(tmp_path, stopped_clean_at_2, interval):
    """Step 3's first minibatch is applied, its 2nd-4th are non-finite: the third skip stops the run inside
    step 3. What it leaves is the clean stop's checkpoint of step 2 (weights, Adam states, schedule, data
    position), written now (step 2 unsaved: its state as it was before step 3's update) or the periodic
    save of step 2 left as it is; the skips are counted in it."""
    rc, out = train(tmp_path, "k", *SKIP_STOP, f"checkpoint.save_interval={interval}", faults="nan_logprob_late@3")
    assert rc == EXIT_TOO_MANY_SKIPS, out[-3000:]
    assert "stopping: 3 consecutive updates had non-finite loss or gradients" in out
    root = f"{tmp_path}/k/ckpt"
    assert latest_complete(root) == 2 and not os.path.exists(iter_dir(root, 3))
    tensors, common = saved_state(root, 2)
    want_tensors, want_common = stopped_clean_at_2
    assert_same(want_tensors, tensors)
    assert common == want_common and common["skips"] == {"consecutive": 0, "total": 0}  # step 3's skips are not in it


def test_one_rank_raises_both_exit_quickly(tmp_path):
    t0 = time.time()
    rc, out = train(tmp_path, "f", faults="raise@2:1", steps=4, nproc=2)
    assert rc != 0
    assert "injected fault: rank 1 raises at step 2" in out
    assert time.time() - t0 < 180


def test_checkpoint_of_other_shape_is_refused_and_kept(tmp_path):
    rc, out = train(tmp_path, "g", steps=1)
    assert rc == 0
    root = f"{tmp_path}/g/ckpt"
    before = {f: os.path.getsize(os.path.join(iter_dir(root, 1), f)) for f in os.listdir(iter_dir(root, 1))}
    rc, out = train(tmp_path, "g", "model.hidden_size=128", "checkpoint.resume=true", steps=2)
    assert rc != 0  # the checkpoint's job says it first: another model is a trajectory change
    assert "with a changed config: model.hidden_size 64 -> 128" in out, out[-2000:]
    rc, out = train(tmp_path, "g", "model.hidden_size=128", "checkpoint.resume=true",
                    "checkpoint.allow_config_change=[model.hidden_size]", steps=2)
    assert rc != 0  # accepted by name, the weights still cannot fit
    assert "has shape (128, 64) in the checkpoint but the model expects (128, 128)" in out
    assert "different model config" in out
    after = {f: os.path.getsize(os.path.join(iter_dir(root, 1), f)) for f in os.listdir(iter_dir(root, 1))}
    assert before == after and latest_complete(root) == 1


@pytest.mark.parametrize("override, message", [
    ("data.source=/nonexistent/prompts.jsonl", "/nonexistent/prompts.jsonl"),
    ("model.vocab_size=50", "vocab"),
    ("loss.clip_ratio_low=1.5", "loss.clip_ratio_low must be in (0, 1), got 1.5"),
    ("train.routing_replay=R2", "GSPO needs no routing replay"),
])
def test_bad_input_fails_before_writing(tmp_path, override, message):
    rc, out = train(tmp_path, "h", override, steps=1)
    assert rc != 0 and message in out, out[-2000:]
    assert not os.path.exists(f"{tmp_path}/h"), "nothing may be written for a refused run"


def test_soak_rss_is_flat_with_rotation(tmp_path):
    rc, out = train(tmp_path, "s", "checkpoint.keep_last=2", steps=30)
    assert rc == 0, out[-2000:]
    rows = [json.loads(x) for x in open(f"{tmp_path}/s/metrics.jsonl")]
    rss = [r["perf/rss_mb"] for r in rows]
    assert max(rss[10:]) - rss[9] < 40, rss  # MB: no per-step growth once warm
    kept = sorted(d for d in os.listdir(f"{tmp_path}/s/ckpt") if d.startswith("iter_"))
    assert kept == ["iter_0000029", "iter_0000030"]


@pytest.fixture(scope="module")
def ep2_checkpoint(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("ep2")
    rc, out = train(tmp, "src", "parallel.expert_model_parallel_size=2", steps=2, nproc=2)
    assert rc == 0, out[-3000:]
    return f"{tmp}/src/ckpt"


RELAYOUTS = {
    "ep4": ["parallel.expert_model_parallel_size=4"],  # EP 2 -> 4, DP 2 -> 4
    "tp2ep2": ["parallel.tensor_model_parallel_size=2", "parallel.expert_model_parallel_size=2"],  # + TP 2, SP
}


@pytest.fixture(scope="module")
def relayouts(ep2_checkpoint, tmp_path_factory, run_dist_jobs):
    """The EP 2 checkpoint resumed and saved again under each of RELAYOUTS, one torchrun of 4 ranks (jobs.py):
    (the saved root by layout, the ranks' output)."""
    tmp = tmp_path_factory.mktemp("relayout")
    dst = {name: str(tmp / name) for name in RELAYOUTS}
    return dst, run_dist_jobs({k: (4, ["resume_relayout.py", "--src", ep2_checkpoint, "--dst", dst[k], *JOB, *layout])
                               for k, layout in RELAYOUTS.items()}, tmp, job_timeout=300)


@pytest.mark.parametrize("layout", list(RELAYOUTS))
def test_resume_under_another_layout_keeps_every_tensor(ep2_checkpoint, relayouts, layout):
    """An EP=2 (DP=2) checkpoint resumed under 4 ranks and saved again at once: weights and Adam
    moments come back bit-identical (global keys), with the step and the data position."""
    dst, printed = relayouts[0][layout], relayouts[1][layout]
    assert printed.count("RELAYOUT rank") == 4 and printed.count("step=2") == 4, printed
    src = dist_checkpoint_to_tensors(iter_dir(ep2_checkpoint, 2))
    got = dist_checkpoint_to_tensors(iter_dir(dst, 2))
    tensors = sorted(k for k, v in src.items() if isinstance(v, torch.Tensor))
    assert tensors == sorted(k for k, v in got.items() if isinstance(v, torch.Tensor))
    moments = [k for k in tensors if k.startswith("optimizer.state.exp_avg")]
    assert len(moments) >= 10 and all(src[k].abs().sum() > 0 for k in moments)  # real Adam state
    assert any(".experts." in k for k in moments)
    for k in tensors:
        assert torch.equal(src[k], got[k]), k
    common = lambda root: read_common(iter_dir(root, 2))
    a, b = common(ep2_checkpoint), common(dst)
    assert a["step"] == b["step"] == 2 and a["extra"]["data"] == b["extra"]["data"]
    assert a["scheduler"] == b["scheduler"]


def test_resume_under_another_layout(tmp_path):
    """A TP=1 checkpoint resumes under TP=2 (weights, Adam moments, data position); an EP change,
    which changes megatron's dense/expert optimizer split, is refused with the way out named."""
    rc, out = train(tmp_path, "l", steps=2)
    assert rc == 0, out[-2000:]
    rc, out = train(tmp_path, "l", "checkpoint.resume=true", "parallel.tensor_model_parallel_size=2", steps=3, nproc=2)
    assert rc == 0 and "resumed from" in out and "step 3/3" in out, out[-3000:]
    rc, out = train(tmp_path, "l", "checkpoint.resume=true", "parallel.expert_model_parallel_size=2", steps=4, nproc=2)
    assert rc != 0
    assert "the optimizer state was saved as 1 megatron optimizer(s) and this layout builds 2" in out
    # our ranks print the message, not a traceback (torchrun adds its own ChildFailedError report)
    assert "checkpoint.load=" in out and "[rank0]: Traceback" not in out and "[rank1]: Traceback" not in out
