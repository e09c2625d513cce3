"""python -m tools.gpu_kit {build,check,verify-cpu,install,images} ... (see tools/gpu_kit/__init__.py)."""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def default_te_venv() -> Path:
    return Path(os.environ.get("GSPO_TE_VENV") or ROOT / ".te-venv")


def default_copy(venv: Path) -> Path:
    """Where verify-cpu puts its copy of the TE venv: beside it (hard links need the same file system), so
    ``.te-venv-kit`` in the checkout for the default venv, which .gitignore lists."""
    return Path(f"{venv}-kit")


def main(argv=None) -> int:
    from tools.gpu_kit import KitError, fatbin

    try:
        return _main(argv)
    except (KitError, fatbin.FatbinError, OSError) as e:
        # a missing or damaged kit, venv or library: one line, the user's to fix (no traceback)
        print(f"python -m tools.gpu_kit: error: {e}", file=sys.stderr, flush=True)
        return 2


def _main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tools.gpu_kit", description=__doc__)
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="make the kit from PyPI (cached)")
    b.add_argument("--out", type=Path, default=ROOT / ".gpu-kit")
    b.add_argument("--te-venv", type=Path, default=None, help="a venv with torch's CUDA build, for the "
                   "extension's sdist download (default: $GSPO_TE_VENV, else .te-venv)")
    c = sub.add_parser("check", help="the kit's manifest and every file's size and sha256")
    c.add_argument("kit", type=Path)
    v = sub.add_parser("verify-cpu", help="the TE tier against the kit's library, in a copy of the TE venv")
    v.add_argument("kit", type=Path)
    v.add_argument("--te-venv", type=Path, default=None)
    v.add_argument("--copy", type=Path, default=None, help="where the venv's copy goes (default: <venv>-kit)")
    v.add_argument("pytest_args", nargs="*", help="more pytest arguments (after --)")
    i = sub.add_parser("install", help="on the GPU machine: the kit into this Python")
    i.add_argument("kit", type=Path)
    i.add_argument("--mcore019-target", type=Path, default=None)
    i.add_argument("--build-extension-only", action="store_true",
                   help="install the wheels, build the torch extension (kept in KIT/ext, copied to $OUT), stop")
    s = sub.add_parser("images", help="the GPU images in a library's fat binaries, by architecture")
    s.add_argument("library", type=Path)
    args = ap.parse_args(argv)
    if args.cmd == "build":
        from tools.gpu_kit.build import build

        venv = args.te_venv or default_te_venv()
        m = build(args.out.resolve(), str(venv / "bin" / "python"))
        lib = m["library"]
        print(f"gpu_kit: {args.out} {m['total_bytes'] / 2**20:.1f} MiB, {len(m['files'])} files; TE's library "
              f"{lib['library_bytes']} bytes with images {lib['images']} ({lib['fatbin_bytes_kept']} of "
              f"{lib['fatbin_bytes']} device-code bytes kept); times {m['build']}")
        return 0
    if args.cmd == "check":
        from tools.gpu_kit.build import check_kit

        m = check_kit(args.kit)
        print(f"gpu_kit check: {args.kit} ok: {len(m['files'])} files, "
              f"{sum(f['bytes'] for f in m['files'].values()) / 2**20:.1f} MiB as manifest.json says")
        return 0
    if args.cmd == "verify-cpu":
        from tools.gpu_kit.verify import verify

        venv = (args.te_venv or default_te_venv()).resolve()
        return verify(args.kit.resolve(), venv, (args.copy or default_copy(venv)).resolve(), args.pytest_args)
    if args.cmd == "install":
        from tools.gpu_kit.install import install

        kit = args.kit.resolve()
        install(kit, (args.mcore019_target or kit.parent / "mcore019-site").resolve(), args.build_extension_only)
        return 0
    from tools.gpu_kit import fatbin

    print(fatbin.images(args.library.read_bytes()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
