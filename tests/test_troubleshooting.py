"""docs/troubleshooting.md's catalogue of bad inputs, run.

Every entry (a table row whose first cell is a message) carries in the page's source either the
command that produces it, ``<!-- check: COMMAND -->``, or why it cannot run here,
``<!-- no-check: REASON -->``. Each command runs in this process through the entry point the
command line uses (``megatron_gspo.train.main``, ``megatron_gspo.preflight.cli.main``, the launcher's
Python half for ``--dry-run``, the converters' and ``experiments.compare``'s ``main``),
and must end with exit status 2 and the documented message as its ``error: ...`` line (``...`` and
``<placeholder>`` stand for job-specific values), without an exception escaping, i.e. without a
traceback. A message changed in the code, or an entry added to the page without a command, fails
here."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import re
import shlex
import signal
from importlib.machinery import SourceFileLoader
from pathlib import Path

import pytest

from log_capture import LogLines

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "troubleshooting.md"
LAUNCHER = ROOT / "launch" / "pretrain_gspo.sh"
ANNOTATION = re.compile(r"<!-- (check|no-check): (.+?) -->")
UNLESS = re.compile(r"\s*\((unless|if) (\w+) is installed\)$")


def catalogue() -> list[tuple[int, str, str, str]]:
    """(line, message, kind, command or reason) of every entry of the page."""
    out = []
    for n, line in enumerate(DOC.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.startswith("| `"):
            continue
        message = re.match(r"\| `([^`]+)`", line).group(1)
        m = ANNOTATION.search(line)
        out.append((n, message, m.group(1) if m else "", m.group(2) if m else ""))
    return out


def message_pattern(message: str) -> re.Pattern:
    parts = re.split(r"(\.\.\.|<[a-z][a-z ]*>)", message)
    return re.compile("".join(".*?" if p == "..." or p.startswith("<") else re.escape(p) for p in parts))


def test_every_entry_names_its_command_or_why_not():
    entries = catalogue()
    assert len(entries) > 50, "the page's tables were not found"
    missing = [f"line {n}: {msg}" for n, msg, kind, _ in entries if not kind]
    assert not missing, "catalogue entries without <!-- check: ... --> or <!-- no-check: ... -->:\n" + "\n".join(missing)
    unchecked = [n for n, _, kind, _ in entries if kind == "no-check"]
    assert len(unchecked) <= 7, unchecked  # the exceptions stay exceptions


def _launcher():
    loader = SourceFileLoader("pretrain_gspo_launcher", str(LAUNCHER))
    mod = importlib.util.module_from_spec(importlib.util.spec_from_loader(loader.name, loader))
    loader.exec_module(mod)
    return mod


@pytest.fixture
def isolated(monkeypatch):
    """The trainer installs SIGTERM/SIGUSR1 handlers (preemption) and reconfigures logging: undone
    after each entry, and its errors collected from its own logger (not the root one it resets)."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("GSPO_EXIT_DIR", raising=False)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE", raising=False)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGUSR1)}
    with LogLines(logging.ERROR) as records:
        yield records
    for s, h in handlers.items():
        signal.signal(s, h)


CHECKS = [pytest.param(n, msg, cmd, id=f"line{n}") for n, msg, kind, cmd in catalogue() if kind == "check"]


# The commands run as a user types them, on this machine (the page's device-dependent entries ask for the CPU
# themselves, or say "unless ... is installed").
@pytest.mark.any_device
@pytest.mark.parametrize("line, message, command", CHECKS)
def test_catalogue_entry(line, message, command, isolated, monkeypatch, capsys):
    unless = UNLESS.search(command)
    if unless:  # "(unless X is installed)": the message without X; "(if X is installed)": with it
        installed = importlib.util.find_spec(unless.group(2)) is not None
        if installed == (unless.group(1) == "unless"):
            pytest.skip(f"{unless.group(2)} is {'' if installed else 'not '}installed here")
        command = command[:unless.start()]
    words = shlex.split(command)
    while re.fullmatch(r"[A-Z_]+=\S*", words[0]):
        key, value = words.pop(0).split("=", 1)
        monkeypatch.setenv(key, value)
    if words[:3] == ["python", "-m", "megatron_gspo.train"]:
        from megatron_gspo.train import main

        code = main(words[3:])
        errors = [ln for ln in isolated.lines if ln.startswith("error: ")]
    elif words[:3] == ["python", "-m", "megatron_gspo.preflight"]:
        from megatron_gspo.preflight.cli import main

        code = main(words[3:])
        errors = [ln for ln in isolated.lines if ln.startswith("error: ")]
    elif words[:3] == ["python", "launch/pretrain_gspo.sh", "--dry-run"]:
        code = _launcher()._run(words[2:])
        errors = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("error: ")]
    elif words[:2] == ["python", "-m"] and words[2].startswith(("checkpoints_tools.", "experiments.compare")):
        # the converters and the comparison print "error: ..." (argparse: "<prog>: error: ...") on stderr
        try:
            module = importlib.import_module(words[2])
            main = getattr(module, "main", None) or importlib.import_module(words[2] + ".cli").main
            code = main(words[3:])
        except SystemExit as e:  # argparse's refusal
            code = e.code
        errors = ["error: " + ln.split("error: ", 1)[1] for ln in capsys.readouterr().err.splitlines() if "error: " in ln]
    else:
        raise AssertionError(f"line {line}: cannot run {command!r}")
    assert code == 2, (command, code, isolated.lines)
    assert len(errors) == 1, (command, isolated.lines)
    first = errors[0].splitlines()[0]
    assert message_pattern(message).search(first), f"docs/troubleshooting.md:{line}\n  documented: {message}\n  raised:     {first}"
