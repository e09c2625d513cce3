"""Generation on the training model: the Generator and its sampling loop (generator), the model forwards
behind one decoder interface (decoder, lean_decoder), layout-free sampling noise (sampling).

The names below are re-exported from their modules on first use (``from megatron_gspo.generation import
GenerationOutput``), so importing one submodule does not import the rest of the package.
"""


import importlib

_EXPORTS = {
    "GenerationOutput": "generator",
    "Generator": "generator",
    "generate": "generator",
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
