"""The Trainer: its loop (loop), its components (components), the stop story (stopping), hooks, the SFT
warm start (sft), held-out evaluation (evaluation), the optimizer and LR schedule (optim).

The names below are re-exported from their modules on first use (``from megatron_gspo.trainer import
Hooks``), so importing one submodule does not import the rest of the package.
"""


from megatron_gspo import lazy_exports

_EXPORTS = {
    "Hooks": "hooks",
    "Trainer": "loop",
    "TrainerHook": "hooks",
    "StoppedFor": "stopping",  # runtime/exit_status.py's: what run() raises when the job stops early
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
