"""benchmarks/gpu_checks.sh, the one command for the first person with a GPU: its check list, its
refusals, its budget and its one-line-per-check output, on this CPU machine (--cpu runs the checks'
CPU forms; without it, no CUDA is a setup failure). No GPU has run it."""

import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "benchmarks", "gpu_checks.sh")
NAMES = ["preflight", "pytest-gpu", "bench-decode-2b", "bench-decode-2b-graphs", "rl-2b-proxy", "rl-2b-512-tokens",
         "default-job", "pytest-in-process"]


def _run(*args, timeout=900):  # imports alone took 100 s on this shared 2-core machine under load
    dist_vars = {"MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"}
    env = {**{k: v for k, v in os.environ.items() if k not in dist_vars}, "PYTHON": sys.executable}
    return subprocess.run(["bash", SCRIPT, *args], capture_output=True, text=True, timeout=timeout, cwd=ROOT, env=env)


def _lines(stdout: str) -> dict:
    return {ln.split()[0]: ln for ln in stdout.splitlines() if ln.strip()}


def test_dry_run_lists_every_check_with_its_command():
    p = _run("--dry-run")
    assert p.returncode == 0, p.stderr
    lines = _lines(p.stdout)
    assert list(lines) == NAMES
    assert "-m megatron_gspo.preflight --json" in lines["preflight"] and "--quick" not in lines["preflight"]
    assert "-m gpu tests" in lines["pytest-gpu"]
    assert "--shape 2b-proxy" in lines["bench-decode-2b"] and "--cuda-graphs" in lines["bench-decode-2b-graphs"]
    assert "generation.max_new_tokens=512" in lines["rl-2b-512-tokens"]
    # the timeouts fit the 9-minute H100 run only through the budget: their sum is larger
    assert sum(int(ln.split()[1].rstrip("s")) for ln in lines.values()) > 530
    cpu = _lines(_run("--dry-run", "--cpu").stdout)
    assert "--quick" in cpu["preflight"] and cpu["default-job"].split()[-1] == "-"  # GPU only
    assert cpu["preflight"].split()[1] == "1200s"  # x 5 on the CPU


def test_bad_arguments_exit_2():
    p = _run("--only", "preflight,nope")
    assert p.returncode == 2 and "no check named nope" in p.stderr
    p = _run("--frobnicate")
    assert p.returncode == 2 and "unknown option --frobnicate" in p.stderr


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="a CUDA device is present")
def test_without_a_gpu_the_setup_line_says_so(tmp_path):
    p = _run("--out", str(tmp_path))
    assert p.returncode == 2
    line = _lines(p.stdout)["setup"]
    assert "failed" in line and "sees no CUDA device (use --cpu" in line
    assert (tmp_path / "summary.txt").read_text().strip() == line.strip()


def test_a_check_that_does_not_fit_the_budget_is_reported_not_run(tmp_path):
    p = _run("--cpu", "--budget", "5", "--only", "pytest-gpu", "--out", str(tmp_path))
    assert p.returncode == 0, p.stdout + p.stderr
    lines = _lines(p.stdout)
    assert "megatron-core 0.16" in lines["setup"] and "--cpu: figures mean nothing" in lines["setup"]
    assert "not run" in lines["pytest-gpu"] and "time budget" in lines["pytest-gpu"]
    assert lines["total"].split()[1] == "ok"


@pytest.mark.slow
def test_cpu_form_runs_the_checks_one_line_each(tmp_path):
    """The preflight (--quick), `pytest -m gpu` and a GPU-only check, for real on the CPU: one line per
    check and per preflight item, the logs kept, exit 0."""
    p = _run("--cpu", "--only", "preflight,pytest-gpu,default-job", "--out", str(tmp_path), timeout=1800)
    assert p.returncode == 0, p.stdout + p.stderr
    lines = _lines(p.stdout)
    assert lines["preflight"].split()[1] == "ok" and "skipped" in lines["pytest-gpu"]
    assert lines["pytest-gpu"].split()[1] == "ok"
    assert lines["default-job"].split()[1] == "skipped" and "GPU only" in lines["default-job"]
    items = [k for k in lines if k.startswith("preflight/")]
    assert "preflight/decode.cuda_graphs" in items and "preflight/checkpoint.resume" in items
    assert "no CUDA" in lines["preflight/decode.cuda_graphs"] and lines["preflight/checkpoint.resume"].split()[1] == "ok"
    assert (tmp_path / "preflight.json").is_file() and (tmp_path / "pytest-gpu.log").is_file()
    assert (tmp_path / "summary.txt").read_text().count("\n") == len(p.stdout.strip().splitlines())
