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
- A stop signal in any phase of a job (start-up, the SFT warm start, generation, the update,
  evaluation, a checkpoint save, after the last step), once or twice (the second in the shutdown the
  first began), ends it within seconds with the code the phase calls for and a checkpoint the resumed
  run continues to the straight run's weights; the warm start is saved half-way and continued.
- The process's exit status is the decided code whatever number of signals arrive while it shuts
  down (Python resets its handlers to SIG_DFL while finalizing: 130 / 143 before).
"""

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch

from job_runner import stop_when_ready
from launch_modules import supervisor
from megatron_gspo.runtime import exit_status
from megatron_gspo.checkpoint import iter_dir, latest_complete
from megatron_gspo.config import ParallelConfig, load_job_config, model_config_from_preset
from megatron_gspo.runtime.stop import PreemptionFlag
from megatron_gspo.generation.generator import GenerationConfig, generate
from megatron_gspo.trainer.hooks import TrainerHook
from megatron_gspo.model.gpt import build_model
from megatron_gspo.runtime.exit_status import StoppedFor
from megatron_gspo.train import run_history, summarize
from test_reliability import ENV, JOB, assert_same, final_weights

HERE = os.path.dirname(os.path.abspath(__file__))
STOP = (signal.SIGTERM, signal.SIGUSR1)


def new_process_flag():
    """As in a new process: no stop flag yet (the next install makes a fresh one)."""
    flag = PreemptionFlag.of_process()
    if flag is not None:
        flag.release()


@pytest.fixture
def fresh_flag():
    """The process-wide flag starts unset, and this test process's handlers come back afterwards."""
    saved = {s: signal.getsignal(s) for s in STOP}
    new_process_flag()
    yield
    new_process_flag()
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
    from megatron_gspo.runtime import parallel

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
        generate_round, took = trainer.source._generate_round, []

        def timed(step, rnd, *args, **kwargs):
            if rnd + 1 == self.rnd:
                self.arm(took[-1] / 4)
            t0 = time.perf_counter()
            out = generate_round(step, rnd, *args, **kwargs)
            took.append(time.perf_counter() - t0)
            return out

        trainer.source._generate_round = timed


class SignalInDecoding(SignalAtStep):
    """SIGTERM from inside step ``step``'s decode loop, at its ``check``-th check of finished rows: the
    signal lands mid-decoding however loaded the machine is (a timer set to a quarter of a first run's
    generation time missed the generation when a step took 4-24 s)."""

    def __init__(self, step: int, check: int):
        super().__init__(step=step, delay=0.0)
        self.check = check

    def at_step_start(self, trainer) -> None:
        if trainer.step + 1 != self.step:
            return
        generator, calls = trainer.source.generator, [0]
        generate = generator.generate

        def with_signal(*args, should_stop, **kwargs):
            def counted():
                calls[0] += 1
                if calls[0] == self.check:
                    self.sent_at = time.perf_counter()
                    os.kill(os.getpid(), signal.SIGTERM)  # its handler runs before the next bytecode
                return should_stop()

            return generate(*args, should_stop=counted, **kwargs)

        generator.generate = with_signal


def run_job(tmp_path, name, overrides, hooks=()):
    from megatron_gspo.runtime import parallel
    from megatron_gspo.trainer.loop import Trainer

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
    hook = SignalInDecoding(step=2, check=30)  # token 30 of 150 (a check a token on a CPU, every 4 on CUDA)
    with pytest.raises(StoppedFor) as stopped:
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
    new_process_flag()  # the resumed run is a new process
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
    with pytest.raises(StoppedFor) as stopped:
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
# Every phase of a job, once or twice
# ----------------------------------------------------------------------------------------------

# 6 SFT steps, 3 RL steps, a checkpoint after each, an evaluation after step 2 (and after the last)
PHASE_JOB = [*JOB, "train.sft_steps=6", "train.sft_batch_size=8", "eval.interval=2", "eval.num_prompts=8",
             "eval.num_samples=2", "eval.k=2", "train.num_steps=3", "checkpoint.save_interval=1"]
# phase -> (exit code, newest checkpoint afterwards (None: no checkpoint directory), its SFT step or None,
# how the stop line says when the signal came)
PHASES = {
    "start-up": (exit_status.EXIT_PREEMPTED_NOTHING_SAVED, None, None, "during start-up"),  # the model's build
    # as SFT step 3 of 6 begins: that step ends, the warm start is saved as step 0 and continued by the resume
    "sft": (exit_status.EXIT_PREEMPTED, 0, 3, "in the SFT warm start after SFT step 3 of 6"),
    "generation": (exit_status.EXIT_PREEMPTED, 1, None, "step 2 abandoned in generation round 1"),
    # after the generation: advantages, old / reference log-probs; the step is left before its update
    "rollout-tail": (exit_status.EXIT_PREEMPTED, 1, None, "step 2 abandoned before its update (rollout done)"),
    "update": (exit_status.EXIT_PREEMPTED, 2, None, "between steps 2 and 3"),  # runs to its end: step 2 saved
    "evaluation": (exit_status.EXIT_PREEMPTED, 2, None, "between steps 2 and 3"),  # abandoned; step 2 stands
    "save": (exit_status.EXIT_PREEMPTED, 2, None, "between steps 2 and 3"),  # it ends; not written twice
    "after-last-step": (0, 3, None, None),  # in the final save: the run is complete, exit 0
}


class PhaseSignal(TrainerHook):
    """SIGTERM to this process as the job enters ``phase`` (a wrapper around the code of that phase, so
    it lands there however loaded the machine is) and, with ``twice``, again when the trainer closes:
    in the shutdown the first signal began, after the exit code was decided."""

    def __init__(self, phase: str, twice: bool, monkeypatch):
        self.phase, self.twice, self.sent_at = phase, twice, None
        if phase == "start-up":
            from megatron_gspo.trainer import components as trainer_components

            self._wrap_once(monkeypatch, trainer_components, "build_model", lambda: True)
        elif phase == "sft":  # as SFT step 3 begins (one micro-batch, so one forward, per SFT step)
            from megatron_gspo.trainer import sft

            calls = []
            self._wrap_once(monkeypatch, sft, "forward_logprobs", lambda: calls.append(1) or len(calls) == 3)

    def _wrap_once(self, monkeypatch, owner, name, when):
        original = getattr(owner, name)

        def wrapped(*args, **kwargs):
            if self.sent_at is None and when():
                self.send()
            return original(*args, **kwargs)

        monkeypatch.setattr(owner, name, wrapped)

    def send(self) -> None:
        self.sent_at = time.perf_counter()
        os.kill(os.getpid(), signal.SIGTERM)

    def before_training(self, trainer) -> None:
        at_step = lambda n: lambda: trainer.step + 1 == n  # noqa: E731 (inside step n)
        mp = pytest.MonkeyPatch()  # instance attributes of this trainer only: gone with it
        if self.phase == "generation":
            self._wrap_once(mp, trainer.source, "_generate_round", at_step(2))
        elif self.phase == "rollout-tail":
            self._wrap_once(mp, trainer.prepare, "_plan", at_step(2))  # the batch preparation begins
        elif self.phase == "update":
            self._wrap_once(mp, trainer, "train_on", at_step(2))
        elif self.phase == "evaluation":
            self._wrap_once(mp, trainer.evaluator, "_answer", lambda: trainer.step == 2)

    def during_save(self, trainer, tmp_dir: str) -> None:
        if self.sent_at is None and ((self.phase == "save" and trainer.step == 2)
                                     or (self.phase == "after-last-step" and trainer.step == 3)):
            self.send()

    def close(self, trainer) -> None:
        if self.twice and self.sent_at is not None:
            os.kill(os.getpid(), signal.SIGTERM)


def run_to_code(tmp_path, name, overrides, hooks=()) -> int:
    """The job in this process as ``python -m megatron_gspo.train`` runs it (train.run_trainer): its exit code."""
    from megatron_gspo.trainer.loop import Trainer
    from megatron_gspo.train import run_trainer

    PreemptionFlag.install()  # first, as train.main does (SIGTERM / SIGUSR1: pytest keeps its Ctrl-C)
    cfg = load_job_config(None, ["parallel.device=cpu", *overrides, f"train.output_dir={tmp_path}/{name}", f"checkpoint.save={tmp_path}/{name}/ckpt"])
    return run_trainer(Trainer(cfg, hooks=hooks))


@pytest.fixture(scope="module")
def phase_straight(tmp_path_factory):
    """The uninterrupted job: the final weights every resumed one must reach, and its slowest step."""
    saved = {s: signal.getsignal(s) for s in STOP}
    new_process_flag()
    tmp = tmp_path_factory.mktemp("phases")
    assert run_to_code(tmp, "straight", PHASE_JOB) == 0
    for s, h in saved.items():
        signal.signal(s, h)
    new_process_flag()
    slowest = max(r["perf/step_time_s"] + r.get("perf/eval_s", 0.0) for r in metrics(tmp / "straight"))
    return final_weights(f"{tmp}/straight/ckpt", 3), slowest


@pytest.mark.slow
@pytest.mark.parametrize("twice", [False, True], ids=["once", "twice"])
@pytest.mark.parametrize("phase", list(PHASES))
def test_a_stop_signal_in_any_phase_stops_within_seconds_and_resumes_exactly(fresh_flag, tmp_path, monkeypatch,
                                                                              phase_straight, phase, twice):
    from log_capture import LogLines

    weights, slowest = phase_straight
    code, newest, sft_step, when = PHASES[phase]
    hook = PhaseSignal(phase, twice, monkeypatch)
    with LogLines() as said:
        got = run_to_code(tmp_path, "cut", PHASE_JOB, hooks=[hook])
    took = time.perf_counter() - hook.sent_at
    monkeypatch.undo()
    stop = [line for line in said.lines if line.startswith("preempted by signal")]
    assert got == code, (got, stop, said.lines[-5:])
    if code:  # one stop line, naming when the signal came; a second delivery is counted, never acted on
        assert len(stop) == 1 and f", {when}" in stop[0], (when, said.lines[-8:])
    else:
        assert not stop and any("the run is complete (step 3 saved); exiting with 0" in x for x in said.lines)
    root = f"{tmp_path}/cut/ckpt"
    if newest is None:
        assert not os.path.isdir(root)
    else:
        assert latest_complete(root) == newest
        from megatron.core import dist_checkpointing

        extra = dist_checkpointing.load_common_state_dict(iter_dir(root, newest))["extra"]
        assert (extra.get("sft") or {}).get("step") == sft_step, extra.get("sft")
    # within seconds: a fraction of what the phase's step takes on this machine, plus its save
    print(f"{phase} x{1 + twice}: exit {got}, signal -> return {took:.2f} s (slowest straight step {slowest:.2f} s)")
    assert took < 2 * slowest + 5, (took, slowest)
    if phase == "evaluation":  # the abandoned evaluation left step 2's row without eval/*, the step stands
        assert [("eval/greedy_accuracy" in r) for r in metrics(tmp_path / "cut")] == [False, False]
    new_process_flag()  # the resumed run is a new process
    with LogLines() as said:
        assert run_to_code(tmp_path, "cut", [*PHASE_JOB, "checkpoint.resume=true"]) == 0
    if phase == "sft":
        assert f"resumed the supervised warm start from {iter_dir(root, 0)} at SFT step 3 of 6" in said.lines
    assert [r["step"] for r in metrics(tmp_path / "cut")] == [1, 2, 3]
    assert_same(weights, final_weights(root, 3))


@pytest.mark.slow
def test_a_warm_start_stopped_twice_continues_to_the_straight_weights(fresh_flag, tmp_path, monkeypatch,
                                                                       phase_straight):
    """Stopped at SFT step 2, resumed, stopped again at SFT step 5 (its checkpoint of step 0 is written
    again, the older copy moved aside until the new one is in place), resumed: the straight weights."""
    from megatron.core import dist_checkpointing

    from megatron_gspo.trainer import sft

    original = sft.forward_logprobs  # one micro-batch, so one forward, per SFT step
    root = f"{tmp_path}/cut/ckpt"
    for stop_after, resume in ((2, []), (5, ["checkpoint.resume=true"])):
        calls = []

        def forward(*args, stop_at=stop_after - (2 if resume else 0), **kwargs):
            calls.append(1)
            if len(calls) == stop_at:  # in the forward of SFT step ``stop_after``: that step ends, then the stop
                os.kill(os.getpid(), signal.SIGTERM)
            return original(*args, **kwargs)

        monkeypatch.setattr(sft, "forward_logprobs", forward)
        assert run_to_code(tmp_path, "cut", [*PHASE_JOB, *resume]) == exit_status.EXIT_PREEMPTED
        new_process_flag()
        assert dist_checkpointing.load_common_state_dict(iter_dir(root, 0))["extra"]["sft"]["step"] == stop_after
        assert sorted(os.listdir(root)) == ["iter_0000000", "latest_checkpointed_iteration.txt"]
    monkeypatch.undo()
    assert run_to_code(tmp_path, "cut", [*PHASE_JOB, "checkpoint.resume=true"]) == 0
    assert_same(phase_straight[0], final_weights(f"{tmp_path}/cut/ckpt", 3))


# ----------------------------------------------------------------------------------------------
# The process's exit status, whatever number of signals arrive
# ----------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_signals_until_the_process_is_gone_exit_75(tmp_path, sig):
    """``python -m megatron_gspo.train`` after its second checkpoint: a signal every 50 ms until the process
    has exited, so that some land in every moment of its shutdown (the save, the teardown, the interpreter's
    finalization): the status is 75, the stop is said once, no traceback."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_gspo.train", *JOB, "eval.interval=0", "train.num_steps=200",
           f"train.output_dir={out}", f"checkpoint.save={out}/ckpt", "checkpoint.save_interval=1"]
    with open(tmp_path / "log", "w") as log:
        p = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=ENV, start_new_session=True)
        try:
            deadline = time.time() + 300
            while (latest_complete(f"{out}/ckpt") or 0) < 2:
                assert p.poll() is None and time.time() < deadline, (tmp_path / "log").read_text()[-3000:]
                time.sleep(0.1)
            sent = 0
            while p.poll() is None and sent < 2000:
                p.send_signal(sig)
                sent += 1
                time.sleep(0.05)
            rc = p.wait(timeout=120)
        finally:
            if p.poll() is None:
                p.kill()
    text = (tmp_path / "log").read_text()
    print(f"{sent} x {sig.name}: exit {rc}")
    assert rc == exit_status.EXIT_PREEMPTED and sent >= 2, (rc, sent, text[-3000:])
    assert len([ln for ln in text.splitlines() if " preempted by signal" in ln]) == 1, text[-3000:]
    assert "Traceback" not in text and "KeyboardInterrupt" not in text, text[-3000:]
    assert latest_complete(f"{out}/ckpt") >= 2


@pytest.mark.slow
def test_a_stop_signal_while_reasoning_gym_examples_are_made_ends_start_up_within_seconds(tmp_path):
    """``python -m megatron_gspo.train`` on zebra_puzzles (a tenth of a second or more per example; its start-up
    makes 1064: the reference answers' check and the held-out set) says its progress every few seconds; a
    SIGTERM after the first progress line ends it within seconds, exit 79 (nothing to save), with one stop line
    saying where, and the examples made so far in the cache for the requeued job."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "megatron_gspo.train", "data.source=reasoning_gym:zebra_puzzles", "parallel.device=cpu",
           f"train.output_dir={out}", "train.tensorboard=false"]
    rc, said, took = stop_when_ready(cmd, ENV, tmp_path / "log",
                                     ready=lambda: " examples made (" in (tmp_path / "log").read_text())
    text = (tmp_path / "log").read_text()
    print(f"SIGTERM while making examples: the stop line {said} s later, exit {rc} {took:.1f} s later")
    # the stop is decided at the next example; the process's exit then tears down torch.distributed and
    # megatron (about 10 s on a loaded 2-core machine, the same after any start-up error)
    assert rc == exit_status.EXIT_PREEMPTED_NOTHING_SAVED and said is not None and said < 5 and took < 30, \
        (rc, said, took, text[-3000:])
    progress = [ln for ln in text.splitlines() if " examples made (" in ln]
    assert progress[0].split(" ", 1)[1].startswith("reasoning_gym:zebra_puzzles: ") and "/1064 examples made (" in \
        progress[0] and "/s, about " in progress[0] and progress[0].endswith(" left)"), progress
    stop = [ln for ln in text.splitlines() if "preempted by signal" in ln]
    assert len(stop) == 1 and "preempted by signal SIGTERM during start-up: nothing to save yet" in stop[0], text[-3000:]
    made = int(stop[0].split("while making reasoning_gym:zebra_puzzles examples (")[1].split(" of 1064 made")[0])
    path = stop[0].split(", kept in ")[1].split(":")[0]
    assert "Traceback" not in text and made >= int(progress[0].split("/1064")[0].rsplit(" ", 1)[1]), text[-3000:]
    from megatron_gspo.data.example_cache import ExampleCache

    with open(path) as f:
        key = json.load(f)["key"]
    assert len(ExampleCache(os.path.dirname(path), "zebra_puzzles", key).load()) == made


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
    assert supervisor.sweep_stale_exit_dirs(str(tmp_path)) == [str(stale)]
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
    # a plug-in loss by its path as written (it was upper-cased: TESTS/LOSS_PLUGINS.PY:...)
    assert summarize(hist, first, "tests/loss_plugins.py:spo_loss").startswith(
        "mean reward of the first 4 tests/loss_plugins.py:spo_loss steps (13-16)")


def test_too_many_skips_without_checkpoint_save_says_nothing_was_saved(tmp_path, monkeypatch):
    """Issue 47: the stop line said "the last good state was saved to (checkpoint.save not set)"."""
    from jobs_in_process import TINY_JOB, run_main

    monkeypatch.setenv("MEGATRON_GSPO_FAULTS", "nan_logprob@2")
    code, errors, lines = run_main(TINY_JOB + ["train.num_steps=3", "train.num_minibatches=1",
                                               "train.max_consecutive_skips=1", f"train.output_dir={tmp_path}"])
    assert code == exit_status.EXIT_TOO_MANY_SKIPS, lines[-10:]
    said = [ln for ln in lines if "consecutive updates had non-finite loss or gradients" in ln]
    assert said and said[-1].endswith(
        "at step 2; NO checkpoint written (checkpoint.save is not set) (step 1, the last completed one)"), said


# ----------------------------------------------------------------------------------------------
# One exception for work cut short, one handler
# ----------------------------------------------------------------------------------------------


def test_every_place_that_cuts_work_short_raises_the_one_cancellation(tmp_path):
    """The stop flag read while examples are made, while a worker pool runs, while a per-sample, a pooled or the
    math reward scores, and the ranks' vote on it: each raises runtime.stop.Cancelled (nothing else), saying
    where; the examples made until then are kept in the caller's dict."""
    from megatron_gspo.config import RewardConfig
    from megatron_gspo.data.example_cache import make_examples
    from megatron_gspo.data.rewards import build_reward, compute_rewards
    from megatron_gspo.runtime.stop import Cancelled, raise_together
    from megatron_gspo.runtime.workers import Request, WorkerPool

    made: dict = {}
    with pytest.raises(Cancelled) as cut:
        make_examples("reasoning_gym:toy", lambda i: {"i": i}, range(5), made, should_stop=lambda: len(made) >= 2)
    assert cut.value.where == "while making reasoning_gym:toy examples" and made == {0: {"i": 0}, 1: {"i": 1}}
    pool = WorkerPool(1, "megatron_gspo.data.rewards.worker:reward_handler", {"name": "exact_match", "settings": {}})
    with pytest.raises(Cancelled) as cut:
        pool.run([Request(("q", "1", "1"))], None, should_stop=lambda: True)
    assert cut.value.where == "while the worker pool ran requests" and pool.pids == []
    for name, workers in (("exact_match", 1), (f"{HERE}/reward_plugins.py:digit_fraction", 2), ("math", 1)):
        reward = build_reward(RewardConfig(name=name, num_workers=workers))
        try:
            with pytest.raises(Cancelled) as cut:
                compute_rewards(reward, ["q"] * 3, ["1", "2", "3"], ["1"] * 3, should_stop=lambda: True)
        finally:
            reward.close()
        assert cut.value.where.startswith("while "), (name, cut.value.where)
    raise_together(False, torch.device("cpu"), "in generation round 1", 2, what="test: nobody stops")
    with pytest.raises(Cancelled) as cut:
        raise_together(True, torch.device("cpu"), "in generation round 1", 2, what="test: a stop")
    assert (cut.value.where, cut.value.step, str(cut.value)) == ("in generation round 1", 2,
                                                                "step 2 abandoned in generation round 1")


@pytest.mark.parametrize("where", ["scoring", "scoring-in-workers", "evaluation"])
def test_a_stop_while_scoring_or_evaluating_is_handled_at_the_step_boundary(fresh_flag, tmp_path, where):
    """A SIGTERM as the 3rd response of step 2 is scored (in this process, or in a reward worker process), or as
    the 2nd held-out answer of the evaluation after step 1 is: the work raises Cancelled, the loop hands it to
    StopControl, and the job ends with the stop line and exit code a stop there always had: step 2 abandoned
    while scoring round 1 (step 1 stands, exit 75), or the evaluation dropped with its warning, step 1 logged
    without eval/*, the stop at the next boundary."""
    from jobs_in_process import TINY_JOB, run_main

    out = tmp_path / "run"
    call = 16 + (2 if where == "evaluation" else 3)  # step 1 scores 16 responses
    job = [*TINY_JOB, "train.num_steps=3", f"train.output_dir={out}",
           f"reward.name={HERE}/reward_plugins.py:sigterm_at", f"reward.kwargs.call={call}",
           f"reward.kwargs.marker={tmp_path}/scored", f"reward.kwargs.pid={os.getpid()}",
           *(["reward.num_workers=2"] if where == "scoring-in-workers" else []),
           *(["eval.interval=1", "eval.num_prompts=4", "eval.num_samples=0"] if where == "evaluation" else [])]
    code, errors, lines = run_main(job)
    stop = [ln for ln in lines if "preempted by signal" in ln]
    assert code == exit_status.EXIT_PREEMPTED and len(stop) == 1 and not errors, lines[-10:]
    assert stop[0].startswith("preempted by signal SIGTERM before step 2: NO checkpoint written (checkpoint.save is "
                              "not set) (step 1); exiting with 75 (resume with checkpoint.resume=true); signal received "), stop
    rows = metrics(out)
    assert [r["step"] for r in rows] == [1], rows
    scorers = set((tmp_path / "scored").read_text().split())
    assert (str(os.getpid()) not in scorers) == (where == "scoring-in-workers"), scorers
    if where == "evaluation":
        dropped = [ln for ln in lines if "evaluation after step 1 abandoned" in ln]
        assert len(dropped) == 1 and dropped[0].startswith("SIGTERM: evaluation after step 1 abandoned in its greedy "
                                                           "pass, while scoring after "), dropped
        assert dropped[0].endswith(" s; step 1 stands, without eval/* metrics"), dropped
        assert ", between steps 1 and 2, save " in stop[0] and not any(k.startswith("eval/") for k in rows[0]), stop
    else:
        assert ", step 2 abandoned while scoring round 1 after " in stop[0], stop


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
