"""``python -m tools.gpu_kit build --out DIR``: the kit, from PyPI, reproducibly (every file pinned, hashed in
DIR/manifest.json), cached (downloads and the cut library under the cache directory; a DIR whose manifest
matches the recipe and whose files verify is left as it is).

DIR/
  manifest.json     what is there: the recipe, each file's sha256 and size, the library's images, build times
  wheels/           pip install --no-index --no-deps wheels/*.whl on the GPU machine (Python 3.12):
                    TE's core wheel with its library cut to sm_90/sm_90a (fatbin.py; all else unchanged), TE's
                    metapackage, TE's Python dependencies and the project's that the GPU image lacks, and
                    megatron-core 0.16.1 (the tested release the checks run under)
  mcore019/         megatron-core 0.19.2, installed beside (pip --target) for the checks under 0.19
  sdist/            TE's PyTorch extension as source: no Python 3.12 headers can be had here (Debian 12 has
                    Python 3.11 only, Debian unstable 3.13-3.15, PyPI none), so ``install`` builds it on the GPU
                    machine once (16 cores) and keeps the wheel (ext/, and $OUT to bring it back)
  ext/              the built extension wheel, once one exists (then no build: docs/gpu_kit.md)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

from tools.gpu_kit import KitError, fatbin

TE_VERSION = "2.20.2"
ARCH = 90
LIMIT_BYTES = 56 * 2**20  # the working tree (~10 MiB) and the kit travel together, 64 MiB at most
LIBRARY = "transformer_engine/wheel_lib/libtransformer_engine.so"
CORE = f"transformer-engine-cu13=={TE_VERSION}"
SDIST = f"transformer-engine-torch=={TE_VERSION}"
# Python 3.12 / x86-64 wheels (--no-deps: each named). The GPU image already has torch, triton, numpy,
# packaging, einops, onnx, onnxscript, pybind11, psutil, pyyaml, safetensors, tokenizers, sentencepiece,
# tensorboard, matplotlib, jinja2, transformers, pytest, pytest-xdist, zipp, typing-extensions, cuDNN, NCCL.
WHEELS = [
    f"transformer-engine=={TE_VERSION}",  # the metapackage: TE checks that it is installed
    "pydantic==2.14.4", "pydantic-core==2.50.5", "annotated-types==0.8.0", "typing-inspection==0.4.5",
    "importlib-metadata==10.2.0",  # TE core's requirements
    "nvdlfw-inspect==0.2.2",  # TE's PyTorch requirements; cudnn-frontend's headers build the extension
    "nvidia-cudnn-frontend==1.32.0",
    "megatron-core==0.16.1",
    "math-verify==0.9.0", "latex2sympy2-extended==1.11.0", "antlr4-python3-runtime==4.13.2",  # reward.name=math
]
MCORE_019 = ["megatron-core==0.19.2"]
PLATFORMS = ["manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
             "manylinux2014_x86_64"]


def recipe() -> dict:
    """Everything the kit's contents follow from: a kit built from another recipe is rebuilt."""
    fatbin_src = Path(fatbin.__file__).read_bytes()
    return {"te": TE_VERSION, "arch": ARCH, "core": CORE, "sdist": SDIST, "wheels": WHEELS, "mcore019": MCORE_019,
            "python": "3.12", "platforms": PLATFORMS, "fatbin_py_sha256": hashlib.sha256(fatbin_src).hexdigest()}


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def cache_dir() -> Path:
    return Path(os.environ.get("GSPO_KIT_CACHE") or Path.home() / ".cache" / "megatron-gspo" / "gpu-kit")


def _pip_download(python: str, reqs: list, dest: Path, binary: bool = True) -> None:
    """pip download into ``dest`` (pip skips what is there already, by file name)."""
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [python, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest)]
    if binary:
        cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
        cmd += [a for p in PLATFORMS for a in ("--platform", p)]
    else:  # the sdist: its metadata step imports torch with CUDA, hence the TE venv's python
        cmd += ["--no-binary", ":all:", "--no-build-isolation"]
    p = subprocess.run(cmd + reqs, capture_output=True, text=True, env={**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"})
    if p.returncode != 0:
        tail = "\n".join(ln for ln in p.stderr.splitlines() if "WARNING: Location" not in ln)[-2000:]
        raise SystemExit(f"gpu_kit: pip download {' '.join(reqs)} failed:\n{tail}")


def _find(folder: Path, requirement: str, suffix: str = ".whl") -> Path:
    name, version = requirement.split("==")
    stem = f"{name.replace('-', '_').lower()}-{version}"
    hits = [p for p in folder.iterdir() if p.name.lower().startswith(stem) and p.name.endswith(suffix)]
    if len(hits) != 1:
        raise SystemExit(f"gpu_kit: expected one {stem}*{suffix} in {folder}, found {[p.name for p in hits]}")
    return hits[0]


def cut_core_wheel(src: Path, dest: Path) -> dict:
    """TE's core wheel with its library cut to ARCH (fatbin.prune), every other member and its RECORD line
    as they were; the library's line in RECORD carries its new hash and size."""
    import base64
    import csv
    import io

    with zipfile.ZipFile(src) as zin:
        original = zin.read(LIBRARY)
        pruned, counts = fatbin.prune(original, ARCH)
        fatbin.check_pruned(original, pruned, ARCH)
        digest = base64.urlsafe_b64encode(hashlib.sha256(pruned).digest()).rstrip(b"=").decode()
        tmp = dest.with_suffix(".part")
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED, compresslevel=9) as zout:
            for info in zin.infolist():
                data = pruned if info.filename == LIBRARY else zin.read(info.filename)
                if info.filename.endswith(".dist-info/RECORD"):
                    rows = list(csv.reader(io.StringIO(data.decode())))
                    rows = [[LIBRARY, f"sha256={digest}", str(len(pruned))] if r and r[0] == LIBRARY else r for r in rows]
                    buf = io.StringIO()
                    csv.writer(buf, lineterminator="\n").writerows(rows)
                    data = buf.getvalue().encode()
                zout.writestr(info, data, compress_type=zipfile.ZIP_DEFLATED, compresslevel=9)
        tmp.replace(dest)
    off, size = fatbin.section(original)
    kept = sum(e.size for c in fatbin.containers(original[off:off + size]) for e in fatbin.keep(c.entries, ARCH))
    return {"images": counts["images"], "dropped_images": counts["dropped"], "library_bytes": len(original),
            "fatbin_bytes": size, "fatbin_bytes_kept": kept, "library_sha256": hashlib.sha256(pruned).hexdigest(),
            "original_library_sha256": hashlib.sha256(original).hexdigest()}


def _core(cache: Path, timings: dict) -> tuple[Path, dict]:
    """The cut core wheel, from the cache when its source wheel and fatbin.py are the same."""
    t = time.time()
    _pip_download(sys.executable, [CORE], cache / "downloads" / "core", binary=True)
    src = _find(cache / "downloads" / "core", CORE)
    timings["download_core_s"] = round(time.time() - t, 1)
    key = f"{sha256(src)[:16]}-sm{ARCH}-{recipe()['fatbin_py_sha256'][:12]}"
    out_dir = cache / "cut" / key
    info_file = out_dir / "library.json"
    if not info_file.is_file():
        t = time.time()
        out_dir.mkdir(parents=True, exist_ok=True)
        info = cut_core_wheel(src, out_dir / src.name)
        info["source_wheel"], info["source_wheel_sha256"] = src.name, sha256(src)
        info_file.write_text(json.dumps(info, indent=1))
        timings["cut_library_s"] = round(time.time() - t, 1)
    return out_dir / src.name, json.loads(info_file.read_text())


def files_of(out: Path) -> dict:
    return {rel: {"sha256": sha256(out / rel), "bytes": (out / rel).stat().st_size} for rel in files_of_names(out)}


def check_kit(kit: Path) -> dict:
    """The kit's manifest, once it and every file it lists are checked (size and sha256) and no file outside
    ext/ is there that it does not list (install takes every wheel in wheels/). Raises KitError naming each
    damaged file: a truncated or edited copy fails here, not at an import on the GPU machine."""
    rebuild = f"rebuild it: python -m tools.gpu_kit build --out {kit}"
    if not kit.is_dir():
        raise KitError(f"no GPU kit at {kit} (make one: python -m tools.gpu_kit build --out {kit})")
    path = kit / "manifest.json"
    if not path.is_file():
        raise KitError(f"{kit} is not a GPU kit (no manifest.json); {rebuild}")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise KitError(f"{path} is unreadable ({type(e).__name__}: {e}); {rebuild}") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict) or not files:
        raise KitError(f"{path} lists no files (no 'files' table); {rebuild}")
    bad_entries = [rel for rel, meta in files.items()
                   if not (isinstance(meta, dict) and isinstance(meta.get("bytes"), int) and isinstance(meta.get("sha256"), str))]
    if bad_entries:
        raise KitError(f"{path}: entries without 'bytes' and 'sha256': {', '.join(bad_entries[:5])}; {rebuild}")
    damaged = []
    for rel, meta in files.items():
        p = kit / rel
        if not p.is_file():
            damaged.append(f"{rel} (missing)")
        elif p.stat().st_size != meta["bytes"]:
            damaged.append(f"{rel} ({p.stat().st_size} bytes, the manifest says {meta['bytes']})")
        elif sha256(p) != meta["sha256"]:
            damaged.append(f"{rel} (sha256 differs)")
    extra = sorted(set(files_of_names(kit)) - set(files))
    damaged += [f"{rel} (not in the manifest)" for rel in extra]
    if damaged:
        raise KitError(f"{kit} is damaged: {len(damaged)} file(s) differ from manifest.json: "
                       f"{'; '.join(damaged[:6])}{'; ...' if len(damaged) > 6 else ''}; {rebuild}")
    return manifest


def files_of_names(out: Path) -> list:
    """The kit's files that its manifest covers (all but manifest.json and ext/), relative to ``out``."""
    return [str(p.relative_to(out)) for p in sorted(out.rglob("*"))
            if p.is_file() and p.name != "manifest.json" and "ext" not in p.relative_to(out).parts]


def is_current(out: Path) -> bool:
    """Whether ``out`` holds a kit of this recipe whose files are all there and unchanged."""
    try:
        manifest = json.loads((out / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    return manifest.get("recipe") == recipe() and manifest.get("files") == files_of(out)


def build(out: Path, te_venv_python: str) -> dict:
    """Make (or confirm) the kit in ``out``; returns its manifest."""
    t0 = time.time()
    if is_current(out):
        manifest = json.loads((out / "manifest.json").read_text())
        print(f"gpu_kit: {out} is current ({manifest['total_bytes'] / 2**20:.1f} MiB), nothing to do "
              f"({time.time() - t0:.1f} s)")
        return manifest
    # before any download: the sdist's metadata step imports torch's CUDA build, which only the TE venv has
    if not Path(te_venv_python).is_file():
        raise KitError(f"no TE venv python at {te_venv_python}: the extension's sdist is downloaded with torch's "
                       "CUDA build; make the venv first: bash .ci/setup-te-venv (or give --te-venv / $GSPO_TE_VENV)")
    cache, timings = cache_dir(), {}
    core, library = _core(cache, timings)
    t = time.time()
    _pip_download(sys.executable, WHEELS, cache / "downloads" / "py312")
    _pip_download(sys.executable, MCORE_019, cache / "downloads" / "mcore019")
    _pip_download(te_venv_python, [SDIST], cache / "downloads" / "sdist", binary=False)
    timings["download_rest_s"] = round(time.time() - t, 1)
    for sub in ("wheels", "mcore019", "sdist"):
        shutil.rmtree(out / sub, ignore_errors=True)
        (out / sub).mkdir(parents=True)
    (out / "ext").mkdir(exist_ok=True)
    shutil.copy2(core, out / "wheels" / core.name)
    for req in WHEELS:
        shutil.copy2(_find(cache / "downloads" / "py312", req), out / "wheels")
    shutil.copy2(_find(cache / "downloads" / "mcore019", MCORE_019[0]), out / "mcore019")
    shutil.copy2(_find(cache / "downloads" / "sdist", SDIST, ".tar.gz"), out / "sdist")
    files = files_of(out)
    total = sum(f["bytes"] for f in files.values())
    if total > LIMIT_BYTES:
        raise SystemExit(f"gpu_kit: the kit is {total / 2**20:.1f} MiB, over its {LIMIT_BYTES / 2**20:.0f} MiB")
    timings["total_s"] = round(time.time() - t0, 1)
    manifest = {"recipe": recipe(), "library": library, "files": files, "total_bytes": total, "build": timings}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1) + "\n")
    return manifest
