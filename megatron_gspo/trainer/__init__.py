"""The Trainer: its loop (loop), its components (components), hooks, the SFT warm start (sft), held-out evaluation (evaluation), the
optimizer and LR schedule (optim).

The names below are re-exported from their modules on first use (``from megatron_gspo.trainer import
Hooks``), so importing one submodule does not import the rest of the package.
"""


import importlib

_EXPORTS = {
    "Hooks": "hooks",
    "Trainer": "loop",
    "TrainerHook": "hooks",
    "TrainingStopped": "loop",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
        globals()[name] = value  # the next lookup is a plain attribute
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
