"""The TE tier's environment itself: Transformer Engine's modules construct on the CPU here (that is what
every other test of the tier relies on), and no TE kernel can run (so no test of the tier can claim one
did)."""

import pytest
import torch


def test_te_imports_with_megatrons_extension():
    import transformer_engine
    import transformer_engine.pytorch as te
    from megatron.core.extensions.transformer_engine import TENorm  # noqa: F401

    assert transformer_engine.__version__.startswith("2.")
    norm = te.RMSNorm(16, device="cpu")
    assert norm.weight.device.type == "cpu" and norm.weight.shape == (16,)


def test_no_te_kernel_runs_here():
    if torch.cuda.is_available():
        pytest.skip("a CUDA device is present: TE kernels can run on this machine")
    import transformer_engine.pytorch as te

    norm = te.RMSNorm(16, device="cpu")
    with pytest.raises(Exception):
        norm(torch.ones(2, 16))
