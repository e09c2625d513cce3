"""The Transformer Engine tier: tests/conftest.py marks every test under tests/te/ ``te`` and says where
it runs (tests/te_tier.py)."""
