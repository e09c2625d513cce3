"""Runs the Transformer Engine tier (tests/te/, marker ``te``) in its own virtualenv when this
interpreter has no TE (tests/te_tier.py says why it needs one)."""

import pytest

from te_tier import TIER, te_in_process


@pytest.mark.slow
def test_te_tier_in_its_venv():
    TIER.run(te_in_process())
