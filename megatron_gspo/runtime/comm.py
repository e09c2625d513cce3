"""Every collective of the package, checked: a tensor must live where its group's backend moves data.

NCCL moves CUDA tensors only and gloo is used here for CPU tensors; a CPU tensor handed to an NCCL
all-reduce fails deep inside c10d (or, worse, on some versions hangs), and a test on a CPU machine
never sees it. So no module calls ``torch.distributed`` collectives directly (tests/test_devices.py
scans the package for that): they call the functions below, which check the device against the
group's backend and raise :class:`CollectiveDeviceError` naming the call (``what``) before any
communication happens. One process (or a group of one) needs no communication: every function
returns its input unchanged there, so single-rank code pays nothing.

megatron-core's own collectives (DDP, finalize_model_grads, the token dispatcher) are megatron's
business and are not routed through here.
"""

from __future__ import annotations

from typing import Optional, Union

import torch
import torch.distributed as dist

# The transport: torch.distributed. A module attribute (not a hard-wired call) so a device test can
# stand in a recording transport that claims NCCL on a CPU-only machine (tests/test_devices.py).
_transport = dist

Op = Union[str, "dist.ReduceOp"]
_OPS = {"sum": "SUM", "max": "MAX", "min": "MIN"}


class CollectiveDeviceError(RuntimeError):
    """A tensor was sent to a collective whose backend cannot move it (e.g. a CPU tensor to NCCL)."""


def is_distributed() -> bool:
    return _transport.is_available() and _transport.is_initialized()


def world_size(group=None) -> int:
    return _transport.get_world_size(group) if is_distributed() else 1


def backend_device_type(group=None) -> str:
    """The device type a group's backend moves: "cuda" for NCCL, "cpu" for gloo (and one process)."""
    if not is_distributed():
        return "cpu"
    backend = str(_transport.get_backend(group)).lower()
    return "cuda" if "nccl" in backend else "cpu"


def _check(t: torch.Tensor, group, what: str) -> None:
    want = backend_device_type(group)
    if t.device.type != want:
        backend = _transport.get_backend(group)
        raise CollectiveDeviceError(
            f"{what}: a {t.device} tensor {tuple(t.shape)} was sent to a collective over a {backend} process "
            f"group, which moves {want} tensors only; create it on the parallel state's device")


def _active(group) -> bool:
    return is_distributed() and _transport.get_world_size(group) > 1


def _op(op: Op):
    return getattr(_transport.ReduceOp, _OPS[op]) if isinstance(op, str) else op


def all_reduce(t: torch.Tensor, op: Op = "sum", group=None, *, what: str) -> torch.Tensor:
    """In-place all-reduce of ``t`` over ``group`` ("sum" | "max" | "min"); returns ``t``."""
    if _active(group):
        _check(t, group, what)
        _transport.all_reduce(t, op=_op(op), group=group)
    return t


def all_gather(t: torch.Tensor, group=None, *, what: str) -> list[torch.Tensor]:
    """Every rank's ``t`` (same shape everywhere), in group-rank order."""
    if not _active(group):
        return [t]
    _check(t, group, what)
    out = [torch.empty_like(t) for _ in range(_transport.get_world_size(group))]
    _transport.all_gather(out, t.contiguous(), group=group)
    return out


def gather_to(t: torch.Tensor, dst: int, group=None, *, what: str) -> Optional[list[torch.Tensor]]:
    """Every rank's ``t`` (same shape everywhere) on global rank ``dst``, in group-rank order; None on the
    other ranks, which receive nothing."""
    if not _active(group):
        return [t]
    _check(t, group, what)
    out = None
    if _transport.get_rank() == dst:
        out = [torch.empty_like(t) for _ in range(_transport.get_world_size(group))]
    _transport.gather(t.contiguous(), gather_list=out, dst=dst, group=group)
    return out


def all_gather_into(t: torch.Tensor, group=None, *, what: str) -> torch.Tensor:
    """Every rank's ``t`` (same shape everywhere) stacked along dim 0 in group-rank order, one tensor
    [n x t.shape[0], ...] (``t`` itself for one rank). No host synchronisation: a CUDA graph can hold it."""
    if not _active(group):
        return t
    _check(t, group, what)
    out = t.new_empty((_transport.get_world_size(group) * t.shape[0], *t.shape[1:]))
    # all_gather_single is torch >= 2.11's name of all_gather_into_tensor (the old one warns there)
    gather = getattr(_transport, "all_gather_single", None) or _transport.all_gather_into_tensor
    gather(out, t.contiguous(), group=group)
    return out


def reduce_scatter(t: torch.Tensor, group=None, *, what: str) -> torch.Tensor:
    """The sum over the group of every rank's ``t`` [n x m, ...], of which group rank i keeps rows
    i*m .. (i+1)*m - 1: [m, ...] (``t`` itself for one rank). No host synchronisation."""
    if not _active(group):
        return t
    _check(t, group, what)
    n = _transport.get_world_size(group)
    if t.shape[0] % n:
        raise ValueError(f"{what}: reduce_scatter of {t.shape[0]} rows over {n} ranks")
    out = t.new_empty((t.shape[0] // n, *t.shape[1:]))
    scatter = getattr(_transport, "reduce_scatter_single", None) or _transport.reduce_scatter_tensor
    scatter(out, t.contiguous(), op=_op("sum"), group=group)
    return out


def broadcast(t: torch.Tensor, src: int, group=None, *, what: str) -> torch.Tensor:
    """In-place broadcast from global rank ``src``; returns ``t``."""
    if _active(group):
        _check(t, group, what)
        _transport.broadcast(t, src=src, group=group)
    return t


def all_to_all_single(out: torch.Tensor, t: torch.Tensor, group=None, *, what: str,
                      out_splits: Optional[list[int]] = None, in_splits: Optional[list[int]] = None) -> torch.Tensor:
    """All-to-all: chunk i of ``t`` (along dim 0) goes to group rank i, ``out`` receives one chunk from
    every rank in group-rank order; returns ``out`` (a copy of ``t`` for one rank). Equal chunks, or
    ``in_splits`` / ``out_splits``: the sizes sent to / received from each rank (both ends must agree)."""
    if not _active(group):
        return out.copy_(t)
    _check(t, group, what)
    _check(out, group, what)
    _transport.all_to_all_single(out, t.contiguous(), output_split_sizes=out_splits, input_split_sizes=in_splits,
                                 group=group)
    return out


def backend_name(group=None) -> str:
    """The group's backend as torch names it ("nccl", "gloo"), "none" without torch.distributed."""
    return str(_transport.get_backend(group)) if is_distributed() else "none"


def barrier(group=None) -> None:
    if _active(group):
        _transport.barrier(group=group)


def any_rank(flag: bool, device: torch.device, group=None, *, what: str) -> bool:
    """True on every rank of ``group`` if ``flag`` is True on any of them (a collective decision)."""
    t = torch.tensor([1.0 if flag else 0.0], device=device)
    return bool(all_reduce(t, "max", group, what=what).item())


def any_true(flag: torch.Tensor, group=None, *, what: str) -> bool:
    """``any_rank`` for a flag already on the device (a 0-dim or one-element bool/number tensor, True
    when non-zero): the reduction stays on the device and the answer costs one host sync."""
    t = flag.reshape(1).to(torch.float32)
    return bool(all_reduce(t, "max", group, what=what).item())


def all_ranks(flag: bool, device: torch.device, group=None, *, what: str) -> bool:
    """True on every rank of ``group`` if ``flag`` is True on all of them (a collective decision)."""
    return not any_rank(not flag, device, group, what=what)


def max_int(value: int, device: torch.device, group=None, *, what: str) -> int:
    """The largest ``value`` over ``group``."""
    t = torch.tensor([int(value)], dtype=torch.long, device=device)
    return int(all_reduce(t, "max", group, what=what).item())


def ranks(group) -> list[int]:
    """Global ranks of ``group`` in group-rank order ([0] without torch.distributed)."""
    return _transport.get_process_group_ranks(group) if is_distributed() else [0]


def rank(group=None) -> int:
    return _transport.get_rank(group) if is_distributed() else 0


def first_rank(group) -> Optional[int]:
    return ranks(group)[0] if group is not None else None


# ----------------------------------------------------------------------------------------------
# The bridge of an asynchronous job (rollout/side.py): a process group outside the default
# world (each side of the job has a world of its own), so torch.distributed's module-level functions,
# which translate ranks through the default world, cannot drive it; its backend's methods are called
# directly. Ranks here are bridge ranks. Same device check as above.
# ----------------------------------------------------------------------------------------------


def bridge_backend(pg) -> str:
    """"gloo" or "nccl": the backend of a bridge process group."""
    name = pg._get_backend_name() if hasattr(pg, "_get_backend_name") else pg.name()
    return str(name).lower()


def _check_bridge(t: torch.Tensor, pg, what: str) -> None:
    backend = bridge_backend(pg)
    want = "cuda" if "nccl" in backend else "cpu"
    if t.device.type != want:
        raise CollectiveDeviceError(
            f"{what}: a {t.device} tensor {tuple(t.shape)} was sent over the {backend} bridge, which moves {want} "
            f"tensors only; create it on the parallel state's device")


def bridge_broadcast(t: torch.Tensor, root: int, pg, *, what: str) -> torch.Tensor:
    """In-place broadcast of ``t`` from bridge rank ``root`` to every member of ``pg``; returns ``t``."""
    _check_bridge(t, pg, what)
    opts = _transport.BroadcastOptions()
    opts.rootRank, opts.rootTensor = root, 0
    pg.broadcast([t], opts).wait()
    return t


def bridge_send(t: torch.Tensor, dst: int, pg, *, what: str):
    """Start sending ``t`` to bridge rank ``dst``; returns the work handle (``t`` must stay alive and
    unchanged until ``wait()`` on it returns, which happens once the receiver has posted its receive)."""
    _check_bridge(t, pg, what)
    if not t.is_contiguous():  # a contiguous copy made here could be freed while the send is in flight
        raise ValueError(f"{what}: bridge_send needs a contiguous tensor")
    return pg.send([t], dst, 0)


def bridge_recv(t: torch.Tensor, src: int, pg, *, what: str) -> torch.Tensor:
    """Receive into ``t`` from bridge rank ``src`` (blocking, up to the group's timeout); returns ``t``."""
    _check_bridge(t, pg, what)
    pg.recv([t], src, 0).wait()
    return t
