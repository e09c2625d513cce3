"""Helpers the comparison shares with the rest of the project's tools, kept in this one place.

``finite`` / ``mean`` are the reports' NaN-tolerant statistics. ``smooth`` and ``machine_info`` are
the comparison's copies of ``megatron_gspo.plotting.smooth`` and ``megatron_gspo.sysinfo.machine_info``
(same numbers, same keys), which land on a parallel branch: see the TODO below.
"""

from __future__ import annotations

import math


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def mean(xs) -> float:
    """Mean of the finite values (a step that logged NaN, a seed without that step are left out); NaN if none."""
    xs = [x for x in xs if finite(x)]
    return sum(xs) / len(xs) if xs else math.nan


# TODO(merge): once megatron_gspo/plotting.py and megatron_gspo/sysinfo.py are in, replace everything
# below this comment by:
#     from megatron_gspo.plotting import smooth  # noqa: E402,F401
#     from megatron_gspo.sysinfo import machine_info  # noqa: E402,F401


def smooth(y: list[float], w: int) -> list[float]:
    """Trailing moving average over ``w`` points (the first points average the shorter window), NaN-tolerant."""
    return [mean(y[max(0, i - w + 1):i + 1]) for i in range(len(y))]


def machine_info() -> dict:
    """The machine and software a run used, for the report: platform, python, torch, cpus,
    megatron_core, gpus ("none (CPU)" without CUDA), cpu_model, load_avg_at_start."""
    import os
    import platform

    import torch

    info = {"platform": platform.platform(), "python": platform.python_version(), "torch": torch.__version__,
            "cpus": os.cpu_count()}
    try:
        from importlib.metadata import version

        info["megatron_core"] = version("megatron-core")
    except Exception:  # pragma: no cover - metadata missing
        pass
    info["gpus"] = (f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if torch.cuda.is_available()
                    else "none (CPU)")
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            names = [ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")]
        if names:
            info["cpu_model"] = names[0]
    except OSError:
        pass
    try:
        info["load_avg_at_start"] = [round(x, 2) for x in os.getloadavg()]
    except OSError:
        pass
    return info
