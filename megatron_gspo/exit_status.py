"""Exit codes that survive torchrun and SLURM: the ranks record theirs, the launcher returns it.

A rank ends on purpose with 0 (done), 2 (user error), 75 (preempted, checkpoint of the current step
written), 79 (preempted before this run completed a step: nothing new to save) or 76 (too many
consecutive non-finite updates). torchrun reports *any* failed worker as its own status 1
plus a ChildFailedError traceback, so without help the rank's code never reaches the shell or
SLURM (which requeues on it). Two channels carry it:

* ``$GSPO_EXIT_DIR`` (set by :func:`supervise`, i.e. by ``bash launch/pretrain_gspo.sh``): every
  rank writes ``rank-NNNNN.pid`` when it starts and ``rank-NNNNN.json`` (code and message) when it
  ends on purpose. The directory is node-local (a temporary directory per launcher), so it works
  unchanged on every node of a multi-node job; srun then returns the highest code of its tasks.
* torchrun's error file (``$TORCHELASTIC_ERROR_FILE``, which torchrun sets for every worker): under
  a bare ``torchrun`` the root-cause entry of its failure report names the code and its meaning.

A rank that dies without recording (a crash, SIGKILL) leaves torchrun's code and report in charge.
Only the standard library is imported here: the launcher's supervisor runs it before torch.
"""

from __future__ import annotations

import enum
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

class ExitCode(enum.IntEnum):
    """The process exit codes a rank ends with on purpose (ints on the wire: the launcher reads them back)."""

    FINISHED = 0
    FAILED = 1  # a failure (a raised exception; a rollout rank of an async job that raised)
    USER_ERROR = 2
    PREEMPTED = 75  # EX_TEMPFAIL: "try again later" -> requeue and resume
    TOO_MANY_SKIPS = 76  # consecutive non-finite steps: the run cannot make progress
    # Stopped by a signal before this run completed a step (during start-up, or in its first step): the
    # newest checkpoint, if any, is still the state to resume from. Not 75, so that a batch script can
    # tell "requeue me" from "a requeued run would get the same early signal and make no progress either".
    PREEMPTED_NOTHING_SAVED = 79


EXIT_USER_ERROR = ExitCode.USER_ERROR
EXIT_PREEMPTED = ExitCode.PREEMPTED
EXIT_TOO_MANY_SKIPS = ExitCode.TOO_MANY_SKIPS
EXIT_PREEMPTED_NOTHING_SAVED = ExitCode.PREEMPTED_NOTHING_SAVED


class StopReason(enum.Enum):
    """Why a run stops before its last step, as a value: the exit code follows from it (never from a
    message's wording). Rollout ranks of an async job: one that raised is a failure (exit 1); one that is
    gone (exited, silent, its connection closed, killed mid-push) leaves a checkpoint and a resume is the
    remedy (exit 75)."""

    PREEMPTED = ExitCode.PREEMPTED  # a stop signal; the last completed step (or the warm start) saved
    PREEMPTED_NOTHING_SAVED = ExitCode.PREEMPTED_NOTHING_SAVED
    TOO_MANY_SKIPS = ExitCode.TOO_MANY_SKIPS
    ROLLOUT_RANK_FAILED = ExitCode.FAILED
    ROLLOUT_RANK_EXITED = (ExitCode.PREEMPTED, "exited")
    ROLLOUT_RANK_SILENT = (ExitCode.PREEMPTED, "silent")
    ROLLOUT_RANK_GONE = (ExitCode.PREEMPTED, "gone")

    @property
    def exit_code(self) -> ExitCode:
        return self.value[0] if isinstance(self.value, tuple) else self.value


class StoppedFor(Exception):
    """A deliberate stop that carries its ``reason`` (a StopReason); ``exit_code`` follows from it."""

    def __init__(self, message: str, reason: StopReason):
        super().__init__(message)
        self.reason = reason

    @property
    def exit_code(self) -> ExitCode:
        return self.reason.exit_code


MEANING = {
    0: "finished",
    EXIT_USER_ERROR: "user error: fix the config, layout, file or checkpoint it names",
    EXIT_PREEMPTED: "preempted: a checkpoint was written, resume with checkpoint.resume=true",
    EXIT_TOO_MANY_SKIPS: "too many consecutive non-finite updates: the last good state was saved",
    EXIT_PREEMPTED_NOTHING_SAVED: "preempted before a step completed: nothing new to save, the newest checkpoint "
                                  "(if any) is still the state to resume from",
}

EXIT_DIR_ENV = "GSPO_EXIT_DIR"


def describe(code: int) -> str:
    """``exit 75 (preempted: ...)``: the code with its meaning, for the one line a person reads."""
    return f"exit {code} ({MEANING.get(code, 'no meaning known to megatron_gspo')})"


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


def _write_atomically(path: str, text: str) -> None:
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)  # the reader never sees half a file


def rank_started() -> None:
    """Register this rank with the launcher that started torchrun (no-op without one).

    Its pid lets the launcher wait for it even if torchrun goes first, and send it SIGTERM if
    torchrun dies. Its stderr is joined to its stdout: the launcher keeps torchrun's own stderr
    back (the failure report that a recorded code replaces), and both of a worker's streams come
    from torchrun, so a rank's warnings and tracebacks would otherwise be held back with it.
    """
    exit_dir = os.environ.get(EXIT_DIR_ENV)
    if not exit_dir or not os.path.isdir(exit_dir):
        return
    _write_atomically(os.path.join(exit_dir, f"rank-{_rank():05d}.pid"), str(os.getpid()))
    sys.stderr.flush()
    os.dup2(sys.stdout.fileno(), sys.stderr.fileno())


def record(code: int, message: str) -> None:
    """Record this rank's deliberate exit for the launcher and for torchrun (no-op without them)."""
    line = message.strip().splitlines()[0] if message.strip() else MEANING.get(code, "")
    exit_dir = os.environ.get(EXIT_DIR_ENV)
    if exit_dir and os.path.isdir(exit_dir):
        _write_atomically(os.path.join(exit_dir, f"rank-{_rank():05d}.json"),
                          json.dumps({"rank": _rank(), "code": code, "message": line}))
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file and code != 0:
        # torchrun's format (torch.distributed.elastic.multiprocessing.errors): with a dict
        # message and no py_callstack, the report shows "message" where a traceback would go;
        # errorCode set keeps torchrun from rewriting the file.
        payload = {"message": {"message": f"{describe(code)}: {line}", "errorCode": code,
                               "extraInfo": {"timestamp": str(int(time.time()))}}}
        os.makedirs(os.path.dirname(error_file) or ".", exist_ok=True)
        _write_atomically(error_file, json.dumps(payload))


# ----------------------------------------------------------------------------------------------
# The launcher's side (launch/pretrain_gspo.sh runs this in place of torchrun)
# ----------------------------------------------------------------------------------------------


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


# Signals after which the ranks save and stop (faults.STOP_SIGNALS). The supervisor delivers them to
# the ranks itself, once each; torchrun runs with them ignored (see supervise). SIGQUIT stays a hard
# stop, passed to torchrun, which passes it to its workers.
GRACEFUL = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)
FORWARDED = GRACEFUL + (signal.SIGQUIT,)
EXIT_DIR_PREFIX = "gspo-exit-"


def ignore_stop_signals() -> None:
    """A rank's last step once its exit code is decided: the stop signals (GRACEFUL) are ignored from
    here on, so that one arriving during the interpreter's shutdown cannot turn the code into 130 / 143
    (Python resets its own handlers to SIG_DFL while finalizing; an ignored signal stays ignored)."""
    for s in GRACEFUL:
        try:
            signal.signal(s, signal.SIG_IGN)
        except (ValueError, OSError):  # not the main thread: nothing to do there
            pass


def _ignore_graceful() -> None:
    """torchrun's preexec: it (and its workers, until the trainer installs its handler) ignore GRACEFUL."""
    for s in GRACEFUL:
        signal.signal(s, signal.SIG_IGN)


def sweep_stale_exit_dirs(tmp: str | None = None) -> list[str]:
    """Remove the exit directories of supervisors that no longer run (SIGKILLed: their ``finally``
    never ran). A directory is named gspo-exit-<supervisor pid>-<random>; only this user's, with a
    pid in the name, are touched. Returns the removed paths."""
    import shutil

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
      (:func:`describe` + the rank's message) is printed instead; otherwise it is printed in full.
    * If torchrun dies before its workers (SIGKILL), the workers, which run in sessions of their own
      and would carry on unsupervised, get SIGTERM: they checkpoint and exit 75. The launcher
      returns only when every rank it saw is gone.
    * The exit directory is removed on the way out; directories of supervisors that were SIGKILLed
      are removed by the next one (:func:`sweep_stale_exit_dirs`).
    """
    sweep_stale_exit_dirs()
    exit_dir = tempfile.mkdtemp(prefix=f"{EXIT_DIR_PREFIX}{os.getpid()}-")
    pending: list[int] = []  # stop signals received, each once, in order
    delivered: dict[int, set] = {}  # rank pid -> the signals it was sent
    procs: list[subprocess.Popen] = []

    def on_signal(signum, frame) -> None:
        if signum == signal.SIGQUIT:
            if procs and procs[0].poll() is None:
                procs[0].send_signal(signum)
        elif signum not in pending:
            pending.append(signum)  # delivered by the loop below (no work in a handler)

    def deliver(pids) -> None:
        for pid in pids:
            sent = delivered.setdefault(pid, set())
            for s in pending:
                if s not in sent and pid_alive(pid):
                    try:
                        os.kill(pid, s)
                    except ProcessLookupError:
                        pass
                    sent.add(s)

    # before torchrun starts: from here on no stop signal is lost (until now the launcher ignored them)
    previous = {s: signal.signal(s, on_signal) for s in FORWARDED}
    try:
        try:
            proc = subprocess.Popen(cmd, env={**os.environ, EXIT_DIR_ENV: exit_dir}, stderr=subprocess.PIPE,
                                    start_new_session=True, preexec_fn=_ignore_graceful)
        except OSError as e:
            print(f"{name}: cannot run {cmd[0]}: {e}", file=sys.stderr, flush=True)
            return 127
        procs.append(proc)
        held: list[bytes] = []

        def ended() -> bool:
            pids = _rank_pids(exit_dir)
            return bool(_records(exit_dir)) or any(not pid_alive(p) for p in pids.values())

        def relay() -> None:
            for line in iter(proc.stderr.readline, b""):
                if ended():
                    held.append(line)
                else:
                    sys.stderr.buffer.write(line)
                    sys.stderr.flush()

        reader = threading.Thread(target=relay, daemon=True)
        reader.start()
        while proc.poll() is None:
            deliver(_rank_pids(exit_dir).values())
            time.sleep(poll_s)
        rc = proc.returncode
        alive = [p for p in _rank_pids(exit_dir).values() if pid_alive(p)]
        if alive and signal.SIGTERM not in pending:  # torchrun is gone: ask its orphans to save and stop
            pending.append(signal.SIGTERM)
        while any(pid_alive(p) for p in alive):
            deliver(alive)
            time.sleep(poll_s)
        reader.join(timeout=10)
        return _conclude(name, rc, _records(exit_dir), _rank_pids(exit_dir), held)
    finally:
        import shutil

        for s, h in previous.items():
            signal.signal(s, h)
        shutil.rmtree(exit_dir, ignore_errors=True)


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
