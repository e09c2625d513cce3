"""Every command of the project answers --help with its usage, and a mistake on its command line (an
unknown key, a setting without its value, a file it cannot read or write) with one line and exit
status 2, before any work: the trainer, the preflight, the memory estimator, the comparison and the
launcher's dry run. Run in this process through each command's own entry point."""

from __future__ import annotations

import importlib.util
import logging
import os
import signal
from importlib.machinery import SourceFileLoader

import pytest

from log_capture import LogLines

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(autouse=True)
def _signal_handlers():
    """The trainer and the comparison install stop-signal handlers: undone after each test."""
    saved = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGUSR1)}
    yield
    for s, h in saved.items():
        signal.signal(s, h)


def _load(path: str, name: str):
    loader = SourceFileLoader(name, os.path.join(ROOT, path))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(name, loader))
    loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("flag", ["--help", "-h"])
def test_the_trainer_prints_its_usage(flag, capsys):
    from megatron_gspo.config import DEMO_CONFIG
    from megatron_gspo.train import main

    assert main([flag]) == 0
    out = capsys.readouterr().out
    assert out.startswith("usage: python -m megatron_gspo.train [CONFIG.yaml] [section.key=value ...]"), out
    for what in (DEMO_CONFIG, "--section.key value", "docs/configuration.md", "--dry-run", "75  preempted"):
        assert what in out, (what, out)
    assert main(["train.num_steps=3", flag]) == 0  # wherever it stands


def test_the_launchers_dry_run_prints_the_trainers_usage(capsys):
    launcher = _load("launch/pretrain_gspo.sh", "pretrain_gspo_launcher_help")
    assert launcher._run(["--dry-run", "--help"]) == 0
    assert capsys.readouterr().out.startswith("usage: python -m megatron_gspo.train")


NO_VALUE = "an override needs key=value: 'train.num_steps' has no value (e.g. train.num_steps=<value>)"


@pytest.mark.parametrize("argv", [["train.num_steps"], ["megatron_gspo/configs/demo_gspo.yaml", "train.num_steps"],
                                  ["--train.num_steps"]])
def test_a_setting_without_its_value_is_named_as_such(argv, monkeypatch):
    from megatron_gspo.train import main

    monkeypatch.chdir(ROOT)
    with LogLines(logging.ERROR) as lines:
        assert main(argv) == 2
    errors = [ln for ln in lines.lines if ln.startswith("error: ")]
    expected = "error: flag --train.num_steps needs a value" if argv[0].startswith("--") else f"error: {NO_VALUE}"
    assert errors == [expected], lines.lines


@pytest.mark.parametrize("argv, message", [
    (["train.num_steps"], NO_VALUE),
    # a file no one can write, root included (os.access says yes to root): tried before the checks
    (["--quick", "--json", "/proc/version"], "--json /proc/version: cannot write there: invalid argument (/proc/version)"),
])
def test_the_preflight_refuses_its_command_line_before_any_check(argv, message, monkeypatch):
    import megatron_gspo.preflight.cli as cli

    def no_check(*a, **k):
        raise AssertionError("a check ran")

    monkeypatch.setattr(cli, "run_checks", no_check)
    with LogLines(logging.ERROR) as lines:
        assert cli.main(argv) == 2
    assert [ln for ln in lines.lines if ln.startswith("error: ")][0].startswith(f"error: {message}"), lines.lines


def test_the_preflight_leaves_a_json_path_as_it_found_it(tmp_path):
    from megatron_gspo.preflight.cli import check_args, parse_args

    new = tmp_path / "new.json"
    check_args(parse_args(["--json", str(new)]))
    assert not new.exists()  # tried, then removed
    old = tmp_path / "old.json"
    old.write_text("kept")
    check_args(parse_args(["--json", str(old)]))
    assert old.read_text() == "kept"


@pytest.mark.parametrize("argv, message", [
    (["launch/recipes/gspo_qwen3_30b_a3b_8xh100.yaml", "train.num_stepz=3"],
     "error: unknown config key train.num_stepz; did you mean ['num_steps']?"),
    (["launch/recipes/gspo_qwen3_30b_a3b_8xh100.yaml", "train.num_steps"], f"error: {NO_VALUE}"),
    (["train.num_steps", "--world-size", "1"], f"error: {NO_VALUE}"),
    (["no/such/job.yaml"], "error: config file not found: no/such/job.yaml"),
])
def test_the_memory_estimator_refuses_in_one_line(argv, message, monkeypatch, capsys):
    monkeypatch.chdir(ROOT)
    mem = _load("launch/memory_estimate.py", "memory_estimate_cli")
    assert mem.main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [message], err


@pytest.mark.parametrize("argv, message", [
    (["train.num_stepz=2"], "error: unknown config key train.num_stepz; did you mean ['num_steps']?"),
    (["train.num_steps"], f"error: {NO_VALUE}"),
])
def test_the_comparison_refuses_in_one_line(argv, message, tmp_path, capsys):
    from experiments.compare.cli import main

    assert main(argv + ["--out", str(tmp_path / "cmp")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1:] == [message], err
