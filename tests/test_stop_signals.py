"""Stop signals inside one process: the flag, a long step cut short, the exit-code channel's leftovers,
the end-of-run summary. (Through the launcher and torchrun: test_preemption.py; under a real SLURM:
test_slurm.py; across TP / EP ranks: tests/dist_scripts/stop_generation.py below.)

- PreemptionFlag records the first signal and counts repeats (SLURM delivers most signals twice).
- generate(should_stop=...) stops decoding at the next token and says so (``abandoned``).
- A SIGTERM in the middle of a long generation, or of a dynamic-sampling step whose groups are
  never informative, is honoured within a fraction of the step: the step is abandoned, the last
  completed step is saved (exit 75), or "nothing to save yet" (exit 79) before any step completed;
  the abandoned step's prompts are drawn again, so the resumed run ends with the straight run's
  weights.
"""

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from megatron_gspo import exit_status
from megatron_gspo.checkpoint import latest_complete
from megatron_gspo.config import ParallelConfig, load_job_config, model_config_from_preset
from megatron_gspo.faults import PreemptionFlag
from megatron_gspo.generation import GenerationConfig, generate
from megatron_gspo.hooks import TrainerHook
from megatron_gspo.model import build_model
from megatron_gspo.trainer import TrainingStopped, summarize
from megatron_gspo.train import run_history
from test_reliability import JOB, assert_same, final_weights

HERE = os.path.dirname(os.path.abspath(__file__))
STOP = (signal.SIGTERM, signal.SIGUSR1)


@pytest.fixture
def fresh_flag():
    """The process-wide flag starts unset, and this test process's handlers come back afterwards."""
    saved = {s: signal.getsignal(s) for s in STOP}
    PreemptionFlag._process = None
    yield
    PreemptionFlag._process = None
    for s, h in saved.items():
        signal.signal(s, h)


def test_flag_records_the_first_signal_and_counts_repeats(fresh_flag):
    flag = PreemptionFlag.install()
    assert PreemptionFlag.install() is flag and not flag.set
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGTERM)  # SLURM's copy and the launcher's
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.time() + 5
    while flag.count < 3 and time.time() < deadline:
        time.sleep(0.01)
    assert flag.set and flag.name == "SIGTERM" and flag.count == 3
    assert flag.timing().startswith("signal received ") and flag.timing().endswith("(3 deliveries)")


# ----------------------------------------------------------------------------------------------
# generate(should_stop=...)
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_model():
    from megatron_gspo import parallel

    cfg = model_config_from_preset("tiny", vocab_size=100, moe_aux_loss_coeff=0.0)
    st = parallel.initialize(cfg, ParallelConfig(device="cpu", seed=3))
    yield build_model(cfg, ParallelConfig(device="cpu", seed=3), st), st
    parallel.destroy()


def test_generate_stops_at_the_next_token_when_asked(tiny_model):
    model, st = tiny_model
    cfg = GenerationConfig(max_new_tokens=30, temperature=1.0, n_samples_per_prompt=2, ignore_eos=True)
    prompts = [[1, 2, 3], [4, 5]]
    full = generate(model, prompts, cfg, vocab_size=100, state=st)
    assert not full.abandoned and full.num_forwards == 30 and full.response_lengths.tolist() == [30] * 4
    calls = []

    def after_three() -> bool:  # read before every decode forward: True from the 4th read on
        calls.append(1)
        return len(calls) > 3

    cut = generate(model, prompts, cfg, vocab_size=100, state=st, should_stop=after_three)
    # the prefill and 3 decode forwards ran: 4 tokens per row, the tokens of the full run
    assert cut.abandoned and cut.num_forwards == 4 and len(calls) == 4
    assert cut.response_lengths.tolist() == [4] * 4
    for r, n in enumerate((cut.prompt_lengths + 4).tolist()):
        assert torch.equal(cut.tokens[r, :n], full.tokens[r, :n])


# ----------------------------------------------------------------------------------------------
# The trainer: a step cut short
# ----------------------------------------------------------------------------------------------

LONG = [*JOB, "eval.interval=0", "generation.max_new_tokens=150", "generation.ignore_eos=true",
        "train.prompts_per_step=2", "checkpoint.save_interval=1", "train.num_minibatches=1"]


class SignalAtStep(TrainerHook):
    """SIGTERM to this process ``delay`` s after step ``step`` starts (in its generation)."""

    def __init__(self, step: int, delay: float):
        self.step, self.delay, self.sent_at, self.timer = step, delay, None, None

    def at_step_start(self, trainer) -> None:
        if trainer.step + 1 == self.step:
            self.arm(self.delay)

    def arm(self, delay: float) -> None:
        def send():
            self.sent_at = time.perf_counter()
            os.kill(os.getpid(), signal.SIGTERM)

        self.timer = threading.Timer(delay, send)
        self.timer.start()

    def close(self, trainer) -> None:  # never a stray SIGTERM to the test process after the run
        if self.timer is not None:
            self.timer.cancel()


class SignalInRound(SignalAtStep):
    """SIGTERM a quarter into dynamic-sampling round ``rnd`` (1-based, > 1) of step 1, timed by the
    round before it: the signal lands in that round's decoding however loaded the machine is (a fixed
    delay landed in round 1 when a round took over a second)."""

    def __init__(self, rnd: int):
        super().__init__(step=1, delay=0.0)
        self.rnd = rnd

    def at_step_start(self, trainer) -> None:
        generate_round, took = trainer.rollouts._generate_round, []

        def timed(step, rnd, *args, **kwargs):
            if rnd + 1 == self.rnd:
                self.arm(took[-1] / 4)
            t0 = time.perf_counter()
            out = generate_round(step, rnd, *args, **kwargs)
            took.append(time.perf_counter() - t0)
            return out

        trainer.rollouts._generate_round = timed


def run_job(tmp_path, name, overrides, hooks=()):
    from megatron_gspo import parallel
    from megatron_gspo.trainer import Trainer

    cfg = load_job_config(None, ["parallel.device=cpu", *overrides, f"train.output_dir={tmp_path}/{name}", f"checkpoint.save={tmp_path}/{name}/ckpt"])
    t = Trainer(cfg, hooks=hooks)
    try:
        t.run()
    finally:
        t.close()
        parallel.destroy()


@pytest.mark.slow
def test_a_signal_in_a_long_generation_abandons_the_step_and_the_resume_is_exact(fresh_flag, tmp_path):
    job = [*LONG, "train.num_steps=2"]
    run_job(tmp_path, "straight", job)
    gen_s = min(r["perf/generate_s"] for r in metrics(tmp_path / "straight"))
    hook = SignalAtStep(step=2, delay=gen_s / 4)  # a quarter into the step's generation
    with pytest.raises(TrainingStopped) as stopped:
        run_job(tmp_path, "cut", job, hooks=[hook])
    took = time.perf_counter() - hook.sent_at
    e, msg = stopped.value, str(stopped.value)
    assert e.exit_code == exit_status.EXIT_PREEMPTED, msg
    assert msg.startswith(f"preempted by signal SIGTERM before step 2: checkpoint saved to {tmp_path}/cut/ckpt (step 1)")
    assert "step 2 abandoned in generation round 1, decoding cut short after" in msg, msg
    assert latest_complete(f"{tmp_path}/cut/ckpt") == 1
    assert [r["step"] for r in metrics(tmp_path / "cut")] == [1]
    # the step's generation alone takes gen_s; the stop (decode loop, vote, exit) a fraction of it
    print(f"signal -> stop {took * 1000:.0f} ms; a full step's generation {gen_s:.2f} s")
    assert took < gen_s / 2, (took, gen_s, msg)
    PreemptionFlag._process = None  # the resumed run is a new process
    run_job(tmp_path, "cut", [*job, "checkpoint.resume=true"])
    assert [r["step"] for r in metrics(tmp_path / "cut")] == [1, 2]
    assert_same(final_weights(f"{tmp_path}/straight/ckpt", 2), final_weights(f"{tmp_path}/cut/ckpt", 2))


@pytest.mark.slow
def test_a_signal_in_long_dynamic_sampling_rounds_stops_the_first_step(fresh_flag, tmp_path):
    """No group is ever informative, the round cap is the largest allowed (32) and every response runs
    to its token limit: the step would run 33 rounds. A SIGTERM a quarter into round 3 stops it in that
    round; no step completed, so nothing to save (exit 79)."""
    hook = SignalInRound(3)
    job = [*JOB, "eval.interval=0", "train.dynamic_sampling=true", "train.dynamic_sampling_max_rounds=32",
           "generation.max_new_tokens=40", "generation.ignore_eos=true",
           f"reward.name={HERE}/reward_plugins.py:always_zero", "train.num_steps=2"]
    with pytest.raises(TrainingStopped) as stopped:
        run_job(tmp_path, "ds", job, hooks=[hook])
    took = time.perf_counter() - hook.sent_at
    e, msg = stopped.value, str(stopped.value)
    assert e.exit_code == exit_status.EXIT_PREEMPTED_NOTHING_SAVED, msg
    assert msg.startswith("preempted by signal SIGTERM in step 1: nothing to save yet (no step of this run completed; "
                          "no checkpoint yet"), msg
    rounds = int(msg.split("abandoned in generation round ")[1].split()[0].rstrip(","))
    assert rounds >= 2, msg  # it was in the rounds loop, past the first round
    assert "decoding cut short" in msg, msg  # inside the round's decode loop, not at its end
    print(f"signal -> stop {took * 1000:.0f} ms, in round {rounds}")
    assert took < 1.0, (took, msg)
    assert not os.path.isdir(f"{tmp_path}/ds/ckpt")


def metrics(out) -> list:
    import json

    return [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]


# ----------------------------------------------------------------------------------------------
# Leftovers and the summary
# ----------------------------------------------------------------------------------------------


def test_stale_exit_directories_of_dead_supervisors_are_swept(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f"gspo-exit-{dead.pid}-abc"
    mine = tmp_path / f"gspo-exit-{os.getpid()}-def"  # a live supervisor (this process stands in)
    other = tmp_path / "gspo-exit-oldformat"  # no pid in the name: cannot tell, kept
    unrelated = tmp_path / "something-else"
    for d in (stale, mine, other, unrelated):
        d.mkdir()
        (d / "rank-00000.pid").write_text("1")
    assert exit_status.sweep_stale_exit_dirs(str(tmp_path)) == [str(stale)]
    assert not stale.exists() and mine.exists() and other.exists() and unrelated.exists()


def test_the_summary_covers_the_whole_run_after_a_resume(tmp_path):
    rows = [{"step": s, "rollout/reward_mean": s / 10} for s in range(1, 21)]
    (tmp_path / "metrics.jsonl").write_text("".join(__import__("json").dumps(r) + "\n" for r in rows))
    segment = rows[12:]  # what the resumed process ran itself: steps 13-20
    hist, first = run_history(str(tmp_path), segment, last_step=20)
    assert (hist, first) == (rows, 1)
    assert summarize(hist, first, "gspo") == (
        "mean reward of the first 10 GSPO steps (1-10) 0.550 -> last 10 steps (11-20) 1.550 (+1.000)")
    # without the run's history (another output directory): the segment, named as such
    hist, first = run_history(str(tmp_path / "elsewhere"), segment, last_step=20)
    assert first == 13 and summarize(hist, first, "gspo") == (
        "mean reward of the first 4 GSPO steps (13-16) 1.450 -> last 4 steps (17-20) 1.850 (+0.400) of this run "
        "segment (the run resumed at step 12)")


# ----------------------------------------------------------------------------------------------
# Across ranks
# ----------------------------------------------------------------------------------------------


def test_tp_and_ep_ranks_stop_decoding_together(run_dist):
    """One rank asked to stop: every rank of the lockstep group stops at the same decode step, on
    the rows-still-generating all-reduce the loop already does (no extra collective)."""
    p = run_dist("stop_generation.py", 2, "--layouts", "tp2,ep2")
    for layout in ("tp2", "ep2"):
        for r in range(2):
            assert f"STOP OK {layout} rank {r}" in p.stdout, p.stdout
