"""Exit codes that survive torchrun and SLURM: the ranks record theirs, the launcher returns it.

A rank ends on purpose with 0 (done), 2 (user error), 75 (preempted, checkpoint of the current step
written), 79 (preempted before this run completed a step: nothing new to save), 76 (too many
consecutive non-finite updates) or 74 (a checkpoint could not be written: no space left, or the disk
failed). torchrun reports *any* failed worker as its own status 1
plus a ChildFailedError traceback, so without help the rank's code never reaches the shell or
SLURM (which requeues on it). Two channels carry it:

* ``$GSPO_EXIT_DIR`` (set by the launcher's supervisor, launch/supervisor.py): every
  rank writes ``rank-NNNNN.pid`` when it starts and ``rank-NNNNN.json`` (code and message) when it
  ends on purpose. The directory is node-local (a temporary directory per launcher), so it works
  unchanged on every node of a multi-node job; srun then returns the highest code of its tasks.
* torchrun's error file (``$TORCHELASTIC_ERROR_FILE``, which torchrun sets for every worker): under
  a bare ``torchrun`` the root-cause entry of its failure report names the code and its meaning.

A rank that dies without recording (a crash, SIGKILL) leaves torchrun's code and report in charge.
Only the standard library is imported here: the launcher's supervisor imports it before torch.
"""

from __future__ import annotations

import enum
import json
import os
import signal
import sys
import time

class ExitCode(enum.IntEnum):
    """The process exit codes a rank ends with on purpose (ints on the wire: the launcher reads them back)."""

    FINISHED = 0
    FAILED = 1  # a failure (a raised exception; a rollout rank of an async job that raised)
    USER_ERROR = 2
    # EX_IOERR: a checkpoint could not be written for the disk's reason (no space left, quota, a file system
    # gone read-only or failing); the last complete checkpoint stands. Not 75: a requeue meets the same disk.
    CHECKPOINT_WRITE_FAILED = 74
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
EXIT_CHECKPOINT_WRITE_FAILED = ExitCode.CHECKPOINT_WRITE_FAILED


class StopReason(enum.Enum):
    """Why a run stops before its last step, as a value: the exit code follows from it (never from a
    message's wording). Rollout ranks of an async job: one that raised is a failure (exit 1); one that is
    gone (exited, silent, its connection closed, killed mid-push) leaves a checkpoint and a resume is the
    remedy (exit 75)."""

    PREEMPTED = ExitCode.PREEMPTED  # a stop signal; the last completed step (or the warm start) saved
    PREEMPTED_NOTHING_SAVED = ExitCode.PREEMPTED_NOTHING_SAVED
    TOO_MANY_SKIPS = ExitCode.TOO_MANY_SKIPS
    CHECKPOINT_WRITE_FAILED = ExitCode.CHECKPOINT_WRITE_FAILED
    ROLLOUT_RANK_FAILED = ExitCode.FAILED
    ROLLOUT_RANK_EXITED = (ExitCode.PREEMPTED, "exited")
    ROLLOUT_RANK_SILENT = (ExitCode.PREEMPTED, "silent")
    ROLLOUT_RANK_GONE = (ExitCode.PREEMPTED, "gone")
    # the rollout engine (rollout.engine=vllm) raised or died: the last completed step saved, a failure
    ROLLOUT_ENGINE_FAILED = (ExitCode.FAILED, "engine")

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
    EXIT_TOO_MANY_SKIPS: "too many consecutive non-finite updates: the last completed step was saved",
    EXIT_CHECKPOINT_WRITE_FAILED: "a checkpoint could not be written (no space left, or the disk failed): make room "
                                  "and resume from the last complete one it names",
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


# Signals after which the ranks save and stop (stop.STOP_SIGNALS). The launcher's supervisor
# (launch/supervisor.py) delivers them to the ranks itself, once each; torchrun runs with them ignored.
GRACEFUL = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def leave(code: int) -> None:
    """End the process with ``code`` (its exit decided and recorded): ``sys.exit`` where vLLM is not loaded. With
    vLLM loaded (rollout.engine=vllm; the engine already shut down) the atexit handlers run (the logs and
    trackers flush), the standard streams are flushed, and ``os._exit`` skips the rest of the interpreter's
    finalization: its garbage collection of the object graph vLLM's imports leave took 6 s on a loaded 2-core
    machine, a wait for the launcher (or torchrun's SIGKILL 30 s after its SIGTERM) after the work was done."""
    if "vllm" not in sys.modules:
        sys.exit(code)
    import atexit

    try:
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed stream: nothing left to flush
                pass
        os._exit(code)


def ignore_stop_signals() -> None:
    """A rank's last step once its exit code is decided: the stop signals (GRACEFUL) are ignored from
    here on, so that one arriving during the interpreter's shutdown cannot turn the code into 130 / 143
    (Python resets its own handlers to SIG_DFL while finalizing; an ignored signal stays ignored)."""
    for s in GRACEFUL:
        try:
            signal.signal(s, signal.SIG_IGN)
        except (ValueError, OSError):  # not the main thread: nothing to do there
            pass
