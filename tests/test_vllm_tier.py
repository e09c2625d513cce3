"""Runs the vLLM tier (tests/vllm/, marker ``vllm``) in its own virtualenv when this interpreter has no vLLM
(tests/vllm_tier.py says why it needs one)."""

import pytest

from vllm_tier import TIER, vllm_in_process


@pytest.mark.slow
def test_vllm_tier_in_its_venv():
    TIER.run(vllm_in_process())
