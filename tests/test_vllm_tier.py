"""Runs the vLLM tier (tests/vllm/, marker ``vllm``) in its own virtualenv when this interpreter has no vLLM
(tests/vllm_tier.py says why it needs one)."""

import os
import re
import subprocess
import sys

import pytest

from vllm_tier import ROOT, vllm_in_process, vllm_required, vllm_venv, vllm_venv_python


@pytest.mark.slow
def test_vllm_tier_in_its_venv():
    if vllm_in_process():
        pytest.skip("vLLM is installed in this interpreter: tests/vllm/ ran in-process")
    py = vllm_venv_python()
    if py is None:
        msg = (f"the vLLM tier did not run: no vLLM virtualenv at {vllm_venv()} "
               "(make it with `bash .ci/setup-vllm-venv`, or point GSPO_VLLM_VENV at one)")
        if vllm_required():
            pytest.fail(msg + "; GSPO_REQUIRE_VLLM=1 says it must run")
        pytest.skip(msg)
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("VIRTUAL_ENV", None)
    cmd = [py, "-m", "pytest", "-q", "-m", "vllm", "-p", "no:cacheprovider", os.path.join(ROOT, "tests", "vllm")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    out = p.stdout + p.stderr
    sys.stdout.write(out[-3000:])  # the tier's own summary, under -rA / on failure
    assert p.returncode == 0, f"the vLLM tier failed in {vllm_venv()} (rc={p.returncode}):\n{out[-12000:]}"
    summary = [ln for ln in p.stdout.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)][-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0, f"the vLLM tier passed nothing: {summary}"
    assert "skipped" not in summary, f"the vLLM tier skipped tests in its own venv: {summary}\n{out[-6000:]}"
