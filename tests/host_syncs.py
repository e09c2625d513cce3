"""Count the host synchronisations a piece of code would make on a GPU, on a machine without one.

On CUDA, every call that hands a device value to Python waits for the GPU to finish all queued work:
``.item()``, ``.tolist()``, ``bool(t)`` / ``int(t)`` / ``float(t)`` (``if t:``, ``all(...)`` over
tensors), ``.cpu()`` / ``.numpy()``, ``torch.equal`` / ``allclose``, and the ops
whose *output shape* depends on the values (``nonzero``, ``masked_select``, boolean-mask indexing,
``unique``, ``repeat_interleave`` without ``output_size``). On the CPU they cost nothing, so a CPU
test never notices one that crept into a hot loop. ``HostSyncCounter`` is a TorchFunctionMode that
counts these calls (``torch.cuda.set_sync_debug_mode("warn")`` reproduced for CPU tensors), each
attributed to the Python file and line that made it::

    with HostSyncCounter() as syncs:
        train_on(batch)
    syncs.total("megatron_gspo/trainer/loop.py")   # syncs made by lines of loop.py
    syncs.by_site()                            # {(file, line, op): count}

The caller is the first Python frame outside this module and torch (so ``if t:`` in loop.py
counts for loop.py, a ``.tolist()`` inside megatron-core for megatron-core). ``.to(device)`` is
not counted: with every tensor on the CPU, ``.to(x.device)`` (no sync on a GPU) cannot be told from
``.to("cpu")``; code that copies to the host on purpose says ``.cpu()``.
"""

from __future__ import annotations

import collections
import os
import sys
from typing import Optional

import torch
from torch.overrides import TorchFunctionMode

_T = torch.Tensor
_ALWAYS = {
    _T.item: "item", _T.tolist: "tolist", _T.numpy: "numpy", _T.__bool__: "bool", _T.__int__: "int",
    _T.__float__: "float", _T.__index__: "index", _T.__complex__: "complex", _T.cpu: "cpu",
    torch.equal: "equal", torch.allclose: "allclose", _T.allclose: "allclose", _T.equal: "equal",
    torch.nonzero: "nonzero", _T.nonzero: "nonzero", torch.argwhere: "argwhere", _T.argwhere: "argwhere",
    torch.masked_select: "masked_select", _T.masked_select: "masked_select",
    torch.unique: "unique", _T.unique: "unique", torch.unique_consecutive: "unique",
}
_HERE = os.path.abspath(__file__)
_TORCH = os.path.dirname(os.path.abspath(torch.__file__))


def _is_sync(func, args, kwargs) -> Optional[str]:
    name = _ALWAYS.get(func)
    if name is not None:
        return name
    if func in (torch.repeat_interleave, _T.repeat_interleave):
        if isinstance(args[1] if len(args) > 1 else kwargs.get("repeats"), torch.Tensor) \
                and kwargs.get("output_size") is None:
            return "repeat_interleave"
        return None
    if func in (torch.where,) and len(args) == 1 and not kwargs:
        return "where_nonzero"
    if func in (_T.__getitem__,) and len(args) > 1:
        idx = args[1] if isinstance(args[1], tuple) else (args[1],)
        if any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in idx):
            return "bool_mask_index"
    return None


class HostSyncCounter(TorchFunctionMode):
    """See the module docstring."""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = _is_sync(func, args, kwargs)
        if name is not None:
            f = sys._getframe(1)
            while f is not None and (f.f_code.co_filename == _HERE or f.f_code.co_filename.startswith(_TORCH)):
                f = f.f_back
            site = ("?", 0) if f is None else (os.path.abspath(f.f_code.co_filename), f.f_lineno)
            self.sites[(site[0], site[1], name)] += 1
        return func(*args, **kwargs)

    def total(self, path_suffix: str = "") -> int:
        """Syncs made by lines of files whose path ends with ``path_suffix`` (all files: "")."""
        return sum(n for (f, _, _), n in self.sites.items() if f.endswith(path_suffix))

    def by_site(self, path_suffix: str = "") -> dict:
        return {k: n for k, n in self.sites.items() if k[0].endswith(path_suffix)}

    def clear(self) -> None:
        self.sites.clear()
