"""HF <-> Megatron checkpoint conversion (torch_dist, any TP/EP/ETP layout), streaming and
bounded in memory: neither direction ever materializes the model.

    python -m checkpoints_tools.hf_to_megatron --hf-dir HF --out MCORE [--force]
    python -m checkpoints_tools.megatron_to_hf --ckpt MCORE --out HF --tokenizer-dir T [--max-shard-size 5GB] [--force]

Modules:

* ``hf_to_megatron``, ``megatron_to_hf``: the two commands (validate everything, then convert one
  tensor group -- the embedding, a layer, the final tensors -- at a time);
* ``mapping``: the model-family registry and the ``Rule``s both directions walk;
* ``qwen3_moe``: the Qwen3-MoE family (the parameter mapping, both directions, in one place);
* ``safetensors_io``: HF safetensors, one tensor at a time (positioned reads, a streaming writer);
* ``torch_dist_io``: megatron's torch_dist format, a streaming writer and a region reader;
* ``files``: the atomic output directory, side files (tokenizer & co.), JSON;
* ``cli``: the commands' shared options, progress lines, summary and exit status;
* ``errors``: ``ConversionError``.

A model family is one module registering a ``mapping.ModelMapping`` subclass under its HF
``model_type`` (see ``qwen3_moe.py``); importing this package registers the built-in ones.
"""

from checkpoints_tools.errors import ConversionError
from checkpoints_tools.mapping import ModelMapping, get_mapping, register, supported_model_types
from checkpoints_tools import qwen3_moe  # noqa: F401  (registers "qwen3_moe")

__all__ = ["ConversionError", "ModelMapping", "get_mapping", "register", "supported_model_types"]
