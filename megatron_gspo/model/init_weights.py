"""Initial weights that depend on the seed alone, never on the parallel layout.

megatron-core draws a rank's parameters from that rank's RNG stream in construction order, so
under expert parallelism each EP rank draws its *local* experts 0..E/ep-1 (and every later layer
from a shifted stream): an EP=2 model starts from other weights than the one-rank model of the same
seed, and no EP run can be compared with a one-rank run. Here every parameter is re-drawn from a
generator keyed by ``(seed, unit)``, where a unit is the layout-free identity of a weight tensor:

    decoder.layers.<global layer>.mlp.experts.<global expert>.linear_fc1.weight
    decoder.layers.<global layer>.self_attention.linear_qkv.weight
    embedding.word_embeddings.weight ...

Units are spec-free too: the local spec's ``input_layernorm.weight`` is the unit the Transformer Engine
spec fuses into ``self_attention.linear_qkv.layer_norm_weight`` (the name both specs' checkpoints use,
model.build_layer_spec), and TE's grouped experts ``linear_fc1.weight<e>`` are expert ``e``'s unit. So
both specs draw the same numbers from one seed, and weight sync streams between them (tests/te/).

The full unit tensor (its TP=1 shape) is drawn and this rank keeps its tensor-parallel shard, cut
exactly as megatron cuts the full tensor (``partition_dim``; the SwiGLU ``linear_fc1`` is cut in its
gate and up halves separately). So a TP=2 x EP=2 model holds, shard for shard, the one-rank model's
numbers (tests/test_init_weights.py checks it bit for bit through dist_checkpointing's global keys).

Distributions are megatron's defaults (checked against megatron's own init in the tests):
``N(0, init_method_std)`` for every matrix, ``N(0, init_method_std / sqrt(2 * num_layers))`` for the
output projections of the attention and MLP blocks (``linear_proj``, ``linear_fc2``), ones for norm
weights. A parameter this table does not know is an error naming it, never a silently random one.

Cost: each rank draws the full unit of every parameter it holds a shard of (the dense weights once
per TP rank, its own experts only), on the parameter's device.
"""

from __future__ import annotations

import hashlib
import math
import re
from dataclasses import dataclass
from typing import Optional

import torch

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.")
# the local spec's input norm: fused into linear_qkv by the TE spec, saved under TE's name by both
_INPUT_NORM = re.compile(r"\.input_layernorm\.weight$")
# megatron SequentialMLP (and our BatchedSequentialMLP): ...experts.local_experts.<e>.linear_fc1.weight
_LOCAL_EXPERT = re.compile(r"\.experts\.local_experts\.(\d+)\.")
# Transformer Engine grouped GEMM experts: ...experts.linear_fc1.weight<e>
_GROUPED_EXPERT = re.compile(r"\.experts\.(linear_fc[12])\.weight(\d+)$")
# expert linears of the Transformer Engine spec: grouped (linear_fc1.weight<e>) or per expert
_TE_EXPERT_LINEAR = re.compile(r"\.experts\.(?:local_experts\.\d+\.)?(linear_fc[12])\.weight\d*$")
_NORM = re.compile(r"(layernorm\.weight|layer_norm_weight|final_layernorm\.weight|norm\.weight)$")
_OUTPUT_PROJ = re.compile(r"(linear_proj\.weight|linear_fc2\.weight\d*)$")


def unit_name(name: str, layer_numbers: dict[int, int], expert_offset: int) -> str:
    """Layout- and spec-free name of local parameter ``name``: global layer and global expert indices, TE's
    name for the input norm.

    layer_numbers: local layer index -> global 0-based layer; expert_offset: global index of this
    rank's local expert 0 (ep_rank x experts per EP rank)."""
    m = _LAYER.match(name)
    if m:
        name = f"decoder.layers.{layer_numbers[int(m.group(1))]}." + name[m.end():]
    m = _LOCAL_EXPERT.search(name)
    if m:
        name = name[:m.start()] + f".experts.{expert_offset + int(m.group(1))}." + name[m.end():]
    m = _GROUPED_EXPERT.search(name)
    if m:
        name = name[:m.start()] + f".experts.{expert_offset + int(m.group(2))}.{m.group(1)}.weight"
    return _INPUT_NORM.sub(".self_attention.linear_qkv.layer_norm_weight", name)


def init_std(name: str, std: float, num_layers: int) -> Optional[float]:
    """The normal std megatron uses for ``name``; None for a norm weight (ones)."""
    if _NORM.search(name):
        return None
    if _OUTPUT_PROJ.search(name):
        return std / math.sqrt(2.0 * num_layers)
    return std


def _generator(seed: int, unit: str, device: torch.device) -> torch.Generator:
    digest = hashlib.blake2b(f"{seed}:{unit}".encode(), digest_size=8).digest()
    g = torch.Generator(device=device)
    g.manual_seed(int.from_bytes(digest, "little") & ((1 << 63) - 1))
    return g


def shard(full: torch.Tensor, dim: int, size: int, rank: int, glu: bool) -> torch.Tensor:
    """This TP rank's cut of the full unit tensor, as megatron lays it out."""
    if size == 1:
        return full
    if glu:  # [gate; up] -> [gate shard; up shard] (megatron's SwiGLU linear_fc1 under TP)
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(size, dim=dim)[rank], up.chunk(size, dim=dim)[rank]], dim=dim)
    return full.chunk(size, dim=dim)[rank]


def unshard(parts: list[torch.Tensor], dim: int, glu: bool) -> torch.Tensor:
    """The full unit tensor from every TP rank's cut (``shard``'s inverse; parts in TP-rank order)."""
    if len(parts) == 1:
        return parts[0]
    if glu:
        gates, ups = zip(*(p.chunk(2, dim=dim) for p in parts))
        return torch.cat([torch.cat(gates, dim=dim), torch.cat(ups, dim=dim)], dim=dim)
    return torch.cat(parts, dim=dim)


@dataclass(frozen=True)
class ShardSpec:
    """How megatron cuts one parameter: over ``group`` (``size`` ranks, this one ``rank``) along ``dim``,
    the SwiGLU gate and up halves separately when ``glu``. ``size == 1``: every rank holds it whole."""

    size: int
    rank: int
    dim: int
    glu: bool
    group: object


def shard_spec(name: str, p: torch.Tensor, state, gated_linear_unit: bool = True) -> ShardSpec:
    """The cut of local parameter ``name``: routed experts over the expert-tensor-parallel group, everything
    else over TP, only where megatron marked the parameter ``tensor_model_parallel``."""
    import torch.distributed as dist

    if ".mlp.experts." in name:
        group = state.pg.expt_tp
        size, rank = dist.get_world_size(group), dist.get_rank(group)
    else:
        group, size, rank = state.tp_group, state.tp, state.tp_rank
    glu = gated_linear_unit and re.search(r"linear_fc1\.weight\d*$", name) is not None
    if size > 1 and not hasattr(p, "tensor_model_parallel"):
        m = _TE_EXPERT_LINEAR.search(name)
        if m:
            # megatron builds the Transformer Engine spec's expert linears (TEGroupedLinear, and TE's linears
            # inside SequentialMLP) with parallel_mode=None and does the expert-TP split itself
            # ("explicit_expert_comm"), so TE never marks their weights; the cut is megatron's column
            # (linear_fc1, SwiGLU halves apart) / row (linear_fc2) split, as its sharded state dict describes.
            return ShardSpec(size, rank, 0 if m.group(1) == "linear_fc1" else 1, glu, group)
    if not getattr(p, "tensor_model_parallel", False) or size == 1:
        return ShardSpec(1, 0, 0, False, group)
    return ShardSpec(size, rank, int(getattr(p, "partition_dim", 0)), glu, group)


def unit_names(model, state) -> dict[str, str]:
    """{local parameter name: layout-free unit name} of this rank's GPTModel shard."""
    layers = getattr(getattr(model, "decoder", None), "layers", [])
    layer_numbers = {i: layer.layer_number - 1 for i, layer in enumerate(layers)}
    cfg = getattr(model, "config", None)
    per_rank = cfg.num_moe_experts // state.ep if cfg is not None and cfg.num_moe_experts else 0
    return {name: unit_name(name, layer_numbers, state.ep_rank * per_rank) for name, _ in model.named_parameters()}


@torch.no_grad()
def init_weights(model, seed: int, state, *, init_method_std: float, num_layers: int,
                 gated_linear_unit: bool = True) -> None:
    """Re-draw every parameter of this rank's GPTModel shard from ``seed`` (see the module doc).

    state: the ParallelState (TP / expert-TP / EP ranks and sizes)."""
    units = unit_names(model, state)
    for name, p in model.named_parameters():
        unit = units[name]
        std = init_std(unit, init_method_std, num_layers)
        if std is None:
            p.fill_(1.0)
            continue
        if p.dim() < 2:
            raise ValueError(f"init_weights: no initialization rule for the {p.dim()}-D parameter {name!r}")
        spec = shard_spec(name, p, state, gated_linear_unit)
        shape = list(p.shape)
        shape[spec.dim] *= spec.size
        full = torch.empty(shape, dtype=torch.float32, device=p.device)
        full.normal_(0.0, std, generator=_generator(seed, unit, p.device))
        p.copy_(shard(full, spec.dim, spec.size, spec.rank, spec.glu).to(p.dtype))
