"""A test tier that runs in a virtualenv of its own, because what it tests cannot be installed beside the main
suite's torch: the Transformer Engine tier (te_tier.py) and the vLLM tier (vllm_tier.py).

Where the tier's package imports, its tests (tests/te/ or tests/vllm/, under the marker of the same name) run
in-process; anywhere else tests/test_te_tier.py or tests/test_vllm_tier.py runs them in the venv (``$GSPO_<ENV>_VENV``, else ``<venv_dir>`` in the
repository root) and fails with their output when any of them fails or skips; without the venv it skips,
saying how to make it, or fails under ``GSPO_REQUIRE_<ENV>=1`` (which .ci/run sets once the venv is built,
so CI never skips a tier silently)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@dataclass(frozen=True)
class VenvTier:
    name: str  # what the tier needs, in messages: "Transformer Engine", "vLLM"
    short: str  # its short name in messages: "TE", "vLLM"
    marker: str  # the pytest marker, and the directory under tests/
    env: str  # GSPO_<env>_VENV, GSPO_REQUIRE_<env>
    venv_dir: str  # the default venv, in the repository root
    setup: str  # the script that builds the venv

    def venv(self) -> str:
        return os.environ.get(f"GSPO_{self.env}_VENV") or os.path.join(ROOT, self.venv_dir)

    def python(self) -> Optional[str]:
        py = os.path.join(self.venv(), "bin", "python")
        return py if os.access(py, os.X_OK) else None

    def required(self) -> bool:
        return os.environ.get(f"GSPO_REQUIRE_{self.env}", "") not in ("", "0")

    def run(self, in_process: bool) -> None:
        """The tier's tests in its venv (the body of tests/test_te_tier.py and tests/test_vllm_tier.py)."""
        if in_process:
            pytest.skip(f"{self.name} is installed in this interpreter: tests/{self.marker}/ ran in-process")
        py = self.python()
        if py is None:
            msg = (f"the {self.name} tier did not run: no {self.short} virtualenv at {self.venv()} "
                   f"(make it with `bash {self.setup}`, or point GSPO_{self.env}_VENV at one)")
            if self.required():
                pytest.fail(msg + f"; GSPO_REQUIRE_{self.env}=1 says it must run")
            pytest.skip(msg)
        env = {**os.environ, "PYTHONPATH": ROOT, "PYTHONWARNINGS": "ignore", "CUDA_VISIBLE_DEVICES": ""}
        env.pop("VIRTUAL_ENV", None)
        cmd = [py, "-m", "pytest", "-q", "-m", self.marker, "-p", "no:cacheprovider",
               os.path.join(ROOT, "tests", self.marker)]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=1800)
        out = p.stdout + p.stderr
        sys.stdout.write(out[-3000:])  # the tier's own summary, under -rA / on failure
        assert p.returncode == 0, f"the {self.short} tier failed in {self.venv()} (rc={p.returncode}):\n{out[-12000:]}"
        summary = [ln for ln in p.stdout.splitlines() if re.search(r"\d+ (passed|failed|skipped|error)", ln)][-1]
        passed = re.search(r"(\d+) passed", summary)
        assert passed and int(passed.group(1)) > 0, f"the {self.short} tier passed nothing: {summary}"
        assert "skipped" not in summary, f"the {self.short} tier skipped tests in its own venv: {summary}\n{out[-6000:]}"
