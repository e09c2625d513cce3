"""Prompts in, rewards out: prompt datasets and the resumable sampler (prompts), tokenizers, built-in and
reasoning-gym tasks, the reward registry, the math reward's math-verify child process.

The names below are re-exported from their modules on first use (``from megatron_gspo.data import
Prompt``), so importing one submodule does not import the rest of the package.
"""


import importlib

_EXPORTS = {
    "Prompt": "prompts",
    "PromptDataset": "prompts",
    "PromptExample": "prompts",
    "PromptSampler": "prompts",
    "build_eval_prompts": "prompts",
    "build_prompt_sampler": "prompts",
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
