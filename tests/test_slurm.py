"""Preemption, cancellation and time limits under a real SLURM (slurmctld + slurmd + munged on this
machine: tests/slurm_cluster.py), through the project's own, unmodified sbatch file on a CPU node
(`--nodes=1 --gpus-per-node=0`, the tiny CPU recipe, a checkpoint every few steps).

Each test is one job that goes through a chain of the scenarios of docs/multinode.md's table and
checks, after each, what SLURM says (``scontrol show job``: state, exit code, restarts; there is no
accounting database here, so no sacct), the exit code, the checkpoint (the step the ranks had
finished), the requeue and the resume (at exactly that step), and that the log has no traceback and
one stop line per stop. A job's log is printed when a test fails.

The scenarios cost a job start-up each (~10 s on two idle cores), so CI runs a subset that still
takes every code path once: the short time limit (a signal during start-up), the time-limit warning
(the batch shell's SIGUSR1 -> requeue -> resume -> plain scancel), `scontrol requeue` (SIGTERM to every
process, SLURM requeues) -> the run completes, and preemption with GraceTime on 2 ranks -> requeue
by the batch script -> resume -> `scancel -s TERM --full`. GSPO_SLURM_FULL=1 adds the scenarios that
take those same paths once more: `scancel -s USR1 --batch` (as the time-limit warning), preemption
without GraceTime (as `scontrol requeue`) and `scancel --signal=TERM` (as the preemption's SIGTERM,
without the requeue). docs/multinode.md's table is the report of a full run.

Skipped, with the reason, where SLURM is not installed or cannot start; ``.ci/install-slurm``
installs it (CI does) and ``.ci/run`` sets GSPO_REQUIRE_SLURM=1, which turns such a skip into a
failure. GSPO_SLURM_REPORT=<file> appends one line per scenario (what was observed) to that file.
"""

from __future__ import annotations

import datetime
import json
import os
import re
import shutil
import time
from pathlib import Path

import pytest

from megatron_gspo.checkpoint import iter_dir, latest_complete
from slurm_cluster import GRACE_TIME, SlurmCluster, SlurmError, missing_reason
from test_launch import ROOT, SBATCH
from test_reliability import JOB

pytestmark = pytest.mark.slow

EVERY = 5  # checkpoint interval (steps)
FOREVER = 100000  # steps of a job that only a signal ends
FULL = os.environ.get("GSPO_SLURM_FULL") == "1"


def _unavailable(why: str):
    if os.environ.get("GSPO_REQUIRE_SLURM") == "1":
        pytest.fail(f"GSPO_REQUIRE_SLURM=1 but {why}")
    pytest.skip(why)


@pytest.fixture(scope="module")
def cluster():
    why = missing_reason()
    if why:
        _unavailable(why)
    c = SlurmCluster()
    try:
        c.start()
    except (SlurmError, OSError, TimeoutError) as e:
        c.stop()
        _unavailable(f"the SLURM test cluster did not start: {e}")
    yield c
    c.stop()
    shutil.rmtree(c.root, ignore_errors=True)


@pytest.fixture(autouse=True)
def no_job_left(cluster):
    """Whatever a test ends with (a failed assertion too), its jobs are gone before the next one."""
    yield
    if cluster.squeue():
        cluster.cmd("scancel", "--user", "root", check=False)
        deadline = time.time() + 90
        while cluster.squeue() and time.time() < deadline:
            time.sleep(0.5)


class Job:
    """One submission of launch/slurm/gspo_qwen3_30b_a3b.sbatch; its run directory and log under tmp."""

    def __init__(self, cluster: SlurmCluster, tmp: Path, name: str, *sbatch_opts: str, nproc: int = 1,
                 steps: int = FOREVER, extra: tuple = ()):
        self.c, self.name = cluster, name
        self.dir = tmp / name
        self.dir.mkdir()
        self.log_path, self.run, self.ckpt = self.dir / "job.out", self.dir / "run", str(self.dir / "run" / "ckpt")
        overrides = [*JOB, "eval.interval=0", f"train.num_steps={steps}", f"train.output_dir={self.run}",
                     f"checkpoint.save={self.ckpt}", f"checkpoint.save_interval={EVERY}", "checkpoint.keep_last=3", *extra]
        env = {"OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore", "PYTHONPATH": os.pathsep.join(
            p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)}
        self.submitted_at = time.time()
        self.id = cluster.sbatch("--nodes=1", "--gpus-per-node=0", f"--output={self.log_path}", *sbatch_opts,
                                 f"--export=ALL,RECIPE=launch/recipes/tiny_cpu.yaml,NPROC={nproc}", str(SBATCH),
                                 *overrides, cwd=ROOT, env=env)

    # ---- what there is to look at -------------------------------------------------------------
    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path.exists() else ""

    def record(self) -> dict:
        return self.c.job(self.id)

    def latest(self) -> int:
        return latest_complete(self.ckpt) or 0 if os.path.isdir(self.ckpt) else 0

    def steps(self) -> list[int]:
        path = self.run / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line)["step"] for line in path.read_text().splitlines() if line.strip()]

    def stops(self) -> list[str]:
        """The trainer's stop lines (rank 0's log line, not the launcher's repetition)."""
        return re.findall(r"^\d\d:\d\d:\d\d (preempted by signal .*)$", self.log(), re.M)

    def resumes(self) -> list[int]:
        return [int(s) for s in re.findall(r"resumed from \S+ at step (\d+)", self.log())]

    def restarts(self) -> int:
        return int(self.record().get("Restarts", 0))

    # ---- waiting ------------------------------------------------------------------------------
    def wait(self, what: str, cond, timeout: float = 240, poll: float = 0.3):
        deadline = time.time() + timeout
        while True:
            got = cond()
            if got:
                return got
            if time.time() > deadline:
                raise AssertionError(f"job {self.id} ({self.name}): no {what} after {timeout:.0f} s; "
                                     f"{self.record()}\n--- log\n{self.log()[-6000:]}")
            time.sleep(poll)

    def wait_step_after(self, step: int) -> int:
        """A step past ``step`` finished (the run is training): returns the last one."""
        return self.wait(f"step after {step}", lambda: (self.steps() or [0])[-1] > step and self.steps()[-1])

    def wait_resumed(self, n: int) -> int:
        """The n-th resume happened and a step after it finished: returns the resume step."""
        at = self.wait(f"resume #{n}", lambda: len(self.resumes()) >= n and self.resumes()[n - 1] + 1)
        self.wait_step_after(at - 1)
        return at - 1

    def end(self) -> dict:
        """The job's final record (a job the batch script requeued is PENDING or REQUEUED instead)."""
        return self.c.wait_job(self.id, {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT"}, timeout=240)


def stop_line(job: Job, k: int) -> tuple[str, int]:
    """The k-th stop line and the step it saved."""
    lines = job.stops()
    assert len(lines) > k, job.log()[-6000:]
    m = re.search(r"before step (\d+): checkpoint saved to (\S+) \(step (\d+)\)", lines[k])
    assert m, lines[k]
    assert m.group(2) == job.ckpt and int(m.group(1)) == int(m.group(3)) + 1, lines[k]
    return lines[k], int(m.group(3))


def clean(job: Job) -> None:
    log = job.log()
    for bad in ("Traceback", "SignalException", "Logging error", "ChildFailedError"):
        assert bad not in log, f"{bad} in the log of job {job.id}:\n{log[-8000:]}"
    assert not [d for d in os.listdir(job.ckpt) if d.endswith(".tmp")]


def report(job: Job, scenario: str, rec: dict, **seen) -> None:
    path = os.environ.get("GSPO_SLURM_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"scenario": scenario, "job": job.id, "state": rec.get("JobState"),
                                "exit": rec.get("ExitCode"), "restarts": rec.get("Restarts"), **seen}) + "\n")


# ----------------------------------------------------------------------------------------------


def test_short_time_limit_warns_during_start_up_nothing_to_save_no_requeue(cluster, tmp_path):
    """--time=1 with the sbatch's --signal=B:USR1@300: the warning comes at slurmctld's first
    time-limit pass after the start; submitted just before one, it lands in start-up (before the
    trainer exists). The step ends cleanly with "nothing to save yet" and exit 79, and the batch script
    does not requeue (a requeued run would get the same early signal): FAILED 79, in seconds."""
    cluster.wait_for_time_limit_pass(offset=-5)
    job = Job(cluster, tmp_path, "short", "--time=1")
    rec = job.end()
    assert (rec["JobState"], rec["ExitCode"], rec["Restarts"]) == ("FAILED", "79:0", "0"), (rec, job.log()[-4000:])
    lines = re.findall(r"^\d\d:\d\d:\d\d (preempted by signal SIGUSR1 during start-up: nothing to save yet.*)$",
                       job.log(), re.M)
    assert len(lines) == 1 and lines[0].endswith("during start-up"), job.log()[-4000:]
    assert "pretrain_gspo.sh: exit 79 (preempted before a step completed" in job.log()
    assert "not requeued: SIGUSR1 came before a step completed" in job.log()
    assert job.steps() == [] and job.latest() == 0
    for bad in ("Traceback", "SignalException", "Logging error", "ChildFailedError"):
        assert bad not in job.log(), job.log()[-6000:]
    ran = time.time() - job.submitted_at
    assert ran < 60, ran  # well before the time limit
    report(job, "--time=1 with the default --signal=B:USR1@300", rec, ended_after_s=round(ran))



def test_a_config_error_is_one_line_exit_2_and_no_requeue(cluster, tmp_path):
    """A mistake in the job (here an unknown config key) ends at start-up with the error on one line
    and the job's exit code 2, not requeued: a second run would fail the same way."""
    job = Job(cluster, tmp_path, "usererror", extra=("train.no_such_key=1",))
    rec = job.end()
    assert (rec["JobState"], rec["ExitCode"], rec["Restarts"]) == ("FAILED", "2:0", "0"), (rec, job.log()[-3000:])
    log = job.log()
    errors = re.findall(r"^error: (.*)$", log, re.M)
    assert len(errors) == 1 and "train.no_such_key" in errors[0], log[-3000:]
    assert re.search(r"^pretrain_gspo.sh: exit 2 \(user error: .*train.no_such_key", log, re.M), log[-3000:]
    assert "requeue" not in log and "Traceback" not in log, log[-3000:]
    report(job, "unknown config key", rec)


def test_time_limit_warning_checkpoints_requeues_and_resumes_then_scancel(cluster, tmp_path):
    """--signal=B:USR1@60 and a time limit that comes into reach once the run has made progress
    (`scontrol update TimeLimit=<elapsed + 1-2 min>` after the first checkpoint: slurmctld's next
    time-limit pass, at most 30 s later, sends the warning, whatever the start-up took): the step
    saves and exits 75, the batch script requeues. The requeued job gets 10 minutes (with a short
    limit its warning could come during start-up: exit 79 and no requeue, which the short-time-limit
    test covers) and resumes at that step. Then a plain `scancel`: a checkpoint, CANCELLED, not
    requeued."""
    job = Job(cluster, tmp_path, "timelimit", "--time=10", "--signal=B:USR1@60")
    job.wait("first checkpoint", lambda: job.latest() >= EVERY)
    # the limit at least 60 s away (30 s after the warning at the latest), the warning due at once
    started = datetime.datetime.fromisoformat(job.record()["StartTime"]).timestamp()
    cluster.cmd("scontrol", "update", f"JobId={job.id}", f"TimeLimit={int((time.time() - started) // 60) + 2}")
    job.wait("the requeue", lambda: f"requeueing job {job.id}" in job.log(), timeout=120)
    cluster.cmd("scontrol", "update", f"JobId={job.id}", "TimeLimit=10")
    k1 = job.wait_resumed(1)
    line, saved = stop_line(job, 0)
    assert saved == k1 and line.startswith("preempted by signal SIGUSR1"), line
    assert f"requeueing job {job.id}: SIGUSR1 (time limit ahead)" in job.log()
    report(job, "--time with --signal=B:USR1@60", job.record(), checkpoint=saved, resumed_at=k1)

    cluster.cmd("scancel", str(job.id))
    rec = job.end()
    assert (rec["JobState"], rec["Restarts"]) == ("CANCELLED", "1"), rec
    line, saved = stop_line(job, 1)
    assert saved == job.steps()[-1] == job.latest() > k1, line
    clean(job)
    report(job, "scancel", rec, checkpoint=saved)


def test_requeue_then_the_run_completes(cluster, tmp_path):
    """`scontrol requeue` (SIGTERM to every process of the job, SLURM requeues), then (GSPO_SLURM_FULL)
    `scancel -s USR1 --batch` (the batch shell only: its trap passes the signal to the step, the step
    exits 75, the script requeues), then the job runs to its end: COMPLETED 0, every step logged once,
    the summary over the whole run."""
    job = Job(cluster, tmp_path, "requeue", steps=60)
    job.wait("first checkpoint", lambda: job.latest() >= EVERY)
    cluster.cmd("scontrol", "requeue", str(job.id))
    k1 = job.wait_resumed(1)
    line, saved = stop_line(job, 0)
    assert saved == k1 and line.startswith("preempted by signal SIGTERM"), line
    assert job.restarts() == 1
    report(job, "scontrol requeue", job.record(), checkpoint=saved, resumed_at=k1)

    stops = 1
    if FULL:
        cluster.cmd("scancel", "-s", "USR1", "--batch", str(job.id))
        k2 = job.wait_resumed(2)
        line, saved = stop_line(job, 1)
        assert saved == k2 > k1 and line.startswith("preempted by signal SIGUSR1"), line
        assert f"requeueing job {job.id}: SIGUSR1" in job.log()
        report(job, "scancel -s USR1 --batch", job.record(), checkpoint=saved, resumed_at=k2)
        stops = 2

    rec = job.end()
    assert (rec["JobState"], rec["ExitCode"], rec["Restarts"]) == ("COMPLETED", "0:0", str(stops)), rec
    assert job.steps() == list(range(1, 61))  # the re-run steps logged once
    assert job.latest() == 60 and os.path.isdir(iter_dir(job.ckpt, 60))
    assert re.search(r"mean reward of the first 10 GSPO steps \(1-10\) \S+ -> last 10 steps \(51-60\) \S+ \(\S+\)$",
                     job.log(), re.M), job.log()[-3000:]
    assert len(job.stops()) == stops
    clean(job)
    report(job, "normal end (after two resumes)", rec, checkpoint=job.latest())



def test_preemption_with_grace_time_requeues_and_resumes_then_full_scancel(cluster, tmp_path):
    """A job of the high partition preempts ours (PreemptMode=REQUEUE, GraceTime 60 s): SLURM sends
    SIGTERM to the job step; both ranks save the step they were at and exit 75 within seconds; the
    batch script sees the preemption and requeues (SLURM alone would record FAILED 75). The requeued
    job resumes at that step. Then `scancel -s TERM --full` (SIGTERM to the batch shell's process
    group and to the step): a checkpoint, exit 75, no requeue (srun, in its own process group, never
    gets the SIGTERM it would answer with a SIGKILL of the step)."""
    job = Job(cluster, tmp_path, "grace", "--partition=low", nproc=2)
    job.wait("first checkpoint", lambda: job.latest() >= EVERY)
    t0 = time.time()
    high = cluster.sbatch("--partition=high", "--exclusive", f"--output={tmp_path}/high.out", "--wrap", "sleep 1")
    k1 = job.wait_resumed(1)
    line, saved = stop_line(job, 0)
    assert saved == k1 and line.startswith("preempted by signal SIGTERM"), line
    assert f"requeueing job {job.id}: SLURM is preempting it" in job.log()
    assert job.restarts() == 1
    assert cluster.job(high)["JobState"] == "COMPLETED"
    # the step saved and the script requeued the job well inside the grace time
    stamp = re.search(r"^\[(\S+)\] requeueing job", job.log(), re.M).group(1)
    requeued_after = datetime.datetime.fromisoformat(stamp).timestamp() - t0
    assert requeued_after < GRACE_TIME / 2, requeued_after
    report(job, f"preemption, GraceTime={GRACE_TIME}", job.record(), checkpoint=saved, resumed_at=k1,
           requeued_after_s=round(requeued_after, 1))

    cluster.cmd("scancel", "-s", "TERM", "--full", str(job.id))
    rec = job.end()
    assert (rec["JobState"], rec["ExitCode"], rec["Restarts"]) == ("FAILED", "75:0", "1"), rec
    line, saved = stop_line(job, 1)
    assert saved == job.steps()[-1] == job.latest() > k1, (line, job.steps()[-3:])
    assert "batch shell got SIGTERM" in job.log()
    assert len(re.findall(r"^pretrain_gspo.sh: exit 75 .*: rank 0: preempted", job.log(), re.M)) == 2
    clean(job)
    report(job, "scancel -s TERM --full", rec, checkpoint=saved)



@pytest.mark.skipif(not FULL, reason="GSPO_SLURM_FULL=1: the same paths as scontrol requeue and the preemption's SIGTERM")
def test_preemption_without_grace_time_then_scancel_signal_term(cluster, tmp_path):
    """GraceTime 0: SLURM requeues the job at once (SIGTERM to everything, SIGKILL after KillWait):
    the step saves within KillWait and the job comes back. Then `scancel --signal=TERM` (the job
    step only): a checkpoint, exit 75, FAILED, not requeued."""
    job = Job(cluster, tmp_path, "nograce", "--partition=nograce")
    job.wait("first checkpoint", lambda: job.latest() >= EVERY)
    cluster.sbatch("--partition=high", "--exclusive", f"--output={tmp_path}/high.out", "--wrap", "sleep 1")
    k1 = job.wait_resumed(1)
    line, saved = stop_line(job, 0)
    assert saved == k1 and "DUE TO PREEMPTION" in job.log(), line
    report(job, "preemption, GraceTime=0", job.record(), checkpoint=saved, resumed_at=k1)

    cluster.cmd("scancel", "--signal=TERM", str(job.id))
    rec = job.end()
    assert (rec["JobState"], rec["ExitCode"], rec["Restarts"]) == ("FAILED", "75:0", "1"), rec
    line, saved = stop_line(job, 1)
    assert saved == job.steps()[-1] == job.latest() > k1, line
    clean(job)
    report(job, "scancel --signal=TERM", rec, checkpoint=saved)
