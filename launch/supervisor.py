"""The launcher's supervisor: runs torchrun and returns the ranks' own exit code.

``bash launch/pretrain_gspo.sh`` ends in ``exec python3 launch/pretrain_gspo.sh --gspo-supervise <the
torchrun command>``, which imports this file from its own directory and calls :func:`supervise`. The
ranks' side of the exchange (the codes, their meaning, ``rank_started`` / ``record`` writing into
``$GSPO_EXIT_DIR``) is ``megatron_gspo/runtime/exit_status.py``; this file reads what they wrote. Only the
standard library (and that module, itself standard library only) is imported: it runs before torch.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from typing import Optional

from megatron_gspo.runtime.exit_status import EXIT_DIR_ENV, GRACEFUL, describe

# The supervisor delivers the stop signals (GRACEFUL) to the ranks itself, once each; torchrun runs
# with them ignored. SIGQUIT stays a hard stop, passed to torchrun, which passes it to its workers.
FORWARDED = GRACEFUL + (signal.SIGQUIT,)
EXIT_DIR_PREFIX = "gspo-exit-"


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` runs (a zombie counts as dead; unreadable /proc: assumed alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # a zombie is dead for our purpose (torchrun has not reaped it yet)
    try:
        with open(f"/proc/{pid}/stat", encoding="utf-8") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True


def _read_rank_files(exit_dir: str, suffix: str) -> dict[int, str]:
    out = {}
    for name in os.listdir(exit_dir):
        if name.startswith("rank-") and name.endswith(suffix):
            try:
                with open(os.path.join(exit_dir, name), encoding="utf-8") as f:
                    out[int(name[5:-len(suffix)])] = f.read()
            except (OSError, ValueError):
                continue
    return out


def _rank_pids(exit_dir: str) -> dict[int, int]:
    return {r: int(p) for r, p in _read_rank_files(exit_dir, ".pid").items() if p.strip().isdigit()}


def _records(exit_dir: str) -> dict[int, dict]:
    out = {}
    for r, text in _read_rank_files(exit_dir, ".json").items():
        try:
            out[r] = json.loads(text)
        except ValueError:
            continue
    return out


def _ignore_graceful() -> None:
    """torchrun's preexec: it (and its workers, until the trainer installs its handler) ignore GRACEFUL."""
    for s in GRACEFUL:
        signal.signal(s, signal.SIG_IGN)


def sweep_stale_exit_dirs(tmp: str | None = None) -> list[str]:
    """Remove the exit directories of supervisors that no longer run (SIGKILLed: their ``finally``
    never ran). A directory is named gspo-exit-<supervisor pid>-<random>; only this user's, with a
    pid in the name, are touched. Returns the removed paths."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    try:
        names = os.listdir(tmp)
    except OSError:
        return removed
    for name in names:
        if not name.startswith(EXIT_DIR_PREFIX):
            continue
        path = os.path.join(tmp, name)
        pid = name[len(EXIT_DIR_PREFIX):].split("-", 1)[0]
        try:
            if os.stat(path).st_uid != os.getuid():
                continue
        except OSError:
            continue
        if not pid.isdigit() or _supervisor_alive(int(pid)):
            continue  # running, or not named by a supervisor of this version: not ours to judge
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed


def _supervisor_alive(pid: int) -> bool:
    if not pid_alive(pid):
        return False
    try:  # a reused pid is some other program: its directory is stale all the same
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"--gspo-supervise" in f.read() or pid == os.getpid()
    except OSError:
        return True


def supervise(cmd: list[str], name: str = "pretrain_gspo.sh", poll_s: float = 0.2) -> int:
    """Run torchrun (``cmd``) and return the ranks' own exit code, with one line that names it.

    * A stop signal (GRACEFUL: TERM, INT, HUP, USR1, USR2) sent to this process is delivered to every
      rank, once per rank and signal, also to ranks that register after it came (a signal during
      start-up is not lost). torchrun runs in a session of its own with these signals ignored: under
      SLURM every process of the job step gets the signal directly, and torchrun's own handling
      (raise, log, forward, and on a second delivery abandon its shutdown) produced tracebacks and
      cut the ranks' save short. The ranks count repeats and act once. SIGQUIT goes to torchrun.
    * torchrun's stderr is shown live until the first rank ends; what it prints after that is its
      failure report. When every failed rank recorded its code, the report is dropped and one line
      (``describe`` + the rank's message) is printed instead; otherwise it is printed in full.
    * If torchrun dies before its workers (SIGKILL), the workers, which run in sessions of their own
      and would carry on unsupervised, get SIGTERM: they checkpoint and exit 75. The launcher
      returns only when every rank it saw is gone.
    * The exit directory is removed on the way out; directories of supervisors that were SIGKILLed
      are removed by the next one (:func:`sweep_stale_exit_dirs`).
    """
    return Supervisor(cmd, name, poll_s).run()


class Supervisor:
    """One torchrun under supervision (see :func:`supervise`): ``run()`` = start, relay stderr, deliver
    the stop signals while it runs, wait for orphaned ranks, conclude."""

    def __init__(self, cmd: list[str], name: str, poll_s: float) -> None:
        self.cmd, self.name, self.poll_s = cmd, name, poll_s
        self.exit_dir = ""
        self.pending: list[int] = []  # stop signals received, each once, in order
        self.delivered: dict[int, set] = {}  # rank pid -> the signals it was sent
        self.proc: Optional[subprocess.Popen] = None
        self.held: list[bytes] = []  # torchrun's stderr after the first rank ended: its failure report

    def run(self) -> int:
        sweep_stale_exit_dirs()
        self.exit_dir = tempfile.mkdtemp(prefix=f"{EXIT_DIR_PREFIX}{os.getpid()}-")
        # before torchrun starts: from here on no stop signal is lost (until now the launcher ignored them)
        previous = {s: signal.signal(s, self._on_signal) for s in FORWARDED}
        try:
            if not self._start():
                return 127
            reader = threading.Thread(target=self._relay_stderr, daemon=True)
            reader.start()
            rc = self._wait()
            reader.join(timeout=10)
            return _conclude(self.name, rc, _records(self.exit_dir), _rank_pids(self.exit_dir), self.held)
        finally:
            for s, h in previous.items():
                signal.signal(s, h)
            shutil.rmtree(self.exit_dir, ignore_errors=True)

    def _on_signal(self, signum, frame) -> None:
        if signum == signal.SIGQUIT:
            if self.proc is not None and self.proc.poll() is None:
                self.proc.send_signal(signum)
        elif signum not in self.pending:
            self.pending.append(signum)  # delivered by the polling loop (no work in a handler)

    def _start(self) -> bool:
        try:
            self.proc = subprocess.Popen(self.cmd, env={**os.environ, EXIT_DIR_ENV: self.exit_dir},
                                         stderr=subprocess.PIPE, start_new_session=True,
                                         preexec_fn=_ignore_graceful)
        except OSError as e:
            print(f"{self.name}: cannot run {self.cmd[0]}: {e}", file=sys.stderr, flush=True)
            return False
        return True

    def _a_rank_ended(self) -> bool:
        pids = _rank_pids(self.exit_dir)
        return bool(_records(self.exit_dir)) or any(not pid_alive(p) for p in pids.values())

    def _relay_stderr(self) -> None:
        for line in iter(self.proc.stderr.readline, b""):
            if self._a_rank_ended():
                self.held.append(line)
            else:
                sys.stderr.buffer.write(line)
                sys.stderr.flush()

    def _deliver(self, pids) -> None:
        for pid in pids:
            sent = self.delivered.setdefault(pid, set())
            for s in self.pending:
                if s not in sent and pid_alive(pid):
                    try:
                        os.kill(pid, s)
                    except ProcessLookupError:
                        pass
                    sent.add(s)

    def _wait(self) -> int:
        """torchrun's status, once it and every rank it started are gone."""
        while self.proc.poll() is None:
            self._deliver(_rank_pids(self.exit_dir).values())
            time.sleep(self.poll_s)
        alive = [p for p in _rank_pids(self.exit_dir).values() if pid_alive(p)]
        if alive and signal.SIGTERM not in self.pending:  # torchrun is gone: ask its orphans to save and stop
            self.pending.append(signal.SIGTERM)
        while any(pid_alive(p) for p in alive):
            self._deliver(alive)
            time.sleep(self.poll_s)
        return self.proc.returncode


def _conclude(name: str, rc: int, records: dict[int, dict], pids: dict[int, int], held: list[bytes]) -> int:
    failed = {r: rec for r, rec in sorted(records.items()) if rec.get("code")}
    unrecorded = sorted(set(pids) - set(records))
    if rc == 0 and not failed:
        return 0
    if failed and not unrecorded:
        rank, rec = next(iter(failed.items()))
        codes = sorted({rec["code"] for rec in failed.values()})
        others = "" if codes == [rec["code"]] else f" (other ranks: exit codes {codes})"
        print(f"{name}: {describe(rec['code'])}: rank {rank}: {rec.get('message', '')}{others}",
              file=sys.stderr, flush=True)
        return int(rec["code"])
    # a rank died without an exit code of its own: torchrun's report is the best account
    for line in held:
        sys.stderr.buffer.write(line)
    sys.stderr.flush()
    if failed:
        rank, rec = next(iter(failed.items()))
        print(f"{name}: {describe(rec['code'])}: rank {rank}: {rec.get('message', '')}; ranks {unrecorded} "
              "ended without an exit code of their own (torchrun's report above)", file=sys.stderr, flush=True)
        return int(rec["code"])
    if not pids:
        why = ""  # an entry module that does not record its exit (not megatron_gspo.train)
    elif unrecorded:
        why = ": a rank failed without an exit code of its own (its traceback and torchrun's report are above)"
    else:
        why = " after every rank finished"
    print(f"{name}: torchrun exited with status {rc}{why}", file=sys.stderr, flush=True)
    return rc if rc > 0 else 128 - rc
