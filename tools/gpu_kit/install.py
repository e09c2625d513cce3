"""``python -m tools.gpu_kit install DIR``: the kit into the GPU machine's Python (3.12, torch 2.11, no network).

1. the kit's files checked against its manifest (build.check_kit: a truncated copy fails here, named, exit 2);
2. ``pip install --no-index --no-deps DIR/wheels/*.whl`` (TE's core with the Hopper-only library, TE's
   metapackage, the Python dependencies the image lacks, megatron-core 0.16.1);
3. TE's PyTorch extension: the wheel in DIR/ext/ built for this Python and torch when there is one, else
   built from DIR/sdist/ with every core (about 34 minutes on 2 cores here; the first GPU run pays it once),
   then kept in DIR/ext/ and copied to $OUT, which brings it back (docs/gpu_kit.md says where to put it);
4. megatron-core 0.19.2 into DIR/../mcore019-site (``--mcore019-target``), for a check under 0.19 with
   ``PYTHONPATH=<that folder>`` in front;
5. the imports that must work: torch, transformer_engine.pytorch, megatron.core's TE extension.
Prints one line per step; exits 1 naming the step that failed.
"""

from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import sysconfig
import time
from pathlib import Path


def _pip(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pip", *args], capture_output=True, text=True,
                          env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})


def _fail(step: str, detail: str) -> None:
    print(f"gpu_kit install: {step} failed: {detail}", flush=True)
    raise SystemExit(1)


def ext_tag() -> str:
    """The extension's wheel tag for this interpreter and torch: ``cp312-torch2.11.0+cu130``."""
    import torch

    return f"cp{sys.version_info[0]}{sys.version_info[1]}-torch{torch.__version__}"


def _ext_wheel(kit: Path) -> Path | None:
    """A built extension for this interpreter and torch: ext/<tag>/transformer_engine_torch-*.whl."""
    hits = sorted((kit / "ext" / ext_tag().replace("+", "_")).glob("transformer_engine_torch-*.whl"))
    return hits[-1] if hits else None


def build_env() -> dict:
    """The extension's build environment: the CUDA toolkit (CUDA_HOME) for CUDA's headers, and the headers
    of the NVIDIA wheels beside torch (cuDNN, NCCL, ...) on CPATH, every core for the compiler."""
    cores = str(os.cpu_count() or 4)
    env = {**os.environ, "MAX_JOBS": cores, "NVTE_BUILD_MAX_JOBS": cores, "NVTE_FRAMEWORK": "pytorch",
           "NVTE_PYTORCH_FORCE_BUILD": "TRUE", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    if "CUDA_HOME" not in env and os.path.isfile("/usr/local/cuda/bin/nvcc"):
        env["CUDA_HOME"] = "/usr/local/cuda"
    site = sysconfig.get_paths()["purelib"]
    headers = sorted(glob.glob(os.path.join(site, "nvidia", "*", "include")))
    env["CPATH"] = os.pathsep.join(headers + ([env["CPATH"]] if env.get("CPATH") else []))
    return env


def build_extension(kit: Path) -> Path:
    sdists = sorted((kit / "sdist").glob("transformer_engine_torch-*.tar.gz"))
    if not sdists:
        _fail("extension", f"no transformer_engine_torch sdist in {kit / 'sdist'}")
    work = Path(os.environ.get("TMPDIR", "/tmp")) / "gpu_kit_ext"
    shutil.rmtree(work, ignore_errors=True)
    work.mkdir(parents=True)
    t = time.time()
    log = work / "build.log"
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "pip", "wheel", "-v", "--no-build-isolation", "--no-deps",
                             "-w", str(work), str(sdists[-1])], stdout=f, stderr=subprocess.STDOUT,
                            env=build_env()).returncode
    out = os.environ.get("OUT")
    if out:  # the log comes back whatever happened
        shutil.copy2(log, Path(out) / "te_extension_build.log")
    wheels = sorted(work.glob("transformer_engine_torch-*.whl"))
    if rc != 0 or not wheels:
        _fail("extension", f"building {sdists[-1].name} failed (rc {rc}); the log: {log}"
              + (f" and $OUT/te_extension_build.log" if out else ""))
    dest = kit / "ext" / ext_tag().replace("+", "_")
    dest.mkdir(parents=True, exist_ok=True)
    shutil.copy2(wheels[-1], dest)
    if out:
        shutil.copy2(wheels[-1], Path(out) / wheels[-1].name)
    print(f"gpu_kit install: extension built in {time.time() - t:.0f} s: {dest / wheels[-1].name}"
          + (f" (and $OUT/{wheels[-1].name})" if out else ""), flush=True)
    return dest / wheels[-1].name


def install(kit: Path, mcore019_target: Path, build_only: bool = False) -> None:
    from tools.gpu_kit.build import check_kit

    t0 = time.time()
    check_kit(kit)
    wheels = sorted(str(p) for p in (kit / "wheels").glob("*.whl"))
    p = _pip("install", "-q", "--no-index", "--no-deps", "--no-compile", *wheels)
    if p.returncode != 0:
        _fail("wheels", p.stderr.strip()[-1500:])
    print(f"gpu_kit install: {len(wheels)} wheels installed", flush=True)
    ext = _ext_wheel(kit) or build_extension(kit)
    if build_only:
        return
    p = _pip("install", "-q", "--no-index", "--no-deps", str(ext))
    if p.returncode != 0:
        _fail("extension", p.stderr.strip()[-1500:])
    p = _pip("install", "-q", "--no-index", "--no-deps", "--upgrade", "--target", str(mcore019_target),
             *[str(w) for w in (kit / "mcore019").glob("*.whl")])
    if p.returncode != 0:
        _fail("megatron-core 0.19", p.stderr.strip()[-1500:])
    check = ("import torch, transformer_engine, transformer_engine.pytorch, megatron.core, "
             "megatron.core.extensions.transformer_engine; print('TE', transformer_engine.__version__, "
             "'megatron-core', megatron.core.__version__, 'torch', torch.__version__)")
    p = subprocess.run([sys.executable, "-c", check], capture_output=True, text=True)
    if p.returncode != 0:
        _fail("import", p.stderr.strip()[-1500:])
    print(f"gpu_kit install: ok in {time.time() - t0:.0f} s: {p.stdout.strip()}; megatron-core 0.19.2 in "
          f"{mcore019_target}", flush=True)
