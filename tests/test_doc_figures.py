"""Figures in the docs that a command of the project produces are that command's output, checked.

A paragraph (or a code block) quoting such a figure carries, in the page's source,
``<!-- figures: "FIGURE" "FIGURE" ... from: COMMAND -->``: each quoted figure must appear in that
paragraph and in what COMMAND prints today, so a memory estimate, a parameter count or a log line
that the code changes fails here instead of going stale in the docs (a page saying "DOES NOT FIT"
while the estimator prints "fits"). A figure in
GiB anywhere else in the docs must be a measurement, listed in MEASURED with where it was measured.

Other generated docs are checked where they are generated: docs/configuration.md
(tests/test_docs.py, against docs/gen_config_reference.py), the recipes' memory blocks
(tests/test_launch.py, launch/memory_estimate.py --check-recipes), the troubleshooting catalogue's
messages (tests/test_troubleshooting.py)."""

from __future__ import annotations

import glob
import os
import re
import shlex
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC_FILES = sorted(glob.glob(os.path.join(ROOT, "docs", "*.md"))) + [os.path.join(ROOT, "README.md")]
ANNOTATION = re.compile(r"<!-- figures: (.+?) from: (.+?) -->")
GIB = re.compile(r"\d+(?:\.\d+)? GiB")

# GiB figures that are measurements (of a machine, a run, a benchmark), not a command's fixed output
MEASURED = {
    ("docs/multinode.md", "23.5 GiB"): "the memory of the machine the preflight table was captured on",
    ("docs/performance.md", "9.6 GiB"): "measured peak memory of the unfused log-probs (benchmarks/run.py)",
    ("docs/performance.md", "0.16 GiB"): "H100 preflight numerics.fused_logprobs, fused peak (gpu_checks.sh)",
    ("docs/performance.md", "8.11 GiB"): "H100 preflight numerics.fused_logprobs, logits-path peak (gpu_checks.sh)",
    ("docs/performance.md", "25.53 GiB"): "H100 preflight memory.30b_cut, measured peak (gpu_checks.sh)",
    ("docs/performance.md", "23.67 GiB"): "H100 preflight memory.30b_cut, the estimate it printed beside the peak",
    ("docs/performance.md", "74.8 GiB"): "H100 rl-2b-512-tokens, allocated at the out-of-memory (gpu_checks.sh)",
    ("docs/performance.md", "2.3 GiB"): "the size of the benchmark's bf16 logits, the measured table's input",
    ("docs/performance.md", "9.3 GiB"): "measured peak memory (benchmarks/run.py)",
}


def _paragraph(lines: list[str], i: int) -> str:
    """Line i and the lines before it up to a blank line outside a code block."""
    out, fences = [], 0
    for j in range(i, -1, -1):
        line = lines[j]
        if line.startswith("```"):
            fences += 1
        if not line.strip() and fences % 2 == 0 and j != i:
            break
        out.append(line)
    return "\n".join(reversed(out))


def annotations() -> list[tuple[str, int, list[str], str, str]]:
    """(doc, line, figures, command, paragraph without annotations) of every annotation."""
    out = []
    for path in DOC_FILES:
        rel = os.path.relpath(path, ROOT)
        lines = open(path, encoding="utf-8").read().splitlines()
        for i, line in enumerate(lines):
            for m in ANNOTATION.finditer(line):
                figures = re.findall(r'"([^"]+)"', m.group(1))
                out.append((rel, i + 1, figures, m.group(2), ANNOTATION.sub("", _paragraph(lines, i))))
    return out


def _run(command: str, tmp_path) -> str:
    words = shlex.split(command)
    assert words[0] == "python", command
    # a run's output goes to this test's folder, not where the docs' example puts it
    words = [f"train.output_dir={tmp_path}" if w.startswith("train.output_dir=") else w for w in words[1:]]
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": ""}
    p = subprocess.run([sys.executable, *words], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                       text=True, timeout=900)
    assert p.returncode == 0, f"{command} failed (rc={p.returncode}):\n{p.stdout[-3000:]}"
    return p.stdout


def _slow(command: str) -> bool:
    """Commands that train or run the preflight (a minute under load); the estimator takes seconds."""
    return "megatron_gspo.train" in command or "megatron_gspo.preflight" in command


CASES = [pytest.param(doc, line, figures, command, text, id=f"{doc}:{line}",
                      marks=[pytest.mark.slow] if _slow(command) else [])
         for doc, line, figures, command, text in annotations()]


def test_the_annotations_are_found():
    assert len(CASES) >= 6, "the docs' <!-- figures: ... from: ... --> annotations were not found"


@pytest.mark.parametrize("doc, line, figures, command, text", CASES)
def test_a_figure_is_what_its_command_prints(doc, line, figures, command, text, tmp_path):
    assert figures, f"{doc}:{line}: an annotation names no figure"
    missing = [f for f in figures if f not in text]
    assert not missing, f"{doc}:{line}: {missing} not in the paragraph the annotation closes:\n{text}"
    out = _run(command, tmp_path)
    stale = [f for f in figures if f not in out]
    assert not stale, f"{doc}:{line}: {stale} is no longer what `{command}` prints:\n{out[-4000:]}"


def test_every_gib_figure_is_produced_or_measured():
    """A GiB figure is either under an annotation that names it or a measurement listed in MEASURED."""
    checked = {(doc, f) for doc, _, figures, _, _ in annotations() for f in figures}
    loose = []
    for path in DOC_FILES:
        rel = os.path.relpath(path, ROOT)
        if rel == "docs/configuration.md":  # generated, and checked whole (tests/test_docs.py)
            continue
        for n, line in enumerate(open(path, encoding="utf-8").read().splitlines(), start=1):
            line = ANNOTATION.sub("", re.sub(r"<!-- (check|no-check): .*? -->", "", line))
            for fig in GIB.findall(line):
                if (rel, fig) in MEASURED or any(d == rel and fig in f for d, f in checked):
                    continue
                loose.append(f"{rel}:{n}: {fig}")
    assert not loose, ("GiB figures neither produced by an annotated command nor listed as measured:\n"
                       + "\n".join(loose))
