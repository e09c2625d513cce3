"""The model-family registry and the description of a mapping that both converters walk.

Nothing here knows a model family. A family is one module (e.g. ``qwen3_moe.py``) that subclasses
``ModelMapping`` and lists its ``Rule``s: each rule pairs ONE chunk of one Megatron global tensor
(whole tensor, one layer, or one (layer, expert) slice) with the Hugging Face tensors it is made
of, and carries the two transforms. Both converters walk the same rules, so the mapping exists once.
A family registers itself under its HF ``model_type`` with ``@register``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from checkpoints_tools.errors import ConversionError


@dataclass(frozen=True)
class MTensor:
    """One Megatron torch_dist global tensor.

    ``stack_dims`` leading axes are chunked one index at a time (0: whole tensor, 1: per layer,
    2: per (layer, expert)). ``aliases`` are other spellings of the same tensor used by another
    megatron layer spec (e.g. Transformer Engine): written too on import, accepted on export.
    """

    key: str
    shape: tuple[int, ...]
    stack_dims: int = 0
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Rule:
    """One Megatron chunk <-> the HF tensors it is made of.

    ``index`` addresses the chunk on the tensor's leading ``stack_dims`` axes; the chunk's own
    shape (what the transforms see) is ``mtensor.shape[len(index):]``.
    """

    mtensor: MTensor
    index: tuple[int, ...]
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    to_megatron: Callable[[list[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return tuple(self.mtensor.shape[len(self.index):])

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(self.index) + (0,) * len(self.chunk_shape)

    @property
    def sizes(self) -> tuple[int, ...]:
        return (1,) * len(self.index) + self.chunk_shape


@dataclass
class Group:
    """A unit of progress and of bounded memory: the embedding, one layer, the final tensors."""

    name: str
    rules: list[Rule] = field(default_factory=list)
    # megatron ShardedObject unique keys ("<key>/shard_<offsets>_<shape>") written with None
    # payload: the `_extra_state` of megatron / TE linear layers, which a load requests.
    objects: list[str] = field(default_factory=list)


def extra_state_key(key: str, index: Sequence[int] = (), lead_shape: Sequence[int] = ()) -> str:
    """megatron ShardedObject.unique_key for an ``_extra_state`` chunk (no offsets -> shard_0_1)."""
    if not index:
        index, lead_shape = (0,), (1,)
    return f"{key}/shard_{'.'.join(map(str, index))}_{'.'.join(map(str, lead_shape))}"


class ModelMapping:
    """Base of a model family's parameter mapping. Subclasses set ``model_type`` (the HF
    config.json value) and implement the four methods below; everything else is generic."""

    model_type: str = ""

    def __init__(self, cfg):
        self.cfg = cfg

    # -- config ---------------------------------------------------------------------------------
    @classmethod
    def model_config_from_hf(cls, hf_config: dict):
        """HF config.json dict -> megatron_gspo ModelConfig."""
        raise NotImplementedError

    def hf_config(self, base: Optional[dict], dtype: torch.dtype) -> dict:
        """config.json for the exported model: ``base`` (an HF config of this family, or None)
        with every architecture field overwritten from ``self.cfg``."""
        raise NotImplementedError

    # -- tensors --------------------------------------------------------------------------------
    def megatron_tensors(self) -> list[MTensor]:
        raise NotImplementedError

    def groups(self) -> list[Group]:
        raise NotImplementedError

    # -- derived --------------------------------------------------------------------------------
    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for g in self.groups():
            for r in g.rules:
                out.update(zip(r.hf_names, r.hf_shapes))
        return out

    def hint(self, name: str) -> str:
        """A config field to suspect when tensor ``name`` mismatches (family specific)."""
        return ""


_REGISTRY: dict[str, type[ModelMapping]] = {}


def register(cls: type[ModelMapping]) -> type[ModelMapping]:
    if not cls.model_type:
        raise ValueError(f"{cls.__name__}.model_type is empty")
    _REGISTRY[cls.model_type] = cls
    return cls


def get_mapping(model_type: Optional[str]) -> type[ModelMapping]:
    if model_type not in _REGISTRY:
        raise ConversionError(
            f"model_type={model_type!r} has no converter; supported: {sorted(_REGISTRY)}")
    return _REGISTRY[model_type]


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)
