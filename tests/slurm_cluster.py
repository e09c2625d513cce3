"""A real one-node SLURM cluster in a temporary directory, for tests/test_slurm.py.

munged, slurmctld and slurmd (Debian's ``slurm-wlm`` + ``munge``; ``.ci/install-slurm`` installs
them) run with their own key, config, state, spool, log and pid files and free ports, so the
cluster touches nothing outside its directory and several can run on one machine. The node is
this machine (all its CPUs, proctrack/linuxproc, no cgroups), in three partitions:

    low      (default)  PriorityTier 1, GraceTime 60 s, PreemptMode REQUEUE
    nograce             PriorityTier 1, GraceTime 0,    PreemptMode REQUEUE
    high                PriorityTier 2, PreemptMode OFF (its jobs preempt the other two)

with PreemptType=preempt/partition_prio, KillWait 30 s (SLURM's default), MinJobAge 3600 s (finished
jobs stay visible to ``scontrol show job``: there is no accounting database, so no ``sacct``),
``cred_expire=5`` (a requeued job may start again after ~6 s instead of SLURM's default 121 s) and a
scheduler pass every 2 s. SlurmctldDebug=debug2 logs the time-limit pass ("Testing job time limits"),
which runs every 30 s: :meth:`SlurmCluster.next_time_limit_pass` predicts the next one.

    python tests/slurm_cluster.py DIR      start one by hand (SLURM_CONF=DIR/slurm.conf); Ctrl-C stops it
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Optional

from launch_modules import supervisor

pid_alive = supervisor.pid_alive

DAEMONS = ("munged", "slurmctld", "slurmd")
CLIENTS = ("sbatch", "scontrol", "scancel", "squeue", "srun", "sinfo")
GRACE_TIME = 60
# The path munged's socket may live under must be searchable by everyone (munged checks each parent);
# pytest's own temporary directories are 0700.
BASE = os.environ.get("GSPO_SLURM_TMP", "/tmp")


def missing_reason() -> Optional[str]:
    """Why no cluster can start here (None: the binaries are there and we can run the daemons)."""
    missing = [b for b in DAEMONS + CLIENTS if shutil.which(b) is None]
    if missing:
        return (f"SLURM not installed ({', '.join(missing)} missing): `bash .ci/install-slurm` installs "
                "Debian's slurm-wlm and munge (root, apt)")
    if os.geteuid() != 0:
        return "the SLURM test cluster runs slurmd as root (it starts jobs), and this is not root"
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class SlurmError(RuntimeError):
    pass


class SlurmCluster:
    def __init__(self, root: Optional[str] = None):
        self.root = Path(root or tempfile.mkdtemp(prefix="gspo-slurm-", dir=BASE))
        self.root.mkdir(parents=True, exist_ok=True)
        os.chmod(self.root, 0o755)
        self.conf = self.root / "slurm.conf"
        self.node = "localhost"  # resolves everywhere: the launcher's master address is the node name
        self.env = {**os.environ, "SLURM_CONF": str(self.conf)}
        for k in list(self.env):
            if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF":
                del self.env[k]  # a test run inside a SLURM job must not leak that job into ours
        self.started: list[str] = []
        self.ctld_started_at = 0.0

    # ---- lifecycle -----------------------------------------------------------------------------
    def start(self, timeout: float = 60) -> "SlurmCluster":
        r = self.root
        for d in ("munge", "msock", "state", "spool", "log"):
            (r / d).mkdir(exist_ok=True)
        os.chmod(r / "munge", 0o700)
        os.chmod(r / "msock", 0o755)
        key = r / "munge" / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        self.munge_socket = r / "msock" / "munge.socket"
        self._run(["munged", f"--socket={self.munge_socket}", f"--key-file={key}",
                   f"--pid-file={r / 'munge' / 'munged.pid'}", f"--log-file={r / 'munge' / 'munged.log'}",
                   f"--seed-file={r / 'munge' / 'munged.seed'}"], "munged")
        self.started.append("munged")
        self.conf.write_text(self._config())
        self._run(["slurmctld"], "slurmctld")
        self.started.append("slurmctld")
        self.ctld_started_at = time.time()
        self._run(["slurmd", "-N", self.node], "slurmd")
        self.started.append("slurmd")
        deadline = time.time() + timeout
        while True:
            p = subprocess.run(["sinfo", "-h", "-N", "-o", "%T"], env=self.env, capture_output=True, text=True)
            states = p.stdout.split()
            if p.returncode == 0 and states and all(s == "idle" for s in states):
                return self
            if time.time() > deadline:
                raise SlurmError(f"the node never became idle (sinfo: {p.stdout.strip()} {p.stderr.strip()});\n"
                                 f"{self.log_tail()}")
            time.sleep(0.5)

    def _config(self) -> str:
        r = self.root
        cpus = os.cpu_count() or 1
        return "\n".join([
            "ClusterName=gspotest",
            f"SlurmctldHost={self.node}",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            "CredType=cred/munge",
            f"AuthInfo=socket={self.munge_socket},cred_expire=5",
            f"StateSaveLocation={r / 'state'}",
            f"SlurmdSpoolDir={r / 'spool'}",
            f"SlurmctldPidFile={r / 'slurmctld.pid'}",
            f"SlurmdPidFile={r / 'slurmd.pid'}",
            f"SlurmctldLogFile={r / 'log' / 'slurmctld.log'}",
            f"SlurmdLogFile={r / 'log' / 'slurmd.log'}",
            "SlurmctldDebug=debug2",
            "SlurmdDebug=info",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core",
            "SchedulerType=sched/builtin",
            "SchedulerParameters=sched_interval=2",
            "JobAcctGatherType=jobacct_gather/none",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "MpiDefault=none",
            "ReturnToService=2",
            "MinJobAge=3600",
            "KillWait=30",
            "PreemptType=preempt/partition_prio",
            "PreemptMode=REQUEUE",
            f"NodeName={self.node} NodeAddr=127.0.0.1 NodeHostname={socket.gethostname()} CPUs={cpus} State=UNKNOWN",
            f"PartitionName=low Nodes={self.node} Default=YES PriorityTier=1 GraceTime={GRACE_TIME} PreemptMode=REQUEUE "
            "MaxTime=INFINITE State=UP",
            f"PartitionName=nograce Nodes={self.node} PriorityTier=1 GraceTime=0 PreemptMode=REQUEUE MaxTime=INFINITE "
            "State=UP",
            f"PartitionName=high Nodes={self.node} PriorityTier=2 PreemptMode=OFF MaxTime=INFINITE State=UP",
            "",
        ])

    def _run(self, cmd: list[str], name: str) -> None:
        p = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=60)
        if p.returncode != 0:
            raise SlurmError(f"{name} did not start (exit {p.returncode}): {p.stdout.strip()} {p.stderr.strip()}\n"
                             f"{self.log_tail()}")

    def stop(self) -> None:
        """Cancel what is left, then stop the daemons (by their pid files) and wait for them."""
        if "slurmctld" in self.started:
            subprocess.run(["scancel", "--full", "--signal=KILL", "--user", "root"], env=self.env,
                           capture_output=True, timeout=30)
            subprocess.run(["scancel", "--user", "root"], env=self.env, capture_output=True, timeout=30)
            deadline = time.time() + 60
            while self.squeue() and time.time() < deadline:
                time.sleep(0.5)
        for name, pidfile in (("slurmd", self.root / "slurmd.pid"), ("slurmctld", self.root / "slurmctld.pid"),
                              ("munged", self.root / "munge" / "munged.pid")):
            if name not in self.started:
                continue
            try:
                pid = int(pidfile.read_text().split()[0])
                os.kill(pid, signal.SIGTERM)
            except (OSError, ValueError, IndexError):
                continue
            deadline = time.time() + 30
            while pid_alive(pid) and time.time() < deadline:
                time.sleep(0.1)
        self.started = []

    def __enter__(self) -> "SlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---- commands --------------------------------------------------------------------------------
    def cmd(self, *args: str, check: bool = True, cwd=None, env: Optional[dict] = None,
            timeout: float = 60) -> subprocess.CompletedProcess:
        p = subprocess.run(list(args), env={**self.env, **(env or {})}, capture_output=True, text=True,
                           cwd=cwd, timeout=timeout)
        if check and p.returncode != 0:
            raise SlurmError(f"{' '.join(args)}: exit {p.returncode}: {p.stdout.strip()} {p.stderr.strip()}")
        return p

    def sbatch(self, *args: str, cwd=None, env: Optional[dict] = None) -> int:
        return int(self.cmd("sbatch", "--parsable", *args, cwd=cwd, env=env).stdout.strip().split(";")[0])

    def squeue(self) -> list[str]:
        p = self.cmd("squeue", "-h", "-o", "%i %T", check=False)
        return p.stdout.split("\n") if p.stdout.strip() else []

    def job(self, job_id: int) -> dict:
        """``scontrol show job -o`` as a dict (JobState, ExitCode, Restarts, PreemptTime, ...)."""
        out = self.cmd("scontrol", "-o", "show", "job", str(job_id)).stdout.strip()
        return dict(re.findall(r"(\w[\w:/]*)=(\S*)", out))

    def wait_job(self, job_id: int, states, timeout: float = 300, poll: float = 0.5) -> dict:
        """Wait until the job's state is one of ``states``; returns its record."""
        states = {states} if isinstance(states, str) else set(states)
        deadline = time.time() + timeout
        while True:
            rec = self.job(job_id)
            if rec.get("JobState") in states:
                return rec
            if time.time() > deadline:
                raise SlurmError(f"job {job_id} is {rec.get('JobState')} (reason {rec.get('Reason')}), not in "
                                 f"{sorted(states)}, after {timeout:.0f} s")
            time.sleep(poll)

    def next_time_limit_pass(self) -> float:
        """When slurmctld will next test time limits (and send --signal warnings): its last pass + 30 s."""
        log = (self.root / "log" / "slurmctld.log").read_text(errors="replace")
        stamps = re.findall(r"^\[(\S+)\] debug2: Testing job time limits", log, re.M)
        if not stamps:
            return self.ctld_started_at + 30
        import datetime

        last = datetime.datetime.fromisoformat(stamps[-1]).timestamp()
        return last + 30

    def wait_for_time_limit_pass(self, offset: float) -> None:
        """Return at ``offset`` seconds from a time-limit pass (-5: 5 s before the next one; +5: 5 s
        after the last one, i.e. 25 s before the next). A job submitted then starts ~1.5 s later."""
        now = time.time()
        target = self.next_time_limit_pass() + offset
        if offset > 0:
            target -= 30
        while target < now + 0.5:
            target += 30
        time.sleep(target - now)

    def log_tail(self, n: int = 20) -> str:
        out = []
        for name in ("log/slurmctld.log", "log/slurmd.log", "munge/munged.log"):
            p = self.root / name
            if p.exists():
                lines = p.read_text(errors="replace").splitlines()
                out.append(f"--- {p} (last {n} lines)\n" + "\n".join(lines[-n:]))
        return "\n".join(out)


if __name__ == "__main__":
    why = missing_reason()
    if why:
        sys.exit(why)
    c = SlurmCluster(sys.argv[1] if len(sys.argv) > 1 else None).start()
    print(f"export SLURM_CONF={c.conf}", flush=True)
    try:
        signal.pause()
    except KeyboardInterrupt:
        pass
    finally:
        c.stop()
