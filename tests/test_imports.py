"""Every module imports alone, in a fresh interpreter: no import cycle hides behind an import order.

A cycle (config importing every section's module, each importing ConfigError back) only shows when
a module is the *first* one imported, e.g. `python -c "import megatron_gspo.trainer.optim"`: so each module
gets its own interpreter. And the config package is a leaf: importing it loads nothing else of
megatron_gspo but the leaves `errors` and `textfile` (reading files as UTF-8, with the file and line
of a bad byte).
"""

import os
import pkgutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest

import checkpoints_tools
import experiments
import megatron_gspo

pytestmark = pytest.mark.slow


def _modules():
    out = []
    for pkg in (megatron_gspo, checkpoints_tools, experiments):
        out.append(pkg.__name__)
        out += [m.name for m in pkgutil.walk_packages(pkg.__path__, prefix=pkg.__name__ + ".")]
    return sorted(out)


def test_every_module_imports_alone_in_a_fresh_interpreter():
    env = {**os.environ, "PYTHONWARNINGS": "ignore"}

    def load(name):
        p = subprocess.run([sys.executable, "-c", f"import {name}"], capture_output=True, text=True, env=env,
                           timeout=300)
        return name, p.returncode, p.stderr[-1500:]

    modules = _modules()
    assert len(modules) > 30
    with ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 2)) as pool:
        failed = [(n, err) for n, rc, err in pool.map(load, modules) if rc != 0]
    assert not failed, "\n\n".join(f"{n}:\n{err}" for n, err in failed)


def test_config_is_a_leaf():
    code = ("import sys, megatron_gspo.config; "
            "print(sorted(m for m in sys.modules if m.startswith('megatron_gspo')))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = eval(p.stdout.strip().splitlines()[-1])
    allowed = {"megatron_gspo", "megatron_gspo.errors", "megatron_gspo.textfile"}
    assert [m for m in loaded if m not in allowed and not m.startswith("megatron_gspo.config")] == []
