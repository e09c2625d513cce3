"""What a measurement records about where it ran: this process's memory (resident set size now and
its high-water mark), the machine's load, and the machine itself (CPU, memory, GPUs, versions).

Used by the checkpoint converters (bounded-memory summaries), the benchmarks and the comparison
(the machine block of their reports). A leaf module: it imports nothing of megatron_gspo, and torch
only inside ``machine_info``, so a tool can measure its baseline RSS before anything heavy loads.
"""

from __future__ import annotations

import os
import platform
import resource
import sys
from typing import Optional


# ----------------------------------------------------------------------------------------------
# This process's memory
# ----------------------------------------------------------------------------------------------


def current_rss() -> int:
    """Resident set size of this process now, in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - non-Linux
        import psutil

        return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Restart the kernel's RSS high-water mark (VmHWM) from the current RSS (Linux >= 4.0).

    False where that is not possible: ``peak_rss`` then still includes whatever came before."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak_rss() -> int:
    """High-water mark of this process's RSS, in bytes.

    VmHWM (Linux) belongs to this process image only; ru_maxrss is not usable for a child of a big
    process: the kernel carries the parent's high-water mark over fork + exec into it."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:  # pragma: no cover - non-Linux
        pass
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


# ----------------------------------------------------------------------------------------------
# How much memory this process may use
# ----------------------------------------------------------------------------------------------


def _read_int(path: str) -> Optional[int]:
    """The integer in a /proc or /sys file; None when absent, unreadable or "max" (no limit)."""
    try:
        with open(path, encoding="ascii") as f:
            text = f.read().strip()
        return int(text)
    except (OSError, ValueError):
        return None


def _cgroup_dirs(version: int, mount: str, proc_cgroup: str) -> list[str]:
    """This process's memory cgroup and its ancestors, as directories of the mounted hierarchy
    (``mount`` for v2, ``mount``/memory for v1), innermost first. Inside a container the process's own
    path may not exist under the mount (a cgroup namespace): the mount's root is the container's
    cgroup then, and is always included."""
    root = mount if version == 2 else os.path.join(mount, "memory")
    rel = None
    try:
        with open(proc_cgroup, encoding="utf-8") as f:
            for line in f:
                hier, controllers, path = line.rstrip("\n").split(":", 2)
                if (version == 2 and hier == "0") or (version == 1 and "memory" in controllers.split(",")):
                    rel = path
    except (OSError, ValueError):
        pass
    dirs = []
    while rel and rel != "/":
        dirs.append(os.path.join(root, rel.lstrip("/")))
        rel = os.path.dirname(rel)
    return dirs + [root]


def memory_limits(cgroup_mount: str = "/sys/fs/cgroup", proc_cgroup: str = "/proc/self/cgroup") -> list[tuple[int, str, bool]]:
    """Every limit on the memory this process may use, as (bytes, what sets it, per process?):
    physical memory, the memory cgroup's limit (v2 memory.max, v1 memory.limit_in_bytes, of this
    cgroup and every ancestor: a job scheduler's or a container's), and the address-space and data
    rlimits (``ulimit -v`` / ``prlimit --as``, ``ulimit -d``). Limits shared by the machine's
    processes have ``per process`` False. "No limit" values are left out."""
    page = os.sysconf("SC_PAGE_SIZE")
    physical = page * os.sysconf("SC_PHYS_PAGES")
    out = [(physical, "physical memory", False)]
    for version, name in ((2, "memory.max"), (1, "memory.limit_in_bytes")):
        for d in _cgroup_dirs(version, cgroup_mount, proc_cgroup):
            v = _read_int(os.path.join(d, name))
            if v is not None and v < physical:  # v1 writes "no limit" as a huge number
                out.append((v, f"cgroup memory limit ({os.path.join(d, name)})", False))
    for rlim, what in ((resource.RLIMIT_AS, "address-space limit (ulimit -v)"),
                       (resource.RLIMIT_DATA, "data-segment limit (ulimit -d)")):
        soft, _ = resource.getrlimit(rlim)
        if soft != resource.RLIM_INFINITY and soft > 0:
            out.append((soft, what, True))
    return out


# ----------------------------------------------------------------------------------------------
# The machine
# ----------------------------------------------------------------------------------------------


def load_avg() -> list[float]:
    """The 1-, 5- and 15-minute load averages, rounded to 0.01; [] where the OS has none.

    On a shared machine timings are only comparable with the load they were taken under."""
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def _cpuinfo(path: str = "/proc/cpuinfo") -> dict:
    """/proc/cpuinfo's fields, each key's first value (the first CPU's, where every CPU has a block); {} where
    there is no such file."""
    fields: dict = {}
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                key, sep, value = line.partition(":")
                if sep:
                    fields.setdefault(key.strip(), value.strip())
    except OSError:
        pass
    return fields


def cpu_model() -> str:
    """The CPU's marketing name (/proc/cpuinfo), else what ``platform`` knows."""
    fields = _cpuinfo()
    return fields["model name"] if "model name" in fields else platform.processor() or platform.machine()


# the vector instruction sets a CPU kernel may be built for (oneDNN, MKL and vLLM's CPU ops pick by them)
_VECTOR_FLAGS = ("avx2", "fma", "avx512f", "avx512_bf16", "avx512_vnni", "amx_bf16", "amx_tile")


def cpu_id(cpuinfo: str = "/proc/cpuinfo") -> Optional[str]:
    """The CPU's generation and vector instruction sets, e.g. ``"family 25 model 1 stepping 1; avx2 fma"``.

    A cloud VM's ``model name`` is often a bare "AMD EPYC": two hosts of different generations (and
    different kernels chosen by the libraries) read the same there. None where /proc/cpuinfo has none
    of these fields (not Linux x86)."""
    fields = _cpuinfo(cpuinfo)
    gen = " ".join(f"{name} {fields[key]}" for key, name in (("cpu family", "family"), ("model", "model"),
                                                              ("stepping", "stepping")) if key in fields)
    flags = set(fields.get("flags", "").split())
    isa = " ".join(f for f in _VECTOR_FLAGS if f in flags)
    return "; ".join(x for x in (gen, isa) if x) or None


def package_version(dist: str) -> Optional[str]:
    """Installed version of a distribution (``megatron-core``), or None when it is not installed."""
    from importlib import metadata

    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def machine_info(device: Optional[str] = None) -> dict:
    """The machine and software a measurement ran on, as a JSON-ready dict.

    ``device``: "cpu" or "cuda", what the measurement runs on (default: "cuda" when a GPU is
    visible, else "cpu"). Keys:

    * ``cpu_model``: the CPU's name (``cpu_model()``);
    * ``cpu_id``: its generation and vector instruction sets (``cpu_id()``);
    * ``cpu_cores``: logical CPUs of the machine (``os.cpu_count()``);
    * ``cpu_cores_usable``: logical CPUs this process may run on (its affinity mask; under a job
      scheduler or taskset fewer than ``cpu_cores``);
    * ``memory_gb``: physical memory, GiB, rounded to 0.1;
    * ``python``, ``platform``: ``platform.python_version()``, ``platform.platform()``;
    * ``torch``, ``megatron_core``, ``transformers``, ``transformer_engine``: installed versions
      (None when not installed);
    * ``device``: the ``device`` argument (resolved);
    * ``gpu``, ``gpu_count``, ``cuda``: only when ``device`` is "cuda": the name of the current
      GPU, the number of visible GPUs, the CUDA version torch was built with;
    * ``cpus``: the same number as ``cpu_cores``, under the name the comparison's reports read;
    * ``gpus``: "N x <name of GPU 0>" when CUDA is available, else "none (CPU)" (whatever
      ``device`` says: what the machine has, for a report's one-line summary);
    * ``load_avg_at_start``: ``load_avg()`` when this was called (a measurement calls it at its
      start).
    """
    import torch

    has_cuda = torch.cuda.is_available()
    device = device or ("cuda" if has_cuda else "cpu")
    cores = os.cpu_count()
    info = {
        "cpu_model": cpu_model(),
        "cpu_id": cpu_id(),
        "cpu_cores": cores,
        "cpu_cores_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else cores,
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
        "python": platform.python_version(),
        "platform": platform.platform(),
        "torch": torch.__version__,
        "megatron_core": package_version("megatron-core"),
        "transformers": package_version("transformers"),
        "transformer_engine": package_version("transformer-engine") or package_version("transformer_engine"),
        "device": device,
    }
    if device == "cuda":
        info["gpu"] = torch.cuda.get_device_name()
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    info["cpus"] = cores
    info["gpus"] = f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)}" if has_cuda else "none (CPU)"
    info["load_avg_at_start"] = load_avg()
    return info
