"""The Transformer Engine tier: tests/conftest.py marks every test under tests/te/ ``te`` and says where
it runs (tests/te_tier.py).

``cpu_models`` builds this project's models through its own code (parallel.initialize, model.build_model,
init_weights): the Transformer Engine spec construct-only (parameters on the CPU, forward refused) and the
local spec, both pinned to the CPU whatever machine runs the tier."""

import pytest


@pytest.fixture
def cpu_models():
    """make(cfg, spec, seed=3) -> (model, state) of one rank on the CPU; spec "te" (construct-only) or "local".
    Every model of one test shares the first call's parallel state (its layout); torn down afterwards."""
    from megatron_gspo import parallel
    from megatron_gspo.config import ParallelConfig
    from megatron_gspo.model import build_model

    states = {}

    def make(cfg, spec: str, seed: int = 3, **par_kw):
        import dataclasses

        impl = {"te": "transformer_engine", "local": "local"}[spec]
        cfg = dataclasses.replace(cfg, transformer_impl=impl)
        par = ParallelConfig(device="cpu", seed=seed, **par_kw)
        if "state" not in states:
            states["state"] = parallel.initialize(cfg, par)
        st = states["state"]
        return build_model(cfg, par, st, construct_only=spec == "te"), st

    yield make
    parallel.destroy()
