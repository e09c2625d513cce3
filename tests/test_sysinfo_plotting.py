"""The shared measurement and plotting helpers (megatron_gspo.runtime.sysinfo, megatron_gspo.runtime.plotting): leaf
modules that import alone and light, the numbers they return, and the keys both the benchmarks and
the comparison read from machine_info."""

import json
import math
import os
import platform
import subprocess
import sys

import pytest

from megatron_gspo.runtime.plotting import pyplot, save_figure, smooth
from megatron_gspo.runtime.sysinfo import cpu_id, current_rss, load_avg, machine_info, peak_rss, reset_peak_rss


@pytest.mark.parametrize("module", ["megatron_gspo.runtime.sysinfo", "megatron_gspo.runtime.plotting"])
def test_leaf_module_imports_alone_and_light(module):
    code = (f"import sys, json; import {module}; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('torch', 'matplotlib', 'megatron', 'megatron_gspo', 'numpy'))))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    parts = module.split(".")
    assert json.loads(p.stdout) == [".".join(parts[:i]) for i in range(1, len(parts) + 1)]  # + its packages


def test_smooth_is_a_trailing_mean():
    assert smooth([1.0, 2.0, 3.0, 4.0, 5.0], 3) == [1.0, 1.5, 2.0, 3.0, 4.0]
    assert smooth([1.0, 2.0], 1) == [1.0, 2.0]
    assert smooth([], 5) == []
    # non-finite values are left out of a window; a window without a finite value is NaN
    out = smooth([1.0, math.nan, 3.0, math.inf, math.nan, math.nan], 2)
    assert out[:4] == [1.0, 1.0, 3.0, 3.0] and math.isnan(out[4]) and math.isnan(out[5])


def test_peak_rss_follows_an_allocation():
    assert reset_peak_rss()
    base = current_rss()
    assert peak_rss() < base + 16 * 2**20
    block = bytearray(96 * 2**20)  # zero-filled: every page touched
    assert current_rss() > base + 80 * 2**20
    del block
    assert peak_rss() > base + 80 * 2**20  # the high-water mark remembers it
    assert reset_peak_rss() and peak_rss() < base + 48 * 2**20


def test_machine_info_serves_benchmarks_and_comparison():
    import torch

    m = machine_info("cpu")
    json.dumps(m)  # JSON-ready
    # benchmarks/run.py's keys (tests/test_benchmarks.py, benchmarks/results/*.json)
    for k in ("cpu_model", "cpu_cores", "cpu_cores_usable", "memory_gb", "python", "platform", "torch",
              "megatron_core", "transformers", "transformer_engine", "device"):
        assert k in m, k
    # the comparison's report keys
    for k in ("platform", "python", "torch", "cpus", "megatron_core", "gpus", "cpu_model", "load_avg_at_start"):
        assert k in m, k
    assert m["device"] == "cpu" and "gpu" not in m
    assert m["cpus"] == m["cpu_cores"] == os.cpu_count() and 1 <= m["cpu_cores_usable"] <= m["cpu_cores"]
    assert m["torch"] == torch.__version__ and m["megatron_core"]  # installed: a version string
    assert m["memory_gb"] > 0 and len(m["load_avg_at_start"]) == len(load_avg()) == 3
    if not torch.cuda.is_available():
        assert m["gpus"] == "none (CPU)" and machine_info()["device"] == "cpu"


def test_cpu_id_reads_the_generation_and_vector_sets_of_the_first_cpu(tmp_path):
    block = ("processor\t: {n}\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n"
             "model name\t: AMD EPYC\nstepping\t: 1\nflags\t\t: fpu sse avx {flags} fma\n\n")
    f = tmp_path / "cpuinfo"
    f.write_text(block.format(n=0, flags="avx2 avx512f") + block.format(n=1, flags="avx2 avx512f amx_tile"))
    assert cpu_id(str(f)) == "family 25 model 1 stepping 1; avx2 fma avx512f"  # the first CPU's block only
    f.write_text("processor\t: 0\nflags\t\t: sse avx\n")
    assert cpu_id(str(f)) is None  # no generation, no listed vector set
    assert cpu_id(str(tmp_path / "missing")) is None
    if os.path.exists("/proc/cpuinfo") and platform.machine() == "x86_64":
        assert machine_info("cpu")["cpu_id"] == cpu_id() and "family" in cpu_id()


def test_save_figure_writes_and_closes(tmp_path):
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(2, 2))
    ax.plot([0, 1], [0, 1])
    out = save_figure(fig, str(tmp_path / "sub" / "f.png"), dpi=50)
    with open(out, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert not plt.fignum_exists(fig.number)
