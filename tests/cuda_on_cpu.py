"""Run code as if its tensors lived on a CUDA device, on a machine without one, and fail on a mix.

``torch._subclasses.FakeTensorMode`` creates ``cuda`` tensors on a CPU-only build and raises on a
device mismatch, but its tensors hold no data: every host sync (``.item()``, ``.tolist()``, a
validation that looks at values) stops it, and on a CPU-only build its backward aborts the process.
The trainer's helpers do sync (rewards come from Python, counts decide shapes), so this module is an
equivalent that keeps the data and the CPU autograd:

    with cuda_on_cpu():
        x = torch.zeros(3, device="cuda")      # a CudaOnCpu tensor: x.device == cuda:0, data on the CPU
        x + torch.ones(3)                      # DeviceMismatch: a CPU tensor met a CUDA one
        x + 1, x + torch.tensor(1.0)           # fine, as on CUDA (Python and 0-dim CPU scalars)

A CudaOnCpu tensor is a CPU tensor whose Python-visible ``device`` says ``cuda:0``; every torch call
goes through ``__torch_function__``, which refuses (``DeviceMismatch``, naming the call) a call that
mixes it with a CPU tensor of >= 1 dimension, the way CUDA kernels refuse, and keeps results "on
cuda". Like CUDA it accepts 0-dim CPU tensors and CPU index tensors, and copies between devices
(``.to``, ``.cpu()``, ``.cuda()``, ``copy_``). Factories asked for ``device="cuda"`` inside
``cuda_on_cpu()`` make CudaOnCpu tensors.

``FakeNccl`` stands in for ``torch.distributed`` as megatron_gspo.runtime.comm's transport: it claims the NCCL
backend on a group of ``world`` ranks, records every collective's tensor device and otherwise acts as
if the other ranks sent zeros (sums), the same values (gathers, max) or nothing (broadcast).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)


class DeviceMismatch(RuntimeError):
    pass


def _is_cuda(d) -> bool:
    return isinstance(d, (str, torch.device)) and torch.device(d).type == "cuda"


def _is_cpu(d) -> bool:
    return isinstance(d, (str, torch.device)) and torch.device(d).type == "cpu"


# calls that move data between devices or that CUDA allows with CPU index tensors
_TRANSFERS = {torch.Tensor.to, torch.Tensor.cpu, torch.Tensor.cuda, torch.Tensor.copy_}
_INDEXING = {torch.Tensor.__getitem__, torch.Tensor.__setitem__, torch.Tensor.index_put_, torch.Tensor.index_put,
             torch.index_put}


class CudaOnCpu(torch.Tensor):
    """A CPU tensor that reports ``device == cuda:0`` (see the module docstring)."""

    @property
    def device(self):  # noqa: D401 - what Python code sees
        return CUDA

    @property
    def is_cuda(self) -> bool:
        return True

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"CudaOnCpu({self.as_subclass(torch.Tensor)!r})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        leaves, _ = tree_flatten((args, kwargs))
        tensors = [t for t in leaves if isinstance(t, torch.Tensor)]
        has_cuda = any(isinstance(t, CudaOnCpu) for t in tensors)
        cpu = [tuple(t.shape) for t in tensors if not isinstance(t, CudaOnCpu) and t.dim() > 0]
        if has_cuda and cpu and func not in _TRANSFERS and func not in _INDEXING:
            name = getattr(func, "__qualname__", getattr(func, "__name__", str(func)))
            raise DeviceMismatch(f"{name}: CPU tensor(s) {cpu} met a CUDA tensor in one call")
        if func is torch.Tensor.tolist or func is torch.Tensor.numpy:  # host copies, as on CUDA
            return func(*tree_map(_plain, args), **kwargs)
        out = super().__torch_function__(func, types, args, kwargs)
        if func is torch.Tensor.cpu or (func is torch.Tensor.to and _targets(args, kwargs, _is_cpu)):
            return tree_map(_plain, out)
        return out


def _plain(x):
    return x.as_subclass(torch.Tensor) if isinstance(x, CudaOnCpu) else x


def _to_cuda(x):
    return x.as_subclass(CudaOnCpu) if isinstance(x, torch.Tensor) and not isinstance(x, CudaOnCpu) else x


def _targets(args, kwargs, pred) -> bool:
    return pred(kwargs.get("device")) or any(pred(a) for a in args[1:])


def _cpu_device(a):
    return torch.device("cpu") if _is_cuda(a) else a


class _DeviceArgs(TorchFunctionMode):
    """Above the C++ argument parser (which would try to initialize CUDA): device="cuda" arguments of
    factories and of Tensor.to / .cuda become the CPU, and the result a CudaOnCpu tensor."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        to_cuda = func is torch.Tensor.cuda or _is_cuda(kwargs.get("device"))
        if func is torch.Tensor.cuda:
            func = torch.Tensor.cpu
            kwargs.pop("non_blocking", None)
        if _is_cuda(kwargs.get("device")):
            kwargs["device"] = torch.device("cpu")
        if func is torch.Tensor.to and any(_is_cuda(a) for a in args[1:]):
            args, to_cuda = (args[0], *(_cpu_device(a) for a in args[1:])), True
        # a leaf that requires grad must be made a leaf again after the subclass view
        requires_grad = kwargs.pop("requires_grad", False) if to_cuda else None
        out = func(*args, **kwargs)
        if not to_cuda:
            return out
        out = tree_map(_to_cuda, out)
        return out.detach().requires_grad_(True) if requires_grad else out


@contextlib.contextmanager
def cuda_on_cpu():
    """Factories asked for ``cuda`` make CudaOnCpu tensors; see the module docstring."""
    with _DeviceArgs():
        yield


class FakeNccl:
    """A stand-in for torch.distributed as comm.py's transport (see the module docstring)."""

    ReduceOp = dist.ReduceOp

    def __init__(self, world: int = 2) -> None:
        self.world = world
        self.calls: list[tuple[str, str]] = []

    def is_available(self) -> bool:
        return True

    def is_initialized(self) -> bool:
        return True

    def get_backend(self, group=None) -> str:
        return "nccl"

    def get_world_size(self, group=None) -> int:
        return self.world

    def get_rank(self, group=None) -> int:
        return 0

    def get_process_group_ranks(self, group) -> list[int]:
        return list(range(self.world))

    def all_reduce(self, t, op=None, group=None) -> None:
        self.calls.append(("all_reduce", t.device.type))

    def all_gather(self, out, t, group=None) -> None:
        self.calls.append(("all_gather", t.device.type))
        for o in out:
            o.copy_(t)

    def broadcast(self, t, src=0, group=None) -> None:
        self.calls.append(("broadcast", t.device.type))

    def all_to_all_single(self, out, t, output_split_sizes=None, input_split_sizes=None, group=None) -> None:
        self.calls.append(("all_to_all_single", t.device.type))
        if out.shape == t.shape:  # a test that sends every rank what it receives gets its own data back
            out.copy_(t)

    def barrier(self, group=None) -> None:
        self.calls.append(("barrier", "-"))
