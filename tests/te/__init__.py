"""The Transformer Engine tier (tests/conftest.py, tests/te_tier.py). A package, so that its conftest.py is
imported as ``te.conftest`` and does not take the name ``conftest`` from tests/conftest.py, which test
modules import helpers from (``from conftest import ...``) when one pytest run collects both."""
