"""Nothing lost, nothing run that should not be (issue 38): one job per checkpoint root, checkpoints that
list every file they need, a resume past an incomplete newest checkpoint, a save the disk refuses, a
resume with nothing left to train, and checkpoint.load of a directory that is not (or not this job's)
checkpoint. In-process runs of the tiny job (tests/jobs_in_process.py) through the entry point."""

from __future__ import annotations

import errno
import json
import logging
import os
import re
import shutil
import subprocess
import sys
import time
import zlib

import pytest

from jobs_in_process import HERE, TINY_JOB, run_main
from log_capture import LogLines
from mounts import fill, tmpfs
from megatron_gspo.checkpoint import CheckpointError, iter_dir, latest_complete, verify_checkpoint


def job(tmp, name, *extra, steps=2):
    return TINY_JOB + [f"train.num_steps={steps}", f"train.output_dir={tmp}/{name}", *extra]


@pytest.fixture(scope="module")
def saved_root(tmp_path_factory):
    """A checkpoint root with the checkpoints of steps 1 and 2 of the tiny job (copy it before changing it)."""
    tmp = tmp_path_factory.mktemp("saved")
    code, errors, lines = run_main(job(tmp, "out", f"checkpoint.save={tmp}/ckpt", "checkpoint.save_interval=1"))
    assert code == 0, lines[-20:]
    return f"{tmp}/ckpt"


def copy_root(saved_root, tmp_path, name="ckpt") -> str:
    dst = str(tmp_path / name)
    shutil.copytree(saved_root, dst)
    return dst


def leave_what_two_jobs_left(ckpt_dir: str) -> None:
    """What two jobs saving into one root left in issue 38: metadata.json and a manifest.json naming only it."""
    for f in os.listdir(ckpt_dir):
        if f != "metadata.json":
            os.remove(os.path.join(ckpt_dir, f))
    path = os.path.join(ckpt_dir, "metadata.json")
    data = open(path, "rb").read()
    with open(os.path.join(ckpt_dir, "manifest.json"), "w") as f:
        json.dump({"step": 2, "files": {"metadata.json": {"bytes": len(data), "crc32": zlib.crc32(data)}}}, f)


def snapshot(root: str) -> dict:
    """Every file under ``root`` with its size and modification time: what "nothing was written" compares."""
    return {os.path.relpath(os.path.join(d, f), root): (os.path.getsize(os.path.join(d, f)),
                                                        os.stat(os.path.join(d, f)).st_mtime_ns)
            for d, _, files in os.walk(root) for f in files}


# ----------------------------------------------------------------------------------------------
# No checkpoint lists fewer files than it needs; a resume falls back past one
# ----------------------------------------------------------------------------------------------


def test_a_manifest_that_lists_fewer_files_than_the_checkpoint_needs_does_not_count(saved_root, tmp_path):
    from megatron_gspo.checkpoint import has_manifest

    root = copy_root(saved_root, tmp_path)
    leave_what_two_jobs_left(iter_dir(root, 2))
    why = verify_checkpoint(iter_dir(root, 2))
    assert why is not None and why.startswith("manifest.json does not list .metadata, common.pt"), why
    assert not has_manifest(iter_dir(root, 2))  # rotation does not count it as the newest complete one either
    assert latest_complete(root) == 1


def test_a_save_missing_a_file_gets_no_manifest(saved_root, tmp_path):
    """The manifest is written only when every file of the torch_dist checkpoint is there: its core files and
    each data file its .metadata names."""
    from megatron_gspo.checkpoint.directory import write_manifest

    tmp = str(tmp_path / "iter_0000003.tmp")
    shutil.copytree(iter_dir(saved_root, 2), tmp)
    os.remove(os.path.join(tmp, "manifest.json"))
    shutil.move(os.path.join(tmp, "metadata.json"), tmp_path / "metadata.json")  # a core file of every format
    with pytest.raises(CheckpointError, match="the save is incomplete, metadata.json missing"):
        write_manifest(tmp, 3)
    shutil.move(tmp_path / "metadata.json", os.path.join(tmp, "metadata.json"))
    from megatron_gspo.checkpoint.torch_dist_files import data_files, read_dcp_metadata

    last = data_files(read_dcp_metadata(tmp))[-1]  # __0_1.distcp (0.16: two writers), __0_0.distcp (0.19: one)
    os.remove(os.path.join(tmp, last))
    with pytest.raises(CheckpointError, match=rf"{last} missing"):
        write_manifest(tmp, 3)
    assert not os.path.exists(os.path.join(tmp, "manifest.json"))


def test_a_resume_falls_back_past_an_incomplete_newest_checkpoint(saved_root, tmp_path):
    root = copy_root(saved_root, tmp_path)
    leave_what_two_jobs_left(iter_dir(root, 2))
    code, errors, lines = run_main(job(tmp_path, "out", f"checkpoint.save={root}", "checkpoint.resume=true",
                                       "checkpoint.save_interval=1", steps=3))
    assert code == 0, lines[-20:]
    assert any(ln.startswith(f"checkpoint {root}/iter_0000002 is incomplete or corrupt (manifest.json does not list "
                             ".metadata, common.pt") and ln.endswith(f"resuming from {root}/iter_0000001, the newest "
                                                                    "that verifies") for ln in lines), lines
    assert f"resumed from {root}/iter_0000001 at step 1 (newer, damaged: iter_0000002; the steps after 1 are trained again)" in lines
    assert latest_complete(root) == 3 and verify_checkpoint(iter_dir(root, 2)) is None  # redone by this run


# ----------------------------------------------------------------------------------------------
# checkpoint.save belongs to one job at a time
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def sleeper():
    """A live process of this host that is not us (the holder of a lock in the tests)."""
    p = subprocess.Popen(["sleep", "120"])
    yield p
    p.kill()
    p.wait()


def start_ticks(pid: int) -> int:
    """The start time of process ``pid`` (/proc/PID/stat field 22): what a lock records beside the pid."""
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[19])


def write_lock(root: str, **fields) -> dict:
    """A lock record as a job of this host writes it (runtime/owner.holder), with ``fields`` changed."""
    import socket

    rec = {"host": socket.gethostname(), "pid": os.getpid(), "pid_start": start_ticks(os.getpid()), "slurm_job": None,
           "slurm_restart": 0, "started": "2025-11-28 08:00:00 UTC", "command": "python -m megatron_gspo.train other.yaml",
           "token": "0" * 32, **fields}
    os.makedirs(root, exist_ok=True)
    with open(os.path.join(root, "save.lock"), "w") as f:
        json.dump(rec, f)
    return rec


def dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_a_live_holder_refuses_a_second_job_and_stale_locks_are_taken_over(tmp_path, sleeper, monkeypatch):
    from megatron_gspo.checkpoint.lock import LOCK, SaveLock, read_lock

    root = str(tmp_path / "ckpt")
    live = write_lock(root, pid=sleeper.pid, pid_start=start_ticks(sleeper.pid))
    with pytest.raises(CheckpointError) as e:
        SaveLock(root).acquire()
    msg = str(e.value)
    assert msg.startswith(f"checkpoint.save={root} is in use by a job (this host, pid {sleeper.pid}, started "), msg
    assert "other.yaml" in msg and msg.endswith(f"delete {root}/{LOCK})") and "\n" not in msg
    assert read_lock(os.path.join(root, LOCK)) == live  # untouched

    monkeypatch.setenv("SLURM_JOB_ID", "77")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    stale = [({"pid": dead_pid()}, "its process {pid} is gone"),
             ({"pid": sleeper.pid, "pid_start": start_ticks(sleeper.pid) + 1}, "pid {pid} now belongs to another process"),
             ({"host": "node-b", "slurm_job": "77", "slurm_restart": 0},
              "an earlier run of this SLURM job (restart 0; this is restart 1)")]
    for fields, why in stale:
        rec = write_lock(root, **fields)
        with LogLines(logging.WARNING) as said:
            lock = SaveLock(root).acquire()
        assert said.lines == [f"checkpoint.save={root}: taking over the lock of {describe(rec)}: {why.format(**rec)}"]
        assert read_lock(os.path.join(root, LOCK))["token"] == lock.record["token"]
        lock.release()
        assert not os.path.exists(os.path.join(root, LOCK))
    for fields in ({"host": "node-b", "slurm_job": "78"}, {"host": "node-b", "slurm_job": "77", "slurm_restart": 1}):
        write_lock(root, **fields)  # another job, or another step of this one: its pid cannot be checked here
        with pytest.raises(CheckpointError, match=f"is in use by SLURM job {fields['slurm_job']} \\(host node-b, pid"):
            SaveLock(root).acquire()


def describe(rec):
    from megatron_gspo.runtime.owner import describe as owner_describe

    return owner_describe(rec)


def test_a_lock_from_another_host_is_held_while_its_lease_runs_and_taken_over_after(tmp_path):
    """A job on another host (a new sbatch after a node failure, another node) renews its lock's lease: a
    lock renewed within LEASE_S is refused, one not renewed for longer is taken over naming its holder; a
    lock written before leases, from another host, is still held however old."""
    from megatron_gspo.checkpoint.lock import LEASE_S, LOCK, SaveLock, read_lock

    root = str(tmp_path / "ckpt")
    path = os.path.join(root, LOCK)
    live = write_lock(root, host="node-b", pid=4242, slurm_job="78", lease_s=LEASE_S)  # renewed just now
    with pytest.raises(CheckpointError) as e:
        SaveLock(root).acquire()
    assert str(e.value).startswith(f"checkpoint.save={root} is in use by SLURM job 78 (host node-b, pid 4242, ")
    assert str(e.value).endswith(f"taken over {LEASE_S:.0f} s after its last renewal; if you know that job is gone, "
                                 "set checkpoint.force_unlock=true to take it now)")
    assert read_lock(path) == live
    old = time.time() - LEASE_S - 60
    os.utime(path, (old, old))  # its job stopped renewing it 11 minutes ago
    with LogLines(logging.WARNING) as said:
        lock = SaveLock(root).acquire()
    assert len(said.lines) == 1 and re.fullmatch(
        re.escape(f"checkpoint.save={root}: taking over the lock of {describe(live)}: its lease expired: not renewed "
                  "for ") + r"6[67]\d" + re.escape(f" s (a running job renews it every 60 s; lease {LEASE_S:.0f} s)"),
        said.lines[0]), said.lines
    assert read_lock(path)["token"] == lock.record["token"] and read_lock(path)["lease_s"] == LEASE_S
    lock.release()
    write_lock(root, host="node-b", pid=4242, slurm_job="78")  # no lease: cannot be told from a live one
    os.utime(path, (old, old))
    with pytest.raises(CheckpointError, match=r"in use by SLURM job 78 .* set checkpoint.force_unlock=true, or delete"):
        SaveLock(root).acquire()


def test_a_held_lock_is_renewed_and_force_unlock_takes_a_live_one(tmp_path, sleeper):
    from megatron_gspo.checkpoint.lock import LOCK, SaveLock, read_lock

    root = str(tmp_path / "ckpt")
    path = os.path.join(root, LOCK)
    lock = SaveLock(root, renew_s=0.05).acquire()
    os.utime(path, (1.0, 1.0))
    deadline = time.time() + 10
    while os.stat(path).st_mtime < time.time() - 5 and time.time() < deadline:
        time.sleep(0.05)
    assert os.stat(path).st_mtime > time.time() - 5  # renewed while held
    lock.release()
    assert not os.path.exists(path) and lock._renewer is None  # the renewing thread is gone too
    for holder in ({"host": "node-b", "pid": 4242, "slurm_job": "78", "lease_s": 600.0},  # within its lease
                   {"pid": sleeper.pid, "pid_start": start_ticks(sleeper.pid)}):  # a live process of this host
        rec = write_lock(root, **holder)
        with LogLines(logging.WARNING) as said:
            lock = SaveLock(root, force=True).acquire()
        assert said.lines == [f"checkpoint.save={root}: taking over the lock of {describe(rec)}: checkpoint.force_unlock="
                              "true (it may still be running: two jobs saving here overwrite each other)"]
        assert read_lock(path)["token"] == lock.record["token"]
        lock.release()
    # through the command line: refused, then taken with checkpoint.force_unlock=true
    rec = write_lock(root, host="node-b", pid=4242, slurm_job="78", lease_s=600.0)
    code, errors, _ = run_main(job(tmp_path, "out", f"checkpoint.save={root}", steps=1))
    assert code == 2 and errors[0].startswith(f"error: checkpoint.save={root} is in use by SLURM job 78"), errors
    code, errors, lines = run_main(job(tmp_path, "out", f"checkpoint.save={root}", "checkpoint.force_unlock=true",
                                       steps=1))
    assert code == 0, lines[-10:]
    assert any(f"taking over the lock of {describe(rec)}: checkpoint.force_unlock=true" in ln for ln in lines)
    assert latest_complete(root) == 1 and not os.path.exists(path)


def test_jobs_starting_together_get_the_lock_once(tmp_path):
    """Six processes take one root's lock at the same instant: exactly one gets it."""
    import multiprocessing as mp

    from megatron_gspo.checkpoint.lock import SaveLock

    root = str(tmp_path / "ckpt")
    ctx = mp.get_context("fork")
    go, results = ctx.Barrier(6), ctx.Queue()

    def contend():
        go.wait()
        try:
            SaveLock(root).acquire()
            results.put("won")
        except CheckpointError:
            results.put("refused")
        go.wait()  # every holder stays alive until all have tried

    procs = [ctx.Process(target=contend) for _ in range(6)]
    for p in procs:
        p.start()
    outcome = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert outcome == ["refused"] * 5 + ["won"]


def test_release_gives_back_the_lock_and_the_folders_it_made(tmp_path):
    from megatron_gspo.checkpoint.lock import SaveLock

    lock = SaveLock(str(tmp_path / "a" / "b" / "ckpt")).acquire()
    assert os.listdir(tmp_path / "a" / "b" / "ckpt") == ["save.lock"]
    lock.release()
    assert os.listdir(tmp_path) == []  # nothing was saved: nothing is left
    lock = SaveLock(str(tmp_path / "c")).acquire()
    (tmp_path / "c" / "iter_0000001").mkdir()
    lock.release()
    assert os.listdir(tmp_path / "c") == ["iter_0000001"]


def test_a_job_on_a_root_in_use_is_refused_at_start_up(tmp_path, sleeper):
    root = str(tmp_path / "ckpt")
    write_lock(root, pid=sleeper.pid, pid_start=start_ticks(sleeper.pid))
    before = snapshot(root)
    code, errors, lines = run_main(job(tmp_path, "out", f"checkpoint.save={root}", steps=1))
    assert code == 2 and len(errors) == 1, lines[-10:]
    assert errors[0].startswith(f"error: checkpoint.save={root} is in use by a job (this host, pid {sleeper.pid}, "), errors
    assert not any(ln.startswith("model:") for ln in lines)  # refused before the model was built
    assert snapshot(root) == before and not os.path.exists(tmp_path / "out")


def test_the_lock_is_held_while_the_job_runs_and_given_back_on_every_way_out(tmp_path):
    from megatron_gspo.config import load_job_config
    from megatron_gspo.runtime import parallel
    from megatron_gspo.train import Trainer, run_trainer

    root = tmp_path / "ckpt"
    trainer = Trainer(load_job_config(None, job(tmp_path, "out", f"checkpoint.save={root}", steps=1)))
    assert json.load(open(root / "save.lock"))["pid"] == os.getpid()  # taken at start-up

    def crash():
        raise RuntimeError("a bug in the middle of the run")

    trainer.run = crash
    with pytest.raises(RuntimeError, match="a bug"):
        run_trainer(trainer)
    assert not os.path.exists(root)  # given back, and the folder it made (nothing was saved) removed
    # refused after the lock was taken (the data is built after it): given back too
    code, errors, _ = run_main(job(tmp_path, "out", f"checkpoint.save={root}", "data.source=/no/such/file.jsonl"))
    assert code == 2 and "/no/such/file.jsonl" in errors[0] and not os.path.exists(root)
    parallel.destroy()


@pytest.mark.slow
def test_two_jobs_started_together_on_one_root(tmp_path):
    """Issue 38's case: two trainers started at once with the same checkpoint.save, saving every step. One
    is refused at start-up naming the other; the other trains to the end; every checkpoint is whole. The
    winner's first scoring waits until the loser has exited (a gate file), so the two overlap however
    loaded the machine (under load the second one's start-up once came after the first one's whole run)."""
    root, gate = str(tmp_path / "ckpt"), tmp_path / "gate"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONWARNINGS": "ignore"}
    procs = [subprocess.Popen([sys.executable, "-m", "megatron_gspo.train",
                               *job(tmp_path, f"out{i}", f"checkpoint.save={root}", "checkpoint.save_interval=1",
                                    f"reward.name={HERE}/reward_plugins.py:gated", f"reward.kwargs={{gate: {gate}}}",
                                    steps=3)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) for i in range(2)]
    deadline = time.time() + 600
    while all(p.poll() is None for p in procs) and time.time() < deadline:
        time.sleep(0.1)
    gate.write_text("go")
    outs = [p.communicate(timeout=900)[0] for p in procs]
    codes = [p.returncode for p in procs]
    assert sorted(codes) == [0, 2], (codes, [o[-3000:] for o in outs])
    loser, winner = (0, 1) if codes[0] == 2 else (1, 0)
    errors = [ln for ln in outs[loser].splitlines() if "error: " in ln]
    assert len(errors) == 1 and f"is in use by a job (this host, pid {procs[winner].pid}, " in errors[0], outs[loser][-2000:]
    assert "Traceback" not in outs[loser] and "Traceback" not in outs[winner]
    assert sorted(os.listdir(root)) == ["iter_0000001", "iter_0000002", "iter_0000003", "latest_checkpointed_iteration.txt"]
    assert all(verify_checkpoint(iter_dir(root, s)) is None for s in (1, 2, 3))


# ----------------------------------------------------------------------------------------------
# A save the disk refuses
# ----------------------------------------------------------------------------------------------


def fill_disk_at_save(monkeypatch, at_save: int) -> None:
    """The disk runs out of space in the ``at_save``-th checkpoint: each file megatron's checkpoint writer
    (filesystem_async.write_preloaded_data, which 0.16 runs in our threads and 0.19 in its own) opens under
    iter_<at_save>.tmp gets a few bytes, then ENOSPC. The writer's ``open`` is replaced, not one version's
    call path: the save under either megatron-core fails as a full disk would, and needs no root."""
    import builtins

    from megatron.core.dist_checkpointing.strategies import filesystem_async

    partial_dir = f"iter_{at_save:07d}.tmp"

    def open_(file, mode="r", *args, **kwargs):
        if partial_dir in os.fspath(file) and "w" in mode:
            with builtins.open(file, mode, *args, **kwargs) as f:
                f.write(b"\0" * 100)
            raise OSError(errno.ENOSPC, "No space left on device", os.fspath(file))
        return builtins.open(file, mode, *args, **kwargs)

    monkeypatch.setattr(filesystem_async, "open", open_, raising=False)


def test_a_save_the_disk_refuses_is_one_line_and_exit_74(tmp_path, monkeypatch):
    from megatron_gspo.checkpoint import has_manifest

    root = str(tmp_path / "ckpt")
    fill_disk_at_save(monkeypatch, at_save=2)
    exits = tmp_path / "exits"
    exits.mkdir()
    code, errors, lines = run_main(job(tmp_path, "out", f"checkpoint.save={root}", "checkpoint.save_interval=1", steps=3),
                                   exit_dir=str(exits))
    assert code == 74, lines[-10:]
    said = [ln for ln in lines if ln.startswith(f"checkpoint.save={root}: ")]
    assert len(said) == 1, lines[-10:]
    assert said[0].startswith(f"checkpoint.save={root}: no space left on device ({root}/iter_0000002.tmp: "), said
    assert " free) writing iter_0000002: a checkpoint of this job needs about " in said[0]
    assert f"(the size of iter_0000001); the last complete checkpoint is step 1 ({root}/iter_0000001); the partial " \
           f"iter_0000002.tmp was removed;" in said[0] and said[0].endswith("exiting with 74")
    assert sorted(os.listdir(root)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]
    assert verify_checkpoint(iter_dir(root, 1)) is None and has_manifest(iter_dir(root, 1))
    assert json.load(open(exits / "rank-00000.json"))["code"] == 74  # what the launcher reads


@pytest.fixture
def small_disk(tmp_path):
    """A real 2 MB file system: one checkpoint of the tiny job (1.4 MB) fits, a second one does not."""
    with tmpfs(str(tmp_path / "disk"), size="2m") as path:
        yield path


def test_a_real_disk_that_fills_at_the_second_save(small_disk, tmp_path):
    root = f"{small_disk}/ckpt"
    code, errors, lines = run_main(job(tmp_path, "out", f"checkpoint.save={root}", "checkpoint.save_interval=1", steps=3))
    assert code == 74, lines[-10:]
    said = [ln for ln in lines if ln.startswith(f"checkpoint.save={root}: ")]
    assert len(said) == 1 and said[0].startswith(f"checkpoint.save={root}: no space left on device ("), lines[-10:]
    assert "the last complete checkpoint is step 1" in said[0] and said[0].endswith("exiting with 74")
    assert sorted(os.listdir(root)) == ["iter_0000001", "latest_checkpointed_iteration.txt"]  # the partial one gone
    assert verify_checkpoint(iter_dir(root, 1)) is None


def test_metrics_on_a_full_disk_are_said_and_training_goes_on(small_disk, tmp_path):
    """train.output_dir on a disk with no byte left: said when the first row fails, training goes on, the
    checkpoint (on another disk) is saved, and the end of the run says which steps have no row."""
    fill(small_disk)
    out = f"{small_disk}/run"
    code, errors, lines = run_main(TINY_JOB + ["train.num_steps=2", f"train.output_dir={out}",
                                               f"checkpoint.save={tmp_path}/ckpt"])
    assert code == 0 and not errors, lines[-10:]
    warned = [ln for ln in lines if ln.startswith(f"train.output_dir={out}: ")]
    assert warned == [
        f"train.output_dir={out}: cannot write metrics.jsonl at step 1: no space left on device ({out}: 0 B free); "
        "training goes on (the metrics are a log, the checkpoint holds the run) and each step tries again",
        f"train.output_dir={out}: metrics.jsonl could not be written to the end: 2 step(s) have no row: 1, 2"], warned
    assert verify_checkpoint(iter_dir(f"{tmp_path}/ckpt", 2)) is None


def test_metrics_rows_are_written_whole_as_each_step_ends(tmp_path, monkeypatch):
    """Each row is on disk when log() returns; a row the disk cuts short is cut off again (every line of the
    file parses); a failure is said once, and again when rows are written again, with the steps missing."""
    from megatron_gspo.runtime.logger import MetricsLogger

    real_write, full = os.write, {"on": False}

    def write(fd, data):
        if full["on"] and fd == metrics.fd:
            real_write(fd, bytes(data[:7]))  # the first bytes of the row, then the disk is full
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", write)
    metrics = MetricsLogger(str(tmp_path), enabled=True)
    rows = lambda: [json.loads(line)["step"] for line in open(tmp_path / "metrics.jsonl")]
    metrics.log(1, {"x": 1.0})
    assert rows() == [1]  # on disk as the step ends
    with LogLines(logging.WARNING) as said:
        full["on"] = True
        metrics.log(2, {"x": 2.0})
        metrics.log(3, {"x": 3.0})
        full["on"] = False
        metrics.log(4, {"x": 4.0})
        metrics.close()
    assert rows() == [1, 4]
    assert len(said.lines) == 2, said.lines
    assert said.lines[0].startswith(f"train.output_dir={tmp_path}: cannot write metrics.jsonl at step 2: no space left "
                                    f"on device ({tmp_path}: ")
    assert said.lines[1] == f"train.output_dir={tmp_path}: metrics.jsonl written again from step 4; 2 step(s) have no row: 2, 3"


def test_the_checkpoint_size_estimate_matches_a_real_checkpoint(saved_root):
    """The estimate a refused save names when no checkpoint was written yet (space.estimate_bytes: weights,
    Adam's moments, the KL reference) is the size of a real one to within its metadata."""
    from megatron_gspo.checkpoint.space import estimate_bytes
    from megatron_gspo.config import load_job_config

    real = sum(os.path.getsize(os.path.join(iter_dir(saved_root, 2), f)) for f in os.listdir(iter_dir(saved_root, 2)))
    est = estimate_bytes(load_job_config(None, TINY_JOB))
    assert 0.8 * real < est < 1.1 * real, (est, real)


# ----------------------------------------------------------------------------------------------
# Resume with nothing left to train
# ----------------------------------------------------------------------------------------------


def test_a_resume_at_num_steps_says_so_and_writes_nothing(saved_root, tmp_path):
    root = copy_root(saved_root, tmp_path)
    before = snapshot(root)
    code, errors, lines = run_main(job(tmp_path, "out", f"checkpoint.save={root}", "checkpoint.resume=true",
                                       "checkpoint.save_interval=1", steps=2))
    assert code == 0 and not errors, lines[-10:]
    assert (f"nothing to train: {root}/iter_0000002 is at step 2 and train.num_steps=2; nothing was written "
            "(raise train.num_steps to train further)") in lines
    assert snapshot(root) == before  # no re-save, no lock
    assert not os.path.exists(tmp_path / "out")  # no metrics.jsonl either


# ----------------------------------------------------------------------------------------------
# checkpoint.load of a directory that is not a whole checkpoint, or not this job's model
# ----------------------------------------------------------------------------------------------


def test_the_common_state_is_read_in_either_format(saved_root):
    """megatron-core 0.16 writes common.pt; 0.19 keeps the common state in the data, a byte object that .metadata
    names and that DCP's own load planner would unpickle unrestricted: read_common takes its bytes and loads them
    with weights_only=True. Whichever release saved the checkpoint, the job's config comes back, and the files a
    complete checkpoint needs are that format's (CI runs this under both releases)."""
    from megatron_gspo.checkpoint.torch_dist_files import common_state_key, core_files, read_common, read_dcp_metadata

    d = iter_dir(saved_root, 2)
    md = read_dcp_metadata(d)
    in_data = common_state_key(md) is not None
    assert in_data != os.path.exists(os.path.join(d, "common.pt"))
    assert ("common.pt" in core_files(md)) != in_data
    model = ((read_common(d).get("extra") or {}).get("config") or {}).get("model")
    assert isinstance(model, dict) and model["num_layers"] >= 1, model
    assert verify_checkpoint(d) is None


def test_load_of_a_checkpoint_without_common_pt_is_refused_in_one_line(saved_root, tmp_path):
    d = str(tmp_path / "iter")
    shutil.copytree(iter_dir(saved_root, 2), d)
    if not os.path.exists(os.path.join(d, "common.pt")):
        pytest.skip("megatron-core 0.19 keeps the common state in the data (no common.pt); "
                    "test_the_common_state_is_read_in_either_format covers that format")
    os.remove(os.path.join(d, "common.pt"))
    code, errors, lines = run_main(job(tmp_path, "out", f"checkpoint.load={d}", steps=1))
    assert code == 2 and errors == [f"error: {d}: not a complete checkpoint: common.pt missing"], lines[-10:]


def test_load_of_a_checkpoint_of_another_model_config_is_refused_by_key(saved_root, tmp_path):
    """Keys that do not change a shape: a converted checkpoint's model_config.yaml, or a trainer checkpoint's
    job, against model.*; refused naming each, accepted by checkpoint.allow_config_change."""
    import yaml

    from megatron_gspo.config import load_job_config, to_dict

    d = str(tmp_path / "converted")
    shutil.copytree(iter_dir(saved_root, 2), d)
    model = {**to_dict(load_job_config(None, TINY_JOB).model), "vocab_size": 100, "rotary_base": 1e6,
             "max_position_embeddings": 256, "norm_epsilon": 1e-5}
    with open(os.path.join(d, "model_config.yaml"), "w") as f:
        yaml.safe_dump(model, f)
    code, errors, lines = run_main(job(tmp_path, "out", f"checkpoint.load={d}", steps=1))
    assert code == 2 and len(errors) == 1, lines[-10:]
    assert errors[0] == (
        f"error: checkpoint.load={d}: its model config ({d}/model_config.yaml) differs from the job's: "
        "model.vocab_size 100 -> 128; model.max_position_embeddings 256 -> 512; model.rotary_base 1000000.0 -> "
        "10000.0; model.norm_epsilon 1e-05 -> 1e-06: the weights would run as another model (same shapes, another "
        "function); set these keys to the checkpoint's values, or accept with checkpoint.allow_config_change="
        "[model.vocab_size,model.max_position_embeddings,model.rotary_base,model.norm_epsilon]")
    # a trainer checkpoint: the job it was written with, from its common.pt
    trained = iter_dir(saved_root, 2)
    code, errors, _ = run_main(job(tmp_path, "out", f"checkpoint.load={trained}", "model.rotary_base=5e5"))
    assert code == 2 and errors[0].startswith(f"error: checkpoint.load={trained}: its model config ({trained}/common.pt) "
                                              "differs from the job's: model.rotary_base 10000.0 -> 500000.0: "), errors
    code, errors, lines = run_main(job(tmp_path, "out", f"checkpoint.load={d}", steps=1,
                                       *["checkpoint.allow_config_change=[model]"]))
    assert code == 0, lines[-10:]
    assert any(ln.startswith(f"checkpoint.load={d}: model config differs from {d}/model_config.yaml (accepted by "
                             "checkpoint.allow_config_change): model.vocab_size 100 -> 128;") for ln in lines), lines


# ----------------------------------------------------------------------------------------------
# Nothing in a checkpoint runs as code
# ----------------------------------------------------------------------------------------------


class RunsCode:
    """Pickled on purpose: unpickling it creates the marker file (a checkpoint from a stranger)."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def test_a_common_pt_or_metadata_that_runs_code_is_refused_naming_the_file(saved_root, tmp_path):
    import pickle

    import torch

    from checkpoints_tools import megatron_to_hf

    marker = tmp_path / "code_ran"
    evil_common = str(tmp_path / "evil_common")
    shutil.copytree(iter_dir(saved_root, 2), evil_common)
    torch.save({"extra": RunsCode(marker)}, os.path.join(evil_common, "common.pt"))
    evil_meta = str(tmp_path / "evil_meta")
    shutil.copytree(iter_dir(saved_root, 2), evil_meta)
    with open(os.path.join(evil_meta, ".metadata"), "wb") as f:
        pickle.dump(RunsCode(marker), f)  # malicious on purpose
    for d, named in ((evil_common, f"{evil_common}/common.pt: refused: it holds more than tensors and plain data "),
                     (evil_meta, f"{evil_meta}: cannot read checkpoint metadata: {evil_meta}/.metadata: it would call "
                                 "posix.system, which no torch_dist metadata holds: refused")):
        code = megatron_to_hf.main(["--ckpt", d, "--out", str(tmp_path / "hf"), "--tokenizer-dir", HERE, "--quiet"])
        assert code == 2 and not marker.exists() and not os.path.exists(tmp_path / "hf")
        code, errors, lines = run_main(job(tmp_path, "out", f"checkpoint.load={d}", steps=1))
        assert code == 2 and len(errors) == 1 and errors[0].startswith(f"error: {named}"), lines[-10:]
        assert not marker.exists(), "the checkpoint ran code"


def test_no_unrestricted_unpickling_anywhere_in_the_repository():
    """torch.load only with weights_only=True in the project's code (tests may rely on torch's default, which is
    weights_only=True since 2.6, but never pass False); no pickle.load / loads / Unpickler except the restricted
    .metadata reader and a test that builds a malicious pickle on purpose (its line says so)."""
    import ast
    from pathlib import Path

    repo = Path(HERE).parent
    found = []
    for path in sorted(_sources(repo)):
        rel = path.relative_to(repo).as_posix()
        if rel.startswith("build/"):
            continue
        lines = path.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.Call):
                continue
            name = ast.unparse(node.func)
            kw = {k.arg: ast.unparse(k.value) for k in node.keywords}
            on_purpose = "malicious on purpose" in lines[node.lineno - 1]
            if name == "torch.load" and kw.get("weights_only") != "True" and (not rel.startswith("tests/")
                                                                               or "weights_only" in kw):
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
            elif name in ("pickle.load", "pickle.loads", "pickle.Unpickler") and not on_purpose and not (
                    name == "pickle.loads" and node.args and ast.unparse(node.args[0]).startswith("pickle.dumps(")):
                # (a round trip of the test's own object is no file to distrust)
                found.append(f"{rel}:{node.lineno}: {ast.unparse(node)}")
    assert not found, "\n".join(found)


def _sources(repo):
    """The repository's .py files, never entering a hidden directory: CI builds the tiers' venvs
    (.ci-te-venv, .ci-vllm-venv) in the checkout while the suite runs, and a walk into a venv pip is writing
    can meet a file that is gone by the time it is read."""
    from pathlib import Path

    for d, dirs, names in os.walk(repo):
        dirs[:] = [x for x in dirs if not x.startswith(".")]
        yield from (Path(d) / n for n in names if n.endswith(".py"))

