"""The network: megatron-core's GPTModel with MoE built from a ModelConfig (gpt), its attention, experts,
output layer and initial weights, the log-prob paths (logprobs, fused_logprobs), and what sizes a job
(memory_estimate, oom, flops, fp8_alignment).

The names below are re-exported from their modules on first use (``from megatron_gspo.model import
aux_loss_scales``), so importing one submodule does not import the rest of the package.
"""


from megatron_gspo import lazy_exports

_EXPORTS = {
    "aux_loss_scales": "gpt",
    "build_layer_spec": "gpt",
    "build_model": "gpt",
    "build_transformer_config": "gpt",
    "causal_attention_mask": "gpt",
    "clear_aux_losses_tracker": "gpt",
    "finalize_grads": "gpt",
    "forward_logits": "gpt",
    "forward_logprobs": "gpt",
    "input_padding_mask": "gpt",
    "model_summary": "gpt",
    "resolve_impl": "gpt",
    "set_aux_loss_scale": "gpt",
    "unwrap": "gpt",
    "wrap_ddp": "gpt",
}
__all__ = sorted(_EXPORTS)


__getattr__, __dir__ = lazy_exports(__name__, _EXPORTS)
