"""HF <-> Megatron checkpoint conversion (torch_dist, any TP/EP/ETP layout), streaming and
bounded in memory.

    python -m checkpoints_tools.hf_to_megatron --hf-dir HF --out MCORE [--force]
    python -m checkpoints_tools.megatron_to_hf --ckpt MCORE --out HF --tokenizer-dir T [--max-shard-size 5GB] [--force]

A model family is one module registering a ``common.ModelMapping`` subclass under its HF
``model_type`` (see ``qwen3_moe.py``); importing this package registers the built-in ones.
"""

from checkpoints_tools.common import (ConversionError, ModelMapping, get_mapping, register,
                                      supported_model_types)
from checkpoints_tools import qwen3_moe  # noqa: F401  (registers "qwen3_moe")

__all__ = ["ConversionError", "ModelMapping", "get_mapping", "register", "supported_model_types"]
