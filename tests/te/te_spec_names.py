"""Names shared by the Transformer Engine tier's tests: how the TE spec's state-dict names map to the local
spec's (model.build_layer_spec, init_weights.unit_name), and the keys a model's sharded state dict asks a
checkpoint for."""

import re


def te_to_local(name: str) -> str:
    """A TE-spec state-dict name as the local spec names the same tensor (the renames model.build_layer_spec
    and init_weights.unit_name describe)."""
    name = name.replace(".self_attention.linear_qkv.layer_norm_weight", ".input_layernorm.weight")
    return re.sub(r"\.experts\.(linear_fc[12])\.weight(\d+)$", r".experts.local_experts.\2.\1.weight", name)


def tensors(model) -> dict:
    return {k: v for k, v in model.state_dict().items() if not k.endswith("_extra_state")}


def sharded_keys(model) -> set:
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import ShardedObject, ShardedTensorFactory

    out = set()
    for sh in nested_values(model.sharded_state_dict()):
        if isinstance(sh, ShardedTensorFactory):
            out.add(sh.key)
        else:
            out.add(sh.unique_key if isinstance(sh, ShardedObject) else sh.key)
    return out
