"""``train.deterministic``: the same bits from the same inputs on a GPU too.

On the CPU the project's kernels are deterministic already (tests/test_layouts.py and the resume tests
compare runs bit for bit). On a GPU several are not by default: atomics in scatter-adds (MoE token
combine, embedding backward), cuBLAS's split-K workspace, NCCL's choice of reduction algorithm,
Transformer Engine's fused attention. Deterministic mode, as megatron-core's own
(``--deterministic-mode``, docs "Deterministic Training"), sets:

* ``torch.use_deterministic_algorithms(True)``: deterministic kernels where torch has them (megatron
  0.16's MoE unpermute then uses index_add_), an error naming the op where it has none;
* cuDNN deterministic, no autotuning;
* the environment, before the first cuBLAS / NCCL / TE call: ``CUBLAS_WORKSPACE_CONFIG=:4096:8``,
  ``NCCL_ALGO=Ring`` (a fixed reduction order), ``NVTE_ALLOW_NONDETERMINISTIC_ALGO=0``. A value the
  launcher already set is kept if it is one of those megatron validated, refused otherwise;
* megatron's ``TransformerConfig.deterministic_mode`` (model.build_transformer_config).

It costs speed (deterministic kernels are slower; see docs/layouts.md). ``enable`` returns a function
that puts the process-wide settings back (the trainer's ``close``), so a later job in the process
starts from the defaults.
"""

from __future__ import annotations

import os
from typing import Callable

import torch

from megatron_gspo.errors import ConfigError

# variable -> (values megatron-core validated as deterministic, the value set when unset)
ENV = {
    "CUBLAS_WORKSPACE_CONFIG": ((":4096:8", ":16:8"), ":4096:8"),
    "NCCL_ALGO": (("Ring", "CollnetDirect", "CollnetChain", "^NVLS"), "Ring"),
    "NVTE_ALLOW_NONDETERMINISTIC_ALGO": (("0",), "0"),
}


def check_env(environ=os.environ) -> None:
    """Refuse a launcher-set value that deterministic mode cannot keep (naming the variable)."""
    for name, (ok, _) in ENV.items():
        v = environ.get(name)
        if v is not None and v not in ok:
            raise ConfigError(f"train.deterministic=true but the environment sets {name}={v!r}, which is not "
                              f"deterministic; unset it or use one of {list(ok)}")


def enable() -> Callable[[], None]:
    """Turn deterministic mode on for this process; returns the function that turns it off again."""
    check_env()
    saved_env = {name: os.environ.get(name) for name in ENV}
    saved = (torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled(),
             torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark)
    for name, (_, default) in ENV.items():
        os.environ.setdefault(name, default)
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False

    def restore() -> None:
        for name, v in saved_env.items():
            if v is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = v
        torch.use_deterministic_algorithms(saved[0], warn_only=saved[1])
        torch.backends.cudnn.deterministic, torch.backends.cudnn.benchmark = saved[2], saved[3]

    return restore
