"""Prompts in, rewards out: prompt datasets and the resumable sampler (prompts), tokenizers, built-in and
reasoning-gym tasks, the rewards (the rewards package: registry, batch scoring, one module per reward).

The names below are re-exported from their modules on first use (``from megatron_gspo.data import
Prompt``), so importing one submodule does not import the rest of the package.
"""


from megatron_gspo import lazy_exports

_EXPORTS = {
    "Prompt": "prompts",
    "PromptDataset": "prompts",
    "PromptExample": "prompts",
    "PromptSampler": "prompts",
    "build_eval_prompts": "prompts",
    "build_prompt_sampler": "prompts",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
