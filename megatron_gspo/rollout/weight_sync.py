"""The trainer's weights streamed to the rollout ranks, from the training layout to the rollout layout.

Both sides name every weight by its layout-free unit (init_weights.unit_name: global layer and expert
index) and know how megatron cuts it (init_weights.shard_spec). The stream is a fixed, ordered list of
units (``plan``, the same on every rank of both sides; its digest is checked at every sync), cut into
buckets of at most ``rollout.weight_sync_bucket_mb`` of full tensors (a tensor larger than that is a
bucket of its own). Per bucket:

  trainer, every rank     its TP / expert-TP shards all-gathered and put together (init_weights.unshard),
                          the experts of every EP rank broadcast over the EP group: each rank then holds
                          the bucket's full tensors (megatron's own groups, comm.py collectives)
  trainer rank 0          broadcasts the bucket, flat, over the bridge (bridge rank 0)
  every rollout rank      receives it and copies its own cut of each unit it holds into its parameter

Nothing but copies moves the bits: the rollout copy is bit-identical to the trainer's parameters
(tests/test_async_rollout.py checks TP / EP / DP layout pairs against the one-rank model). Memory: a
bucket's full tensors (plus the gathered shards and, on trainer rank 0, its flat copy), never the
model. Parameters only: the tiny and Qwen3-MoE models hold no trained buffers.
"""

from __future__ import annotations

import hashlib
import re
import time
from dataclasses import dataclass
from typing import Optional

import torch

from megatron_gspo.runtime import comm
from megatron_gspo.model.init_weights import shard, shard_spec, unit_names, unshard

_EXPERT = re.compile(r"\.experts\.(\d+)\.")


@dataclass(frozen=True)
class Unit:
    """One layout-free weight: its name, full (TP = EP = 1) shape and dtype; ``expert``: global expert index."""

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    expert: Optional[int]

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * torch.empty((), dtype=self.dtype).element_size()


def _natural(name: str) -> tuple:
    return tuple((0, int(p)) if p.isdigit() else (1, p) for p in name.split("."))


class Plan:
    """This rank's parameters as units, and the whole model's unit list (every rank of both sides agrees)."""

    def __init__(self, model, state, gated_linear_unit: bool = True) -> None:
        from megatron_gspo.model.gpt import unwrap

        m = unwrap(model)
        self.state = state
        cfg = m.config
        self.num_experts = cfg.num_moe_experts or 0
        self.experts_per_rank = self.num_experts // state.ep if self.num_experts else 0
        names = unit_names(m, state)
        self.local: dict[str, tuple[torch.nn.Parameter, object]] = {}  # unit -> (param, ShardSpec)
        units: dict[str, Unit] = {}
        for local_name, p in m.named_parameters():
            spec = shard_spec(local_name, p, state, gated_linear_unit)
            shape = list(p.shape)
            shape[spec.dim] *= spec.size
            u = names[local_name]
            self.local[u] = (p, spec)
            e = _EXPERT.search(u)
            if e is None:
                units[u] = Unit(u, tuple(shape), p.dtype, None)
                continue
            for g in range(self.num_experts):  # every expert of the model, not only this rank's
                name = u[:e.start()] + f".experts.{g}." + u[e.end():]
                units[name] = Unit(name, tuple(shape), p.dtype, g)
        self.units = sorted(units.values(), key=lambda x: _natural(x.name))

    def digest(self) -> int:
        """63 bits of the unit list (names, shapes, dtypes), to check both sides stream the same model."""
        h = hashlib.sha256("\n".join(f"{u.name}|{u.shape}|{u.dtype}" for u in self.units).encode()).digest()
        return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)

    def owner(self, u: Unit) -> int:
        """EP rank holding unit ``u`` (0 for dense units: every EP rank holds them)."""
        return 0 if u.expert is None else u.expert // self.experts_per_rank

    def buckets(self, bucket_bytes: int) -> list[list[Unit]]:
        """Consecutive units of one dtype, at most ``bucket_bytes`` each (a larger unit alone)."""
        out: list[list[Unit]] = []
        size = 0
        for u in self.units:
            if out and out[-1] and out[-1][-1].dtype == u.dtype and size + u.nbytes <= bucket_bytes:
                out[-1].append(u)
                size += u.nbytes
            else:
                out.append([u])
                size = u.nbytes
        return out

    @property
    def total_bytes(self) -> int:
        return sum(u.nbytes for u in self.units)


def _flat(tensors: list[torch.Tensor], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    if not tensors:
        return torch.empty(0, dtype=dtype, device=device)
    return torch.cat([t.reshape(-1) for t in tensors])


def _split(flat: torch.Tensor, shapes: list[tuple[int, ...]]) -> list[torch.Tensor]:
    out, lo = [], 0
    for s in shapes:
        n = 1
        for d in s:
            n *= d
        out.append(flat[lo:lo + n].view(s))
        lo += n
    return out


def _assemble_shards(plan: Plan, units: list[Unit], device: torch.device) -> dict[str, torch.Tensor]:
    """Full tensors of the ``units`` this rank holds a shard of, shards all-gathered over their TP / expert-TP
    group. Collective over those groups (every member holds the same units of the list)."""
    full: dict[str, torch.Tensor] = {}
    by_group: dict[int, list[Unit]] = {}
    for u in units:
        p, spec = plan.local[u.name]
        if spec.size == 1:
            full[u.name] = p.detach()
        else:
            by_group.setdefault(id(spec.group), []).append(u)
    for group_units in by_group.values():
        specs = [plan.local[u.name][1] for u in group_units]
        mine = _flat([plan.local[u.name][0].detach() for u in group_units], group_units[0].dtype, device)
        parts = comm.all_gather(mine, specs[0].group, what="weight sync: tensor-parallel shards of a bucket")
        local_shapes = [tuple(plan.local[u.name][0].shape) for u in group_units]
        per_rank = [_split(part, local_shapes) for part in parts]
        for i, (u, spec) in enumerate(zip(group_units, specs)):
            full[u.name] = unshard([r[i] for r in per_rank], spec.dim, spec.glu)
    return full


def trainer_bucket(plan: Plan, units: list[Unit], device: torch.device) -> list[torch.Tensor]:
    """The bucket's full tensors, in plan order, on every trainer rank. Collective over the trainer's TP,
    expert-TP and EP groups."""
    st = plan.state
    local_units = [u for u in units if u.expert is None or plan.owner(u) == st.ep_rank]
    full = _assemble_shards(plan, [u for u in local_units if u.expert is None], device)
    full.update(_assemble_shards(plan, [u for u in local_units if u.expert is not None],
                                 device))  # experts: over expert-TP
    experts = [u for u in units if u.expert is not None]
    if experts and st.ep > 1:
        ep_ranks = comm.ranks(st.pg.ep)
        for j in range(st.ep):  # EP rank j's experts of the bucket, to every rank of the EP group
            own = [u for u in experts if plan.owner(u) == j]
            if not own:
                continue
            if j == st.ep_rank:
                buf = _flat([full[u.name] for u in own], own[0].dtype, device)
            else:
                buf = torch.empty(sum(u.numel for u in own), dtype=own[0].dtype, device=device)
            comm.broadcast(buf, ep_ranks[j], st.pg.ep, what="weight sync: one expert-parallel rank's experts")
            if j != st.ep_rank:
                full.update({u.name: t for u, t in zip(own, _split(buf, [u.shape for u in own]))})
    return [full[u.name] for u in units]


def load_bucket(plan: Plan, units: list[Unit], tensors: list[torch.Tensor]) -> int:
    """Copy this rank's cut of each full tensor into its parameter (units it does not hold, i.e. other EP
    ranks' experts, are skipped); returns how many parameters were written."""
    n = 0
    with torch.no_grad():
        for u, t in zip(units, tensors):
            held = plan.local.get(u.name)
            if held is None:
                continue
            p, spec = held
            p.copy_(shard(t, spec.dim, spec.size, spec.rank, spec.glu))
            n += 1
    return n


# ----------------------------------------------------------------------------------------------
# The two ends of a sync
# ----------------------------------------------------------------------------------------------

_HEADER = 4  # [version, digest, buckets, bytes]


@dataclass
class SyncStats:
    version: int
    seconds: float
    bytes: int
    buckets: int


class WeightSender:
    """The trainer's end: every trainer rank calls ``push`` (collective over the trainer's groups; trainer
    rank 0 also streams over the bridge). A failure on the bridge does not stop the trainer's side of the
    protocol (its other ranks are inside the same collectives): ``push`` finishes and says so."""

    def __init__(self, model, state, bridge_pg, bucket_bytes: int, gated_linear_unit: bool = True) -> None:
        self.plan = Plan(model, state, gated_linear_unit)
        self.state, self.pg = state, bridge_pg
        self.buckets = self.plan.buckets(bucket_bytes)

    def push(self, version: int, bridge: bool = True) -> tuple[SyncStats, Optional[str]]:
        """Stream the current parameters as policy ``version``; (stats, None) or (stats, why the bridge failed:
        on trainer rank 0 only). ``bridge=False``: the trainer's collectives only (the rollout ranks are
        known to be gone; the other trainer ranks still take part)."""
        dev = self.state.device
        t0 = time.perf_counter()
        sent, error = 0, None if bridge else "not streamed"
        if self.pg is not None and bridge:
            header = torch.tensor([version, self.plan.digest(), len(self.buckets), self.plan.total_bytes],
                                  dtype=torch.long, device=dev)
            error = self._bridge(lambda: comm.bridge_broadcast(header, 0, self.pg, what="weight sync: header"))
        for units in self.buckets:
            tensors = trainer_bucket(self.plan, units, dev)
            if self.pg is not None and error is None:
                flat = _flat(tensors, units[0].dtype, dev)
                error = self._bridge(lambda: comm.bridge_broadcast(flat, 0, self.pg, what="weight sync: a bucket"))
                sent += flat.numel() * flat.element_size()
            del tensors
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return SyncStats(version, time.perf_counter() - t0, sent, len(self.buckets)), error

    @staticmethod
    def _bridge(op) -> Optional[str]:
        try:
            op()
            return None
        except RuntimeError as e:  # gloo: connection closed by a dead peer, or the group's timeout
            from megatron_gspo.rollout.side import short_error

            return short_error(e)


class WeightReceiver:
    """A rollout rank's end: ``receive`` once trainer rank 0 announced a push (side.Control)."""

    def __init__(self, model, state, bridge_pg, bucket_bytes: int, gated_linear_unit: bool = True) -> None:
        self.plan = Plan(model, state, gated_linear_unit)
        self.state, self.pg = state, bridge_pg
        self.buckets = self.plan.buckets(bucket_bytes)

    def receive(self) -> SyncStats:
        dev = self.state.device
        t0 = time.perf_counter()
        header = comm.bridge_broadcast(torch.zeros(_HEADER, dtype=torch.long, device=dev), 0, self.pg,
                                       what="weight sync: header")
        version, digest, buckets, total = (int(x) for x in header.tolist())
        if digest != self.plan.digest() or buckets != len(self.buckets) or total != self.plan.total_bytes:
            raise RuntimeError(
                f"weight sync: the trainer streams another model ({buckets} buckets, {total} bytes, digest {digest:x}) "
                f"than this rollout rank holds ({len(self.buckets)} buckets, {self.plan.total_bytes} bytes, digest "
                f"{self.plan.digest():x}): both sides must build the same model.* with the same "
                "rollout.weight_sync_bucket_mb")
        received, written = 0, 0
        for units in self.buckets:
            flat = torch.empty(sum(u.numel for u in units), dtype=units[0].dtype, device=dev)
            comm.bridge_broadcast(flat, 0, self.pg, what="weight sync: a bucket")
            written += load_bucket(self.plan, units, _split(flat, [u.shape for u in units]))
            received += flat.numel() * flat.element_size()
            del flat
        if written != len(self.plan.local):  # every parameter of this rank, exactly once
            raise RuntimeError(f"weight sync: {written} of this rollout rank's {len(self.plan.local)} parameters "
                               "were written")
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return SyncStats(version, time.perf_counter() - t0, received, len(self.buckets))
