"""Runs the Transformer Engine tier (tests/te/, marker ``te``) in its own virtualenv when this
interpreter has no TE (tests/te_tier.py says why it needs one)."""

import os
import re
import subprocess
import sys

import pytest

from te_tier import ROOT, te_in_process, te_required, te_venv, te_venv_python


@pytest.mark.slow
def test_te_tier_in_its_venv():
    if te_in_process():
        pytest.skip("Transformer Engine imports in this interpreter: tests/te/ ran in-process")
    py = te_venv_python()
    if py is None:
        msg = (f"the Transformer Engine tier did not run: no TE virtualenv at {te_venv()} "
               "(make it with `bash .ci/setup-te-venv`, or point GSPO_TE_VENV at one)")
        if te_required():
            pytest.fail(msg + "; GSPO_REQUIRE_TE=1 says it must run")
        pytest.skip(msg)
    env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
    env.pop("VIRTUAL_ENV", None)
    cmd = [py, "-m", "pytest", "-q", "-m", "te", "-p", "no:cacheprovider", os.path.join(ROOT, "tests", "te")]
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
    out = p.stdout + p.stderr
    sys.stdout.write(out[-3000:])  # the tier's own summary, under -rA / on failure
    assert p.returncode == 0, f"the TE tier failed in {te_venv()} (rc={p.returncode}):\n{out[-12000:]}"
    summary = [ln for ln in p.stdout.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)][-1]
    passed = re.search(r"(\d+) passed", summary)
    assert passed and int(passed.group(1)) > 0, f"the TE tier passed nothing: {summary}"
    assert "skipped" not in summary, f"the TE tier skipped tests in its own venv: {summary}\n{out[-6000:]}"
