"""Generation on the training model: the Generator and its sampling loop (generator), the model forwards
behind one decoder interface (decoder, lean_decoder), layout-free sampling noise (sampling).

The names below are re-exported from their modules on first use (``from megatron_gspo.generation import
GenerationOutput``), so importing one submodule does not import the rest of the package.
"""


from megatron_gspo import lazy_exports

_EXPORTS = {
    "GenerationOutput": "generator",
    "Generator": "generator",
    "generate": "generator",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
