"""Training metrics that reduce exactly over data-parallel ranks.

A loss function cannot return a finished mean: each DP rank holds a different slice of the global
batch, often with different numbers of sequences and tokens, so the average of per-rank means is not
the mean over the global batch. Losses therefore return *local sufficient statistics* wrapped in a
``Metric`` whose ``kind`` tells the reducer how to combine them:

    kind    stats (1-D float64, detached)   combine across ranks / micro-batches   final value
    ------  ------------------------------  -------------------------------------  ---------------------
    "mean"  [sum, count]                    SUM                                    sum / count
    "std"   [sum, sum_of_squares, count]    SUM                                    population std
    "sum"   [sum]                           SUM                                    sum
    "min"   [min]  (+inf when empty)        MIN                                    min (nan when empty)
    "max"   [max]  (-inf when empty)        MAX                                    max (nan when empty)
    "cat"   [v0, v1, ...] any length        concatenate in rank order              1-D CPU tensor

``reduce_metrics(local, group)`` does the whole reduction with one SUM all-reduce, one MAX
all-reduce (mins travel negated) and, only when "cat" metrics exist, one all-gather of lengths plus
one padded all-gather of values. Stats are float64, so DP=1 and DP=2 agree up to float64 summation
order (~1e-16 relative); mins, maxes and concatenated values agree bit for bit.

``MetricAccumulator`` merges the metrics of several micro-batches of one optimizer step locally
(same rules) so that a single reduction happens per step.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Union

import torch
import torch.distributed as dist

from megatron_gspo.runtime import comm

KINDS = ("mean", "std", "sum", "min", "max", "cat")
_SUMMED = ("mean", "std", "sum")
_STATS_LEN = {"mean": 2, "std": 3, "sum": 1, "min": 1, "max": 1}

MetricValue = Union[float, torch.Tensor]


def _as_stats(values: torch.Tensor, mask: Optional[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """(values as detached float64, boolean selection of the same shape)."""
    v = values.detach().to(torch.float64)
    if mask is None:
        sel = torch.ones_like(v, dtype=torch.bool)
    else:
        sel = mask.detach()
        sel = sel if sel.dtype == torch.bool else sel != 0
        sel = torch.broadcast_to(sel, v.shape)
    return v, sel


@dataclass(frozen=True, eq=False)  # eq on tensors would be elementwise; compare .stats instead
class Metric:
    """A local sufficient statistic; see the module docstring for each kind's layout."""

    kind: str
    stats: torch.Tensor

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"Metric kind {self.kind!r} is not one of {list(KINDS)}")
        if self.stats.dim() != 1:
            raise ValueError(f"Metric stats must be 1-D, got shape {tuple(self.stats.shape)}")
        want = _STATS_LEN.get(self.kind)
        if want is not None and self.stats.numel() != want:
            raise ValueError(f"Metric kind {self.kind!r} needs {want} stats, got {self.stats.numel()}")

    # -- constructors (values are detached and upcast to float64; mask selects entries) -----------

    @classmethod
    def mean(cls, values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> "Metric":
        v, sel = _as_stats(values, mask)
        # where() rather than multiply: a NaN/inf at an unselected entry must not leak into the sum.
        total = torch.where(sel, v, 0.0).sum()
        return cls("mean", torch.stack([total, sel.sum().to(torch.float64)]))

    @classmethod
    def from_sum_count(cls, total: torch.Tensor | float, count: torch.Tensor | float) -> "Metric":
        """A mean whose numerator and denominator were computed by the caller (e.g. a loss)."""
        t = torch.as_tensor(total).detach().to(torch.float64).reshape(())
        c = torch.as_tensor(count, device=t.device).detach().to(torch.float64).reshape(())
        return cls("mean", torch.stack([t, c]))

    @classmethod
    def std(cls, values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> "Metric":
        v, sel = _as_stats(values, mask)
        x = torch.where(sel, v, 0.0)
        return cls("std", torch.stack([x.sum(), (x * x).sum(), sel.sum().to(torch.float64)]))

    @classmethod
    def sum(cls, values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> "Metric":
        v, sel = _as_stats(values, mask)
        return cls("sum", torch.where(sel, v, 0.0).sum().reshape(1))

    @classmethod
    def min(cls, values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> "Metric":
        v, sel = _as_stats(values, mask)
        # Fill with +inf instead of boolean indexing: no host sync, and an empty rank is neutral.
        filled = torch.cat([torch.where(sel, v, math.inf).reshape(-1), v.new_full((1,), math.inf)])
        return cls("min", filled.amin().reshape(1))

    @classmethod
    def max(cls, values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> "Metric":
        v, sel = _as_stats(values, mask)
        filled = torch.cat([torch.where(sel, v, -math.inf).reshape(-1), v.new_full((1,), -math.inf)])
        return cls("max", filled.amax().reshape(1))

    @classmethod
    def cat(cls, values: torch.Tensor, mask: Optional[torch.Tensor] = None) -> "Metric":
        """Raw values (e.g. for a histogram); selected entries in row-major order."""
        v, sel = _as_stats(values, mask)
        return cls("cat", v[sel].reshape(-1))

    # -- combining -------------------------------------------------------------------------------

    def merge(self, other: "Metric") -> "Metric":
        """Combine two local metrics of the same kind (micro-batches of one step)."""
        if other.kind != self.kind:
            raise ValueError(f"cannot merge Metric kinds {self.kind!r} and {other.kind!r}")
        b = other.stats.to(self.stats.device)
        if self.kind in _SUMMED:
            return Metric(self.kind, self.stats + b)
        if self.kind == "min":
            return Metric("min", torch.minimum(self.stats, b))
        if self.kind == "max":
            return Metric("max", torch.maximum(self.stats, b))
        return Metric("cat", torch.cat([self.stats, b]))

    def finalize(self) -> MetricValue:
        """The metric's value from (already reduced) stats."""
        return _finalize(self.kind, self.stats)


def _finalize(kind: str, stats: torch.Tensor) -> MetricValue:
    s = stats.detach().cpu()
    if kind == "mean":
        total, count = s.tolist()
        return total / count if count > 0 else math.nan
    if kind == "std":
        total, sq, count = s.tolist()
        if count <= 0:
            return math.nan
        mean = total / count
        # Population std (divide by N); clamp tiny negative rounding of E[x^2] - E[x]^2.
        return math.sqrt(max(sq / count - mean * mean, 0.0))
    if kind == "sum":
        return s.item()
    if kind == "min":
        v = s.item()
        return math.nan if v == math.inf else v
    if kind == "max":
        v = s.item()
        return math.nan if v == -math.inf else v
    return s.clone()


def merge_metrics(a: Mapping[str, Metric], b: Mapping[str, Metric]) -> dict[str, Metric]:
    """Key-wise merge; a key present in only one input is kept as is."""
    out = dict(a)
    for k, m in b.items():
        out[k] = out[k].merge(m) if k in out else m
    return out


class MetricAccumulator:
    """Accumulates the local metrics of several micro-batches, then reduces once.

        acc = MetricAccumulator()
        for mb in micro_batches:
            loss, metrics = compute_policy_loss(...)
            acc.add(metrics)
        logged = acc.reduce(group=dp_group)
    """

    def __init__(self) -> None:
        self._metrics: dict[str, Metric] = {}

    def add(self, metrics: Mapping[str, Metric]) -> None:
        self._metrics = merge_metrics(self._metrics, metrics)

    def local(self) -> dict[str, Metric]:
        return dict(self._metrics)

    def reduce(self, group: Optional[dist.ProcessGroup] = None) -> dict[str, MetricValue]:
        return reduce_metrics(self._metrics, group)

    def reset(self) -> None:
        self._metrics = {}

    def __len__(self) -> int:
        return len(self._metrics)


def _uses_collectives(group: Optional[dist.ProcessGroup]) -> bool:
    initialized = comm.is_distributed()
    if group is None:
        if initialized:
            # Reducing over WORLD by default would double-count under TP/PP (those ranks hold
            # the same data), so the data-parallel group must be named.
            raise ValueError(
                "reduce_metrics: torch.distributed is initialized but group=None; pass the data-parallel "
                "process group explicitly (torch.distributed.group.WORLD if every rank holds distinct data)"
            )
        return False
    if not initialized:
        raise ValueError("reduce_metrics: a process group was given but torch.distributed is not initialized")
    return True


def _comm_device(group: dist.ProcessGroup, stats_device: torch.device) -> torch.device:
    # the stats are tiny: they travel on the device the group's backend moves (comm.py checks it),
    # which is where the losses made them unless a metric was built from host numbers
    want = comm.backend_device_type(group)
    if stats_device.type == want:
        return stats_device
    return torch.device("cuda", torch.cuda.current_device()) if want == "cuda" else torch.device("cpu")


def _signature(items: Iterable[tuple[str, Metric]]) -> float:
    """A checksum of the metric layout; ranks that disagree would otherwise sum unrelated numbers."""
    text = ";".join(f"{k}:{m.kind}:{m.stats.numel() if m.kind != 'cat' else '*'}" for k, m in items)
    return float(zlib.crc32(text.encode()))  # < 2**32, exact in float64


def reduce_metrics(
    local: Mapping[str, Metric], group: Optional[dist.ProcessGroup] = None
) -> dict[str, MetricValue]:
    """Reduce local metrics over a data-parallel process group and finalize them.

    local: name -> Metric. Every rank of ``group`` must pass the same names and kinds (checked).
    group: the data-parallel group. None with torch.distributed not initialized means a single
        process; None with torch.distributed initialized raises (see ``_uses_collectives``).
    Returns name -> float (mean/std/sum/min/max) or 1-D CPU float64 tensor ("cat", values of
    rank 0 first, then rank 1, ...).
    """
    items = sorted(local.items())
    if not items or not _uses_collectives(group):
        return {k: m.finalize() for k, m in items}

    device = _comm_device(group, items[0][1].stats.device)
    summed = [(k, m) for k, m in items if m.kind in _SUMMED]
    extreme = [(k, m) for k, m in items if m.kind in ("min", "max")]
    catted = [(k, m) for k, m in items if m.kind == "cat"]

    # One SUM all-reduce for every sum-like stat.
    reduced: dict[str, torch.Tensor] = {}
    if summed:
        buf = torch.cat([m.stats.to(device, torch.float64) for _, m in summed])
        comm.all_reduce(buf, "sum", group, what="metrics: sums")
        for (k, m), part in zip(summed, buf.split([m.stats.numel() for _, m in summed])):
            reduced[k] = part

    # One MAX all-reduce for maxes, negated mins, and the layout checksum (max of c and of -c
    # agree only if every rank sent the same c).
    sig = _signature(items)
    parts = [m.stats.to(device, torch.float64) * (-1.0 if m.kind == "min" else 1.0) for _, m in extreme]
    buf = torch.cat(parts + [torch.tensor([sig, -sig], dtype=torch.float64, device=device)])
    comm.all_reduce(buf, "max", group, what="metrics: min/max and layout checksum")
    if buf[-2].item() != -buf[-1].item():
        raise ValueError(
            "reduce_metrics: ranks passed different metric names/kinds; every data-parallel rank must "
            f"report the same metrics (this rank: {[k for k, _ in items]})"
        )
    for (k, m), v in zip(extreme, buf[: len(extreme)]):
        reduced[k] = (-v if m.kind == "min" else v).reshape(1)

    if catted:
        reduced.update(_gather_cat(catted, group, device))

    out: dict[str, MetricValue] = {}
    for k, m in items:
        out[k] = _finalize(m.kind, reduced[k])
    return out


def _gather_cat(
    catted: list[tuple[str, Metric]], group: dist.ProcessGroup, device: torch.device
) -> dict[str, torch.Tensor]:
    """All-gather variable-length value lists: lengths first, then one padded buffer."""
    world = comm.world_size(group)
    lengths = torch.tensor([m.stats.numel() for _, m in catted], dtype=torch.int64, device=device)
    all_lengths = comm.all_gather(lengths, group, what="metrics: histogram lengths")
    table = torch.stack(all_lengths).cpu()  # [world, n_cat]
    width = int(table.sum(dim=1).max().item())
    local = torch.cat([m.stats.to(device, torch.float64) for _, m in catted])
    padded = torch.zeros(width, dtype=torch.float64, device=device)
    padded[: local.numel()] = local
    gathered = comm.all_gather(padded, group, what="metrics: histogram values")

    out: dict[str, list[torch.Tensor]] = {k: [] for k, _ in catted}
    for r in range(world):
        row = gathered[r].cpu()
        offset = 0
        for j, (k, _) in enumerate(catted):
            n = int(table[r, j])
            out[k].append(row[offset : offset + n])
            offset += n
    return {k: torch.cat(v) for k, v in out.items()}
