"""``python -m tools.gpu_kit verify-cpu DIR``: proof on this CPU machine that the kit cut device code only.

The TE tier's virtualenv (.ci/setup-te-venv; $GSPO_TE_VENV) is copied (hard links: seconds, and the
original is never written: pip replaces files, it does not write into them), the kit's core wheel is
installed into the copy in place of TE's own, the library there is checked to be the kit's (its sha256,
Hopper images only), and the whole TE tier (tests/te/) runs in the copy: TE's Python package, megatron-core's
TE extension, the torch extension and every host-side symbol of the library load and work as before.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def copy_venv(src: Path, dest: Path) -> None:
    if dest.exists():
        shutil.rmtree(dest)
    subprocess.run(["cp", "-al", str(src), str(dest)], check=True)


def installed_library(python: Path) -> Path:
    p = subprocess.run([str(python), "-c", "import importlib.util as u, os; "
                        "print(os.path.dirname(u.find_spec('transformer_engine').origin))"],
                       capture_output=True, text=True, check=True)
    return Path(p.stdout.strip()) / "wheel_lib" / "libtransformer_engine.so"


def verify(kit: Path, te_venv: Path, copy: Path, pytest_args: list) -> int:
    from tools.gpu_kit import KitError, fatbin
    from tools.gpu_kit.build import check_kit, sha256

    manifest = check_kit(kit)
    library = manifest.get("library")
    if not isinstance(library, dict) or not isinstance(library.get("library_sha256"), str):
        raise KitError(f"{kit / 'manifest.json'} has no library.library_sha256; rebuild it: "
                       f"python -m tools.gpu_kit build --out {kit}")
    if not (te_venv / "bin" / "python").exists():
        raise KitError(f"no TE venv at {te_venv}: make it first: bash .ci/setup-te-venv (or --te-venv / $GSPO_TE_VENV)")
    t = time.time()
    copy_venv(te_venv, copy)
    python = copy / "bin" / "python"
    core = sorted((kit / "wheels").glob("transformer_engine_cu13-*.whl"))[0]
    env = {k: v for k, v in os.environ.items() if k != "VIRTUAL_ENV"}
    subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--force-reinstall",
                    str(core)], check=True, env=env)
    lib = installed_library(python)
    if sha256(lib) != library["library_sha256"]:
        raise SystemExit(f"gpu_kit verify-cpu: {lib} is not the kit's library")
    images = fatbin.images(lib.read_bytes())
    print(f"gpu_kit verify-cpu: {copy} holds the kit's library ({lib.stat().st_size} bytes, images {images}); "
          f"copied and installed in {time.time() - t:.0f} s", flush=True)
    env.update(PYTHONPATH=str(ROOT), PYTHONWARNINGS="ignore", CUDA_VISIBLE_DEVICES="")
    cmd = [str(python), "-m", "pytest", "-q", "-m", "te", "-p", "no:cacheprovider", str(ROOT / "tests" / "te"),
           *pytest_args]
    t = time.time()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    summary = [ln for ln in p.stdout.splitlines() if re.search(r"\d+ (passed|failed|error)", ln)]
    sys.stdout.write(p.stdout[-3000:] if p.returncode else "")
    print(f"gpu_kit verify-cpu: the TE tier against the kit's library: {summary[-1] if summary else p.stderr[-500:]} "
          f"(rc {p.returncode}, {time.time() - t:.0f} s)", flush=True)
    return p.returncode
