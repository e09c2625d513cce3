"""Where the Transformer Engine tier (tests marked ``te``, in tests/te/) runs.

TE's kernels need a GPU, but its PyTorch modules can be *constructed* on the CPU (parameters on the CPU,
no forward pass), which is enough to check everything the TE spec names, saves, converts and loads. TE
cannot be installed beside this project's CPU torch (it needs the CUDA build of torch 2.14.1), so the
tier runs in a virtualenv of its own made by ``bash .ci/setup-te-venv``:

* in an interpreter where TE imports (that venv, or an NGC container), tests/te/ runs in-process;
* anywhere else, tests/test_te_tier.py runs tests/te/ in that venv (venv_tier.py: how, and when it skips).
"""

from __future__ import annotations

import functools

from venv_tier import VenvTier


@functools.lru_cache(maxsize=1)
def te_in_process() -> bool:
    """True when Transformer Engine's PyTorch part and megatron's TE extension import here."""
    try:
        import torch  # noqa: F401  (before TE, or libnccl is not found)
        import transformer_engine.pytorch  # noqa: F401
        import megatron.core.extensions.transformer_engine  # noqa: F401
    except Exception:
        return False
    return True


TIER = VenvTier("Transformer Engine", "TE", "te", "TE", ".te-venv", ".ci/setup-te-venv")
