"""Preemption and exit codes through the launchers people run: `bash launch/pretrain_gspo.sh` (2 ranks
under torchrun), the sbatch script (srun faked: it runs its task and passes signals on, as srun
does) and a bare torchrun. Real processes: signals go to the torchrun or rank processes found in
the process table, and the table is checked afterwards for anything the run left behind (every
process a run starts inherits a marker in its environment)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from megatron_gspo.checkpoint import iter_dir, latest_complete
from megatron_gspo.runtime.stop import EXIT_PREEMPTED, EXIT_PREEMPTED_NOTHING_SAVED, EXIT_TOO_MANY_SKIPS
from test_launch import BASH, LAUNCHER, ROOT, SBATCH, clean_env, fake_bin
from test_reliability import JOB, assert_same, final_weights

pytestmark = pytest.mark.slow  # trainer subprocesses under torchrun / the launcher

# Periodic checkpoints every 2 steps; runs are interrupted once the second one (step 4) is complete,
# with 6 steps still to go, so that the signal lands mid-run even on a loaded machine.
STEPS, EVERY = 10, 2
TINY_YAML = str(Path("launch") / "recipes" / "tiny_cpu.yaml")
MARKER = "GSPO_TEST_MARKER"


def marked(marker: str, env_key: str | None = None) -> list[psutil.Process]:
    """Live (non-zombie) processes whose environment carries ``marker`` (and ``env_key`` when given).
    The environment is read once, here, where a process that ends meanwhile is skipped: read again by a
    caller it could be gone (psutil.NoSuchProcess)."""
    out = []
    for p in psutil.process_iter():
        try:
            env = p.environ()
            if p.status() != psutil.STATUS_ZOMBIE and env.get(MARKER) == marker and (env_key is None or env_key in env):
                p.env = env
                out.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, psutil.ZombieProcess):
            continue
    return out


class Run:
    """One command in a session of its own, output to a file; every process it starts is marked."""

    def __init__(self, tmp: Path, name: str, cmd: list[str], **env):
        self.marker = f"{name}-{uuid.uuid4().hex}"
        logs = tmp / "logs"
        logs.mkdir(exist_ok=True)
        self.log_path = logs / f"{name}-{len(list(logs.iterdir()))}.log"
        self.log = open(self.log_path, "w")
        self.p = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, cwd=ROOT, start_new_session=True,
                                  env=clean_env(**{MARKER: self.marker, **env}))

    def torchrun(self) -> psutil.Process:
        procs = [p for p in marked(self.marker) if "torch.distributed.run" in " ".join(p.cmdline())]
        found = [p for p in procs if p.ppid() == self.p.pid] or [p for p in procs if p.pid == self.p.pid]
        assert len(found) == 1, procs  # the launcher's child (the supervisor runs torchrun, it does not exec it)
        return found[0]

    def ranks(self) -> list[psutil.Process]:
        tr = self.torchrun()
        return sorted((p for p in marked(self.marker, "RANK") if p.ppid() == tr.pid), key=lambda p: int(p.env["RANK"]))

    def wait(self, timeout: float = 400) -> tuple[int, str]:
        try:
            rc = self.p.wait(timeout=timeout)
        finally:
            if self.p.poll() is None:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
            self.log.close()
        return rc, self.log_path.read_text()

    def leftovers(self, grace_s: float = 10.0) -> list[str]:
        """What of this run is still alive ``grace_s`` after it returned (then killed, by pid)."""
        deadline = time.time() + grace_s
        while (alive := marked(self.marker)) and time.time() < deadline:
            time.sleep(0.2)
        found = [f"{p.pid}: {' '.join(p.cmdline())[:160]}" for p in alive]
        for p in alive:
            p.kill()
        return found


def launcher(tmp: Path, name: str, *overrides: str, nproc: int = 2, steps: int = STEPS, **env) -> Run:
    out = tmp / name
    args = [TINY_YAML, *JOB, f"train.num_steps={steps}", f"train.output_dir={out}", f"checkpoint.save={out}/ckpt",
            f"checkpoint.save_interval={EVERY}", *overrides]
    return Run(tmp, name, [BASH, str(LAUNCHER), *args], NPROC=nproc, **env)


def wait_for_checkpoint(run: Run, root: str, step: int, timeout: float = 300) -> None:
    deadline = time.time() + timeout
    while (latest_complete(root) or 0) < step:
        assert run.p.poll() is None, run.log_path.read_text()[-3000:]
        assert time.time() < deadline, "no checkpoint in time"
        time.sleep(0.2)


def metric_steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def last_line(log: str) -> str:
    return [ln for ln in log.splitlines() if ln.strip()][-1]


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """The uninterrupted 2-rank run through the launcher: the weights every resumed run must match."""
    tmp = tmp_path_factory.mktemp("straight")
    rc, log = launcher(tmp, "s").wait()
    assert rc == 0, log[-3000:]
    return final_weights(f"{tmp}/s/ckpt", STEPS)


def test_a_stop_while_one_ranks_environment_reset_hangs_ends_every_rank_together(tmp_path):
    """A multi-turn job at DP 2 whose environment hangs in reset on rank 0 only (rank 1's resets answer, so
    rank 1 is already at the first turn's vote): SIGTERM to every process; the pool kills rank 0's worker,
    both ranks leave step 1 at that vote, exit 79 (nothing saved yet), one stop line, no traceback, no
    rank left waiting in a collective."""
    from test_multiturn import STOPS

    marker = tmp_path / "reset-pid"
    here = str(Path(__file__).resolve().parent)
    run = launcher(tmp_path, "r", "env.name=multiturn_envs:HangingReset", f"env.kwargs={{marker: {marker}}}",
                   "env.max_turns=2", "env.num_workers=1", "env.tool_timeout_s=600", f"generation.stop_token_ids={STOPS}",
                   "eval.interval=0", steps=2, PYTHONPATH=os.pathsep.join([here, os.environ.get("PYTHONPATH", "")]))
    deadline = time.time() + 300
    while not (marker.exists() and marker.read_text()):
        assert run.p.poll() is None and time.time() < deadline, run.log_path.read_text()[-3000:]
        time.sleep(0.1)
    worker = int(marker.read_text())
    sent = time.time()
    for p in [psutil.Process(run.p.pid), run.torchrun(), *run.ranks()]:
        p.send_signal(signal.SIGTERM)
    rc, log = run.wait(timeout=120)
    took = time.time() - sent
    print(f"SIGTERM while rank 0's environment reset hangs: exit {rc} {took:.1f} s later")
    assert rc == EXIT_PREEMPTED_NOTHING_SAVED and took < 60, (rc, took, log[-4000:])
    stops = re.findall(r"^\d\d:\d\d:\d\d (preempted by signal .*)$", log, re.M)
    assert len(stops) == 1 and "in step 1" in stops[0] and "over turns" in stops[0], log[-4000:]
    for bad in ("Traceback", "ChildFailedError", "timed out", "Connection reset"):
        assert bad not in log, log[-4000:]
    with pytest.raises(psutil.NoSuchProcess):  # the worker that hung is gone
        psutil.Process(worker).status()
    assert run.leftovers() == []


@pytest.mark.parametrize("target, sig", [("everyone", signal.SIGTERM), ("rank 1", signal.SIGTERM),
                                         ("torchrun", signal.SIGKILL)],
                         ids=["sigterm-everyone", "sigterm-one-rank", "sigkill-torchrun"])
def test_preempted_under_the_launcher_checkpoints_exits_75_and_resumes_exactly(tmp_path, straight, target, sig):
    """After 2 periodic checkpoints: SIGTERM to every process of the run at once (what SLURM does to
    a job step: the launcher, torchrun and the ranks, which then get it twice), to one rank only (the
    other follows through the vote), or SIGKILL to torchrun (its workers would carry on unsupervised:
    the launcher sends them SIGTERM). Each time the ranks save the step they are at, the launcher
    exits 75, the stop is logged once and torchrun says nothing (it ignores the stop signals)."""
    run = launcher(tmp_path, "p")
    root = f"{tmp_path}/p/ckpt"
    wait_for_checkpoint(run, root, EVERY)
    ranks = run.ranks()  # found before: signalled at once
    targets = {"everyone": [psutil.Process(run.p.pid), run.torchrun(), *ranks], "rank 1": ranks[1:],
               "torchrun": [run.torchrun()]}[target]
    wait_for_checkpoint(run, root, 2 * EVERY)
    for p in targets:
        p.send_signal(sig)
    rc, log = run.wait()
    assert rc == EXIT_PREEMPTED, log[-4000:]
    step = metric_steps(tmp_path / "p")[-1]  # the step the ranks had finished
    assert latest_complete(root) == step, (step, sorted(os.listdir(root)))
    stops = re.findall(r"^\d\d:\d\d:\d\d (preempted by signal .*)$", log, re.M)
    assert len(stops) == 1, log[-4000:]  # once (rank 0's line), however many deliveries
    sig_name = "(on another rank)" if target == "rank 1" else "SIGTERM"
    assert stops[0].startswith(f"preempted by signal {sig_name} before step {step + 1}: checkpoint saved to {root}")
    assert last_line(log).startswith("pretrain_gspo.sh: exit 75 (preempted: a checkpoint was written"), log[-2000:]
    for bad in ("Traceback", "ChildFailedError", "SignalException", "death signal", "Logging error"):
        assert bad not in log, log[-4000:]
    assert not [d for d in os.listdir(root) if d.endswith(".tmp")]
    assert run.leftovers() == []
    rc, log = launcher(tmp_path, "p", "checkpoint.resume=true").wait()
    assert rc == 0, log[-3000:]
    assert f"resumed from {iter_dir(root, step)} at step {step}" in log
    assert metric_steps(tmp_path / "p") == list(range(1, STEPS + 1))
    # the summary is the whole run's, not the resumed segment's
    assert re.search(r"mean reward of the first 5 GSPO steps \(1-5\) \S+ -> last 5 steps \(6-10\)", log), log[-2000:]
    assert_same(straight, final_weights(root, STEPS))


def test_a_signal_during_start_up_ends_with_nothing_to_save_and_79(tmp_path):
    """SIGUSR1 to the launcher while its ranks are still starting (before the trainer exists: a
    --time shorter than SLURM's signal lead): the ranks get it once they can take it, stop before
    step 1 with "nothing to save yet" and exit 79; no traceback, no checkpoint, nothing left behind."""
    run = launcher(tmp_path, "s")
    deadline = time.time() + 120
    while not marked(run.marker, "RANK"):  # a rank process exists
        assert run.p.poll() is None and time.time() < deadline, run.log_path.read_text()[-3000:]
        time.sleep(0.05)
    run.p.send_signal(signal.SIGUSR1)
    rc, log = run.wait()
    assert rc == EXIT_PREEMPTED_NOTHING_SAVED, log[-4000:]
    stops = re.findall(r"^\d\d:\d\d:\d\d (preempted by signal .*)$", log, re.M)
    assert len(stops) == 1 and stops[0].startswith("preempted by signal SIGUSR1 during start-up: nothing to save yet"), log
    assert stops[0].endswith("during start-up"), stops[0]
    assert last_line(log).startswith("pretrain_gspo.sh: exit 79 (preempted before a step completed"), log[-2000:]
    for bad in ("Traceback", "ChildFailedError", "SignalException", "death signal"):
        assert bad not in log, log[-4000:]
    assert not os.path.exists(f"{tmp_path}/s/ckpt") and not os.path.exists(f"{tmp_path}/s/metrics.jsonl")
    assert run.leftovers() == []


def readme_multi_rank_example() -> list[str]:
    """The README's multi-rank command (its Configuration section's code block), as words."""
    import shlex

    text = (Path(ROOT) / "README.md").read_text()
    block = text.split("## Configuration", 1)[1].split("```bash", 1)[1].split("```", 1)[0]
    lines = [ln for ln in block.splitlines() if "torchrun" in ln or "NPROC=" in ln or "pretrain_gspo.sh" in ln]
    assert len(lines) == 1, block
    return shlex.split(lines[0])


def test_the_readmes_multi_rank_example_stops_cleanly_on_sigterm(tmp_path):
    """SIGTERM to the process the README's multi-rank example starts (what `kill`, Ctrl-C or a scheduler
    sends to the command a user ran): the ranks save the step they are at and the command exits 75 with
    one line, no traceback, nothing left running (a bare torchrun would give rc 1 and a SignalException
    traceback after the ranks saved)."""
    words = readme_multi_rank_example()
    env = {}
    while re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, value = words.pop(0).split("=", 1)
        env[key] = value
    assert words[:2] == ["bash", "launch/pretrain_gspo.sh"], f"the README's multi-rank example is not the launcher: {words}"
    out = tmp_path / "readme"
    cmd = [BASH, str(LAUNCHER), *words[2:], *JOB, "train.num_steps=40", f"train.output_dir={out}",
           f"checkpoint.save={out}/ckpt", "checkpoint.save_interval=1"]
    run = Run(tmp_path, "readme", cmd, **env)
    wait_for_checkpoint(run, f"{out}/ckpt", 2, timeout=400)
    run.p.send_signal(signal.SIGTERM)
    rc, log = run.wait()
    assert rc == EXIT_PREEMPTED, log[-4000:]
    assert last_line(log).startswith("pretrain_gspo.sh: exit 75 (preempted: a checkpoint was written"), log[-2000:]
    for bad in ("Traceback", "SignalException", "ChildFailedError"):
        assert bad not in log, log[-4000:]
    step = metric_steps(out)[-1]
    assert latest_complete(f"{out}/ckpt") == step
    assert run.leftovers() == []


def test_bare_torchrun_on_sigterm_behaves_as_documented(tmp_path):
    """What README.md and docs/multinode.md say of a bare torchrun: SIGTERM to torchrun reaches every rank,
    which saves the step it is at (its stop line says exit 75), and torchrun itself ends with its
    SignalException traceback and status 1."""
    out = tmp_path / "bare"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m",
           "megatron_gspo.train", *JOB, "train.num_steps=40", f"train.output_dir={out}", f"checkpoint.save={out}/ckpt",
           "checkpoint.save_interval=1"]
    run = Run(tmp_path, "bare", cmd)
    wait_for_checkpoint(run, f"{out}/ckpt", 2)
    run.p.send_signal(signal.SIGTERM)
    rc, log = run.wait()
    assert rc == 1 and "SignalException" in log and "Received 15 death signal, shutting down workers" in log, log[-3000:]
    stops = re.findall(r"^\d\d:\d\d:\d\d (preempted by signal SIGTERM before step (\d+): .*exiting with 75.*)$", log, re.M)
    assert len(stops) == 1, log[-3000:]
    assert latest_complete(f"{out}/ckpt") == int(stops[0][1]) - 1
    assert run.leftovers() == []
    for doc in ("README.md", "docs/multinode.md"):
        text = " ".join((Path(ROOT) / doc).read_text().split())
        assert "SignalException" in text and "status 1" in text, doc


def test_sigkill_of_a_rank_leaves_no_process_and_the_newest_checkpoint(tmp_path, straight):
    """A rank killed outright cannot save: the run fails with torchrun's code and report, no
    process of it survives (the checkpoint writer's helper processes included), and
    the resume starts from the newest complete checkpoint and ends where the straight run does."""
    run = launcher(tmp_path, "k")
    root = f"{tmp_path}/k/ckpt"
    wait_for_checkpoint(run, root, EVERY)
    victim = run.ranks()[1]
    wait_for_checkpoint(run, root, 2 * EVERY)
    victim.send_signal(signal.SIGKILL)
    rc, log = run.wait()
    assert run.leftovers() == []
    assert rc == 1, log[-3000:]
    assert "Signal 9 (SIGKILL) received by PID" in log  # torchrun's report, shown: nothing replaces it
    assert last_line(log).startswith("pretrain_gspo.sh: torchrun exited with status 1: a rank failed without an exit code")
    newest = latest_complete(root)
    assert newest >= 2 * EVERY
    rc, log = launcher(tmp_path, "k", "checkpoint.resume=true").wait()
    assert rc == 0, log[-3000:]
    assert f"resumed from {iter_dir(root, newest)} at step {newest}" in log
    assert metric_steps(tmp_path / "k") == list(range(1, STEPS + 1))  # re-run steps logged once
    assert_same(straight, final_weights(root, STEPS))


def test_sigkill_of_a_single_process_trainer_leaves_no_process(tmp_path):
    """Without torchrun nobody cleans the process group up: a SIGKILLed trainer must leave no helper
    process running (no checkpoint writer's Manager server, no multiprocessing resource tracker), and a
    resume takes the newest complete checkpoint."""
    out = tmp_path / "one"
    args = [*JOB, "train.num_steps=8", f"train.output_dir={out}", f"checkpoint.save={out}/ckpt",
            "checkpoint.save_interval=1"]
    run = Run(tmp_path, "one", [sys.executable, "-m", "megatron_gspo.train", *args])
    root = f"{out}/ckpt"
    wait_for_checkpoint(run, root, 2)
    assert [p.pid for p in marked(run.marker)] == [run.p.pid]  # the trainer, and nothing it started
    run.p.send_signal(signal.SIGKILL)
    rc, log = run.wait()
    assert rc == -signal.SIGKILL
    assert run.leftovers() == []
    newest = latest_complete(root)
    rc, log = Run(tmp_path, "one", [sys.executable, "-m", "megatron_gspo.train", *args, "checkpoint.resume=true"]).wait()
    assert rc == 0 and f"resumed from {iter_dir(root, newest)} at step {newest}" in log, log[-3000:]
    assert metric_steps(out) == list(range(1, 9))


@pytest.mark.parametrize("overrides, faults, code, message", [
    (["train.num_steps=abc"], "", 2, "before launch: train.num_steps must be an integer, got 'abc'"),
    (["reward.name=nope"], "", 2, "rank 0: unknown reward 'nope' (reward.name)"),
    (["train.max_consecutive_skips=2", "train.num_minibatches=1"], "nan_logprob@2,nan_logprob@3", EXIT_TOO_MANY_SKIPS,
     "rank 0: stopping: 2 consecutive updates had non-finite loss or gradients"),
], ids=["config-error", "unknown-reward", "too-many-skips"])
def test_launcher_returns_the_ranks_code_with_one_line(tmp_path, overrides, faults, code, message):
    rc, log = launcher(tmp_path, "c", *overrides, steps=4, MEGATRON_GSPO_FAULTS=faults).wait()
    assert rc == code, log[-4000:]
    line = last_line(log)
    assert line.startswith(f"pretrain_gspo.sh: exit {code} (") and message in line, line
    assert "Traceback" not in log and "ChildFailedError" not in log, log[-4000:]


def test_bare_torchrun_names_the_code_in_its_report(tmp_path):
    """torchrun itself exits 1 for any failed worker; the ranks' error files make the root cause of
    its report (the last line before its closing border) name the code and what it means."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", str(LAUNCHER),
           TINY_YAML, "train.num_steps=abc", f"train.output_dir={tmp_path}/t"]
    rc, log = Run(tmp_path, "t", cmd).wait()
    assert rc == 1, log[-3000:]
    lines = [ln for ln in log.splitlines() if ln.strip() and set(ln.strip()) != {"="}]
    assert re.fullmatch(r"\s*traceback : exit 2 \(user error: .*\): train\.num_steps must be an integer, got 'abc'",
                        lines[-1]), log[-3000:]
    assert "Root Cause" in log


def test_dry_run_with_a_bad_config_is_one_line_and_exit_2(tmp_path):
    p = subprocess.run([sys.executable, str(LAUNCHER), "--dry-run", TINY_YAML, "loss.clip_ratio_low=1.5"],
                       env=clean_env(WORLD_SIZE=2), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2, p.stdout + p.stderr
    assert p.stderr.strip() == "error: loss.clip_ratio_low must be in (0, 1), got 1.5"
    p = subprocess.run([sys.executable, str(LAUNCHER), "--dry-run", TINY_YAML, "parallel.tensor_model_parallel_size=2"],
                       env=clean_env(WORLD_SIZE=3), capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert p.returncode == 2 and p.stderr.startswith("error: invalid parallel layout: world size 3"), p.stderr


# ----------------------------------------------------------------------------------------------
# The sbatch script, end to end: srun and scontrol faked, SLURM's variables set by hand. Where a real
# SLURM runs the same (test_slurm.py; CI sets GSPO_REQUIRE_SLURM=1 once it installed one) these
# stand-ins add nothing and are skipped; elsewhere they are what there is.
# ----------------------------------------------------------------------------------------------

real_slurm_instead = pytest.mark.skipif(os.environ.get("GSPO_REQUIRE_SLURM") == "1",
                                        reason="test_slurm.py runs these scenarios under a real SLURM")

# srun: drop its own --options, run the task, pass SIGUSR1 / SIGTERM / SIGINT on to it (what srun
# does for the signals it receives), return the task's status. No backslash escapes needed.
RUNNING_SRUN = '''
args=()
for a in "$@"; do case "$a" in --*) ;; *) args+=("$a") ;; esac; done
export SLURM_STEP_ID=0 SLURM_STEP_TASKS_PER_NODE=1 SLURM_NODEID=0
"${args[@]}" &
child=$!
trap 'kill -s USR1 "$child"' USR1
trap 'kill -s TERM "$child"' TERM
trap 'kill -s INT "$child"' INT
while :; do
    wait "$child"; rc=$?
    if [ "$rc" -gt 128 ] && kill -0 "$child" 2> /dev/null; then continue; fi
    break
done
exit "$rc"
'''


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def sbatch(tmp: Path, name: str, *overrides: str, nproc: int, steps: int = STEPS, **env) -> Run:
    stubs = fake_bin(tmp, srun=RUNNING_SRUN, scontrol='echo "$@" >> "$FAKE_LOG/scontrol.args"\n')
    out = tmp / name
    args = [*JOB, f"train.num_steps={steps}", f"train.output_dir={out}", f"checkpoint.save={out}/ckpt",
            f"checkpoint.save_interval={EVERY}", *overrides]
    return Run(tmp, name, [BASH, str(SBATCH), *args], PATH=f"{stubs}:{os.environ['PATH']}", FAKE_LOG=tmp,
               SLURM_JOB_ID="4242", SLURM_NNODES="1", SLURM_JOB_NODELIST="localhost", SLURM_SUBMIT_DIR=ROOT,
               MASTER_ADDR="127.0.0.1", MASTER_PORT=free_port(), RECIPE=TINY_YAML, NPROC=nproc, **env)


@real_slurm_instead
def test_sbatch_time_limit_signal_checkpoints_and_requeues(tmp_path):
    """--signal=B:USR1@300: SLURM signals the batch shell, which passes SIGUSR1 to srun, srun to the
    launcher, the launcher to torchrun, torchrun to the ranks: they save the step they are at, the
    step exits 75 and the job requeues itself."""
    run = sbatch(tmp_path, "u", nproc=2)
    root = f"{tmp_path}/u/ckpt"
    wait_for_checkpoint(run, root, 2 * EVERY)
    run.p.send_signal(signal.SIGUSR1)
    rc, log = run.wait()
    assert rc == 0, log[-4000:]
    assert "job step exited with status 75" in log and "requeueing job 4242" in log, log[-3000:]
    assert (tmp_path / "scontrol.args").read_text().split() == ["requeue", "4242"]
    step = metric_steps(tmp_path / "u")[-1]
    assert latest_complete(root) == step and f"preempted by signal SIGUSR1 before step {step + 1}" in log
    assert not [d for d in os.listdir(root) if d.endswith(".tmp")]
    assert run.leftovers() == []


@pytest.mark.parametrize("overrides, faults, code", [
    (["model.vocab_size=50"], "", 2),
    (["train.max_consecutive_skips=1", "train.num_minibatches=1"], "nan_logprob@2", EXIT_TOO_MANY_SKIPS),
], ids=["user-error", "too-many-skips"])
@real_slurm_instead
def test_sbatch_job_ends_with_the_ranks_code_and_no_requeue(tmp_path, overrides, faults, code):
    rc, log = sbatch(tmp_path, "e", *overrides, nproc=1, steps=3, MEGATRON_GSPO_FAULTS=faults).wait()
    assert rc == code, log[-4000:]
    assert f"job step exited with status {code}" in log
    assert f"pretrain_gspo.sh: exit {code} (" in log
    assert not (tmp_path / "scontrol.args").exists()
