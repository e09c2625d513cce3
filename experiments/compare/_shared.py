"""Helpers the comparison shares with the rest of the project's tools, kept in this one place.

``finite`` / ``mean`` are the reports' NaN-tolerant statistics; ``smooth`` and ``machine_info`` are
the package's shared helpers (megatron_gspo.runtime.plotting, megatron_gspo.runtime.sysinfo), re-exported for the
comparison's modules.
"""

from __future__ import annotations

import math

from megatron_gspo.runtime.plotting import smooth  # noqa: F401
from megatron_gspo.runtime.sysinfo import machine_info  # noqa: F401


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def mean(xs) -> float:
    """Mean of the finite values (a step that logged NaN, a seed without that step are left out); NaN if none."""
    xs = [x for x in xs if finite(x)]
    return sum(xs) / len(xs) if xs else math.nan
