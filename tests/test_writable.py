"""Every place the project writes is tried at start-up and refused with the real cause (issue 38):
runtime/writable.py, and each command that writes through it (the trainer's checkpoint.save and
train.output_dir, the preflight's --json, the converters' --out and --summary-json, the comparison's
--out). Read-only file systems are real tmpfs mounts where this machine allows one (tests/mounts.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile

import pytest

from jobs_in_process import TINY_JOB, run_main
from mounts import tmpfs

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def read_only(tmp_path_factory):
    """A read-only file system (a tmpfs mounted ro)."""
    with tmpfs(str(tmp_path_factory.mktemp("ro")), read_only=True) as path:
        yield path


def test_the_cause_is_named(tmp_path):
    from megatron_gspo.runtime.writable import unwritable

    (tmp_path / "f").write_text("x")
    assert unwritable(str(tmp_path / "f" / "ckpt")) == f"{tmp_path}/f is a regular file, not a directory"
    assert unwritable(str(tmp_path / "f" / "a" / "b")) == f"{tmp_path}/f is a regular file, not a directory"
    assert unwritable(str(tmp_path / "f")) == f"{tmp_path}/f is a regular file, not a directory"
    assert unwritable(str(tmp_path), directory=False) == f"{tmp_path} is a directory"
    os.symlink(tmp_path / "gone", tmp_path / "link")
    assert unwritable(str(tmp_path / "link" / "x")) == f"{tmp_path}/link is a symbolic link to a missing path, not a directory"
    # writable: nothing is left behind, an existing file is left as it was
    assert unwritable(str(tmp_path / "new" / "deep" / "ckpt")) is None
    assert unwritable(str(tmp_path / "f"), directory=False) is None
    assert sorted(os.listdir(tmp_path)) == ["f", "link"] and (tmp_path / "f").read_text() == "x"


def test_a_read_only_file_system_is_named_as_one(read_only):
    from megatron_gspo.runtime.writable import unwritable

    assert unwritable(f"{read_only}/ckpt") == f"read-only file system ({read_only} is mounted read-only)"
    assert unwritable(f"{read_only}/out.json", directory=False) == f"read-only file system ({read_only} is mounted read-only)"


def test_permission_denied_for_an_unprivileged_user():
    """A folder this user may not write in, and one it may not even enter: as "nobody" when the tests run as
    root (root may write anywhere), else as the user itself."""
    base = tempfile.mkdtemp(prefix="writable-", dir="/tmp")
    try:
        os.chmod(base, 0o755)
        closed = os.path.join(base, "closed")
        os.mkdir(closed, 0o700)
        os.chmod(closed, 0o700)
        root = os.geteuid() == 0
        if not root:
            os.chmod(base, 0o555)
        code = ("import os, sys; from megatron_gspo.runtime.writable import unwritable; "  # imported as root, then:
                + ("os.setgid(65534); os.setuid(65534); " if root else "")
                + "print(unwritable(sys.argv[1])); print(unwritable(sys.argv[2]))")
        p = subprocess.run([sys.executable, "-c", code, f"{base}/ckpt", f"{closed}/ckpt"], capture_output=True,
                           text=True, env={**os.environ, "PYTHONPATH": REPO}, cwd="/")
        first, second = p.stdout.splitlines()
        assert first.startswith(f"permission denied ({base} is not writable by user "), (first, p.stderr)
        assert second.startswith(f"permission denied ({closed} cannot be entered by user "), second
    finally:
        os.chmod(base, 0o755)
        subprocess.run(["rm", "-rf", base])


def test_the_trainer_refuses_an_unwritable_checkpoint_save_or_output_dir_at_start_up(read_only, tmp_path):
    (tmp_path / "file").write_text("x")
    cases = [(f"checkpoint.save={read_only}/ckpt", f"read-only file system ({read_only} is mounted read-only)"),
             (f"train.output_dir={tmp_path}/file/run", f"{tmp_path}/file is a regular file, not a directory")]
    for setting, cause in cases:
        code, errors, lines = run_main(TINY_JOB + ["train.num_steps=1", f"train.output_dir={tmp_path}/out", setting])
        assert code == 2 and errors == [f"error: {setting}: cannot write there: {cause}"], lines[-10:]
        assert not any(ln.startswith(("numerics:", "model:")) for ln in lines)  # before anything was built


def bad_paths(tmp_path) -> list[tuple[str, str]]:
    """(a path, the cause the refusal names): a symbolic link loop on the way, a link that is itself a loop,
    a component over 255 bytes, a path over 4,096 bytes."""
    os.symlink("loop", tmp_path / "loop")  # a link to itself
    long_name, deep = "n" * 300, "/".join(["d" * 200] * 22)
    return [(f"{tmp_path}/loop/ckpt", f"{tmp_path}/loop is a symbolic link loop (too many levels of symbolic links)"),
            (f"{tmp_path}/loop", f"{tmp_path}/loop is a symbolic link loop (too many levels of symbolic links), not a "
                                 "directory"),
            (f"{tmp_path}/{long_name}/ckpt", f"the name {long_name[:16]}... is 300 bytes, over the file system's limit "
                                             "of 255 bytes per name"),
            (f"{tmp_path}/{deep}", f"the path is {len(str(tmp_path)) + 1 + len(deep)} bytes, over the limit of 4096 "
                                   "bytes per path")]


def test_a_link_loop_or_a_name_too_long_is_named_with_its_key(tmp_path):
    """On the command line: one line naming the key and the real cause, exit 2, no traceback (was an
    OSError's traceback, Errno 40 / 36; a loop was "a symbolic link to a missing path")."""
    for n, (path, cause) in enumerate(bad_paths(tmp_path)):
        key = ("checkpoint.save", "train.output_dir")[n % 2]
        out = f"{tmp_path}/out" if key == "checkpoint.save" else None
        args = TINY_JOB + ["train.num_steps=1", f"{key}={path}"] + ([f"train.output_dir={out}"] if out else [])
        p = subprocess.run([sys.executable, "-m", "megatron_gspo.train", *args], capture_output=True, text=True,
                           cwd=REPO, timeout=300, env={**os.environ, "PYTHONPATH": REPO})
        said = [ln for ln in p.stdout.splitlines() if ln.strip()]  # (stderr: torch's import-time notices)
        assert p.returncode == 2, (said + p.stderr.splitlines())[-10:]
        assert said[-1].split(" ", 1)[1] == f"error: {key}={path}: cannot write there: {cause}", said[-5:]
        assert "Traceback" not in p.stdout + p.stderr


def test_preflight_json_on_a_read_only_file_system_names_it(read_only):
    from jobs_in_process import run_preflight

    code, errors = run_preflight(["--quick", "--json", f"{read_only}/out.json"])
    assert code == 2 and errors == [f"error: --json {read_only}/out.json: cannot write there: read-only file system "
                                    f"({read_only} is mounted read-only)"], errors


def test_the_converters_refuse_an_unwritable_output_before_any_work(read_only, tmp_path, capsys):
    from checkpoints_tools import hf_to_megatron, megatron_to_hf

    (tmp_path / "file").write_text("x")
    assert hf_to_megatron.main(["--hf-dir", str(tmp_path / "no-such-model"), "--out", f"{read_only}/mc"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --out {read_only}/mc: cannot write there: read-only file system ({read_only} is mounted read-only)"]
    assert megatron_to_hf.main(["--ckpt", str(tmp_path / "no-such-ckpt"), "--out", str(tmp_path / "hf"),
                                "--tokenizer-dir", str(tmp_path), "--summary-json", f"{tmp_path}/file/s.json"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --summary-json {tmp_path}/file/s.json: cannot write there: {tmp_path}/file is a regular file, not a "
        "directory"]


def test_compare_refuses_an_unwritable_out_before_any_work(read_only, capsys):
    from experiments.compare.cli import main

    code = main(["--out", f"{read_only}/cmp", "--variants", "gspo", "--steps", "1", "--in-process", "--no-probe",
                 *TINY_JOB])
    assert code == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --out {read_only}/cmp: cannot write there: read-only file system ({read_only} is mounted read-only)"]
