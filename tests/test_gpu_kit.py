"""tools/gpu_kit: cutting a library's fat binaries down to Hopper's device code in place (fatbin.py), on
hand-made containers whose every byte is known, and on a real CUDA library where the TE tier's venv has one;
the cut core wheel's RECORD. The kit's build downloads from PyPI and its proof is the TE tier against the
cut library (``python -m tools.gpu_kit verify-cpu``): both are run by hand, docs/gpu_kit.md has the figures."""

import base64
import csv
import hashlib
import io
import os
import struct
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tools.gpu_kit import KitError, build, fatbin

TE_VENV = Path(os.environ.get("GSPO_TE_VENV") or Path(__file__).resolve().parents[1] / ".te-venv")
NCCL_EP = next(iter(sorted(TE_VENV.glob("lib/python3*/site-packages/transformer_engine/wheel_lib/libnccl_ep.so"))), None)


def entry(kind: int, arch: int, payload: bytes, flags: int = 0x11) -> bytes:
    """One fat-binary entry: a 64-byte header and its payload padded to 8 bytes."""
    padded = payload + bytes(-len(payload) % 8)
    head = bytearray(64)
    struct.pack_into("<HHIQ", head, 0, kind, 0x0101, 64, len(padded))
    struct.pack_into("<I", head, 16, len(payload))
    struct.pack_into("<I", head, 28, arch)
    struct.pack_into("<Q", head, 40, flags)
    return bytes(head) + padded


def container(*entries: bytes) -> bytes:
    body = b"".join(entries)
    return struct.pack("<IHHQ", fatbin.MAGIC, 1, 16, len(body)) + body


SM = {a: entry(fatbin.KIND_ELF, a, bytes([a]) * (a * 3 + 5)) for a in (75, 80, 90, 100, 120)}
SM90A = entry(fatbin.KIND_ELF, 90, b"hopper-a" * 9, flags=0x100011)
PTX80 = entry(fatbin.KIND_PTX, 80, b".version 8.0 ptx" * 4)
PTX100 = entry(fatbin.KIND_PTX, 100, b".version 9.0 ptx" * 3)


def test_each_container_keeps_what_a_hopper_gpu_would_load_and_nothing_moves():
    # 1: every architecture, sm_90 third; 2: sm_90 and sm_90a; 3: no cubin for 90 but PTX for 80 (JIT-compiled
    # there) and 100 (not loadable); 4: Blackwell only (no image for Hopper: keeps its smallest entry)
    parts = [container(SM[75], SM[80], SM[90], SM[100], SM[120]), container(SM[80], SM[90], SM90A),
             container(SM[75], PTX80, PTX100, SM[100]), container(SM[120], SM[100])]
    sec = b"".join(parts)
    out, counts = fatbin.prune_section(sec, 90)
    assert len(out) == len(sec)
    got = list(fatbin.containers(bytes(out)))
    assert [(c.offset, c.end) for c in got] == [(c.offset, c.end) for c in fatbin.containers(sec)]
    assert [[e.name for e in c.entries] for c in got] == [["sm_90"], ["sm_90", "sm_90a"], ["compute_80"], ["sm_100"]]
    assert counts == {"containers": 4, "kept": 5, "dropped": 9}
    # the kept images are byte for byte the originals, at their container's start; the freed bytes are zeros
    first = got[0].entries[0]
    assert bytes(out[first.offset + 64:first.offset + len(SM[90])]) == SM[90][64:]
    assert first.offset == 16 and not any(out[first.offset + len(SM[90]):got[0].end])
    assert first.payload_size == len(SM[90]) - 64 + len(SM[75]) + len(SM[80]) + len(SM[100]) + len(SM[120])


def test_check_pruned_refuses_a_changed_image_or_a_moved_byte():
    sec = container(SM[75], SM[90], SM[120]) + container(SM[80], SM[90])
    out, _ = fatbin.prune_section(sec, 90)
    out = bytes(out)
    elf = _elf_with(sec)
    fatbin.check_pruned(elf, _elf_with(out))  # the genuine cut passes
    bad = bytearray(out)
    bad[16 + 64 + 3] ^= 1  # one byte of the kept sm_90 image
    with pytest.raises(fatbin.FatbinError, match="sm_90 image differs"):
        fatbin.check_pruned(elf, _elf_with(bytes(bad)))
    with pytest.raises(fatbin.FatbinError, match="outside .nv_fatbin"):
        fatbin.check_pruned(elf, _elf_with(out, host=b"\x90" * 63 + b"\xc3"))
    with pytest.raises(fatbin.FatbinError, match="no fat-binary magic"):
        list(fatbin.containers(b"\x01" * 32))


def _elf_with(fat: bytes, host: bytes = b"\x90" * 64) -> bytes:
    """A minimal ELF64 file: host bytes, a .nv_fatbin section and the section-name table."""
    names = b"\0.nv_fatbin\0.shstrtab\0"
    off_host, off_fat = 64, 64 + len(host)
    off_names = off_fat + len(fat)
    shoff = off_names + len(names) + (-(off_names + len(names)) % 8)
    head = bytearray(64)
    head[:6] = b"\x7fELF\x02\x01"
    struct.pack_into("<Q", head, 0x28, shoff)
    struct.pack_into("<HHH", head, 0x3A, 64, 3, 2)
    def shdr(name, off, size):
        h = bytearray(64)
        struct.pack_into("<I", h, 0, name)
        struct.pack_into("<QQ", h, 0x18, off, size)
        return bytes(h)
    body = bytes(head) + host + fat + names + bytes(shoff - off_names - len(names))
    return body + shdr(0, 0, 0) + shdr(1, off_fat, len(fat)) + shdr(11, off_names, len(names))


def test_a_minimal_elf_is_cut_and_listed_by_images():
    sec = container(SM[75], SM[90], SM[120]) + container(SM[80], SM[90], SM90A)
    elf = _elf_with(sec)
    assert fatbin.images(elf) == {"sm_120": 1, "sm_75": 1, "sm_80": 1, "sm_90": 2, "sm_90a": 1}
    out, counts = fatbin.prune(elf)
    assert counts["images"] == {"sm_90": 2, "sm_90a": 1} and len(out) == len(elf)
    fatbin.check_pruned(elf, out)


def test_the_cut_wheel_keeps_every_other_member_and_records_the_new_library(tmp_path, monkeypatch):
    """cut_core_wheel on a wheel of three members: the library cut (and its RECORD line with the new hash
    and size, as pip checks it), the rest byte for byte."""
    lib = _elf_with(container(SM[75], SM[90], SM[120]))
    other = b"print('transformer_engine')\n"
    record = io.StringIO()
    w = csv.writer(record, lineterminator="\n")
    w.writerows([["transformer_engine/__init__.py", "sha256=x", str(len(other))], [build.LIBRARY, "sha256=y", str(len(lib))],
                 ["transformer_engine_cu13-2.20.2.dist-info/RECORD", "", ""]])
    src = tmp_path / "transformer_engine_cu13-2.20.2-py3-none-manylinux_2_28_x86_64.whl"
    with zipfile.ZipFile(src, "w") as z:
        z.writestr("transformer_engine/__init__.py", other)
        z.writestr(build.LIBRARY, lib)
        z.writestr("transformer_engine_cu13-2.20.2.dist-info/RECORD", record.getvalue())
    info = build.cut_core_wheel(src, tmp_path / "cut.whl")
    with zipfile.ZipFile(tmp_path / "cut.whl") as z:
        assert z.namelist() == ["transformer_engine/__init__.py", build.LIBRARY, "transformer_engine_cu13-2.20.2.dist-info/RECORD"]
        assert z.read("transformer_engine/__init__.py") == other
        cut = z.read(build.LIBRARY)
        rows = list(csv.reader(io.StringIO(z.read("transformer_engine_cu13-2.20.2.dist-info/RECORD").decode())))
    assert fatbin.images(cut) == {"sm_90": 1} and len(cut) == len(lib)
    digest = base64.urlsafe_b64encode(hashlib.sha256(cut).digest()).rstrip(b"=").decode()
    assert rows[1] == [build.LIBRARY, f"sha256={digest}", str(len(cut))] and rows[0][1] == "sha256=x"
    assert info["images"] == {"sm_90": 1} and info["dropped_images"] == 2
    assert info["fatbin_bytes_kept"] == len(SM[90]) and info["library_sha256"] == hashlib.sha256(cut).hexdigest()


@pytest.mark.skipif(NCCL_EP is None, reason=f"no Transformer Engine venv at {TE_VENV} (bash .ci/setup-te-venv)")
def test_a_real_cuda_library_is_cut_to_hopper_and_cuobjdump_reads_it(tmp_path):
    """TE's libnccl_ep.so (nvcc's fat binaries: sm_90, sm_100, sm_120, zstd-compressed): cut, checked, and
    listed by NVIDIA's cuobjdump (from triton's wheel in the same venv) with its sm_90 images alone."""
    original = NCCL_EP.read_bytes()
    assert set(fatbin.images(original)) > {"sm_90"}
    out, counts = fatbin.prune(original)
    fatbin.check_pruned(original, out)
    assert counts["images"] == {"sm_90": fatbin.images(original)["sm_90"]}
    cuobjdump = next(iter(TE_VENV.glob("lib/python3*/site-packages/triton/backends/nvidia/bin/cuobjdump")), None)
    if cuobjdump is None:
        return
    (tmp_path / "lib.so").write_bytes(out)
    listed = subprocess.run([str(cuobjdump), "-lelf", str(tmp_path / "lib.so")], capture_output=True, text=True,
                            timeout=120)
    assert listed.returncode == 0, listed.stderr
    archs = {ln.rsplit(".", 2)[-2] for ln in listed.stdout.splitlines() if ln.startswith("ELF file")}
    assert archs == {"sm_90"}, listed.stdout


ROOT = Path(__file__).resolve().parents[1]


def _gpu_kit(*args, env=None):
    return subprocess.run([sys.executable, "-m", "tools.gpu_kit", *map(str, args)], capture_output=True, text=True,
                          cwd=ROOT, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT), **(env or {})})


def _one_line_error(p, *needles):
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stdout + p.stderr
    assert len(p.stderr.strip().splitlines()) == 1, p.stderr
    for n in needles:
        assert n in p.stderr, p.stderr


def test_the_commands_say_in_one_line_what_is_missing_or_damaged(tmp_path):
    """Issue 47 O: a missing kit (install), a garbage manifest (verify-cpu, check), and a build in a fresh clone
    without the TE venv (it needs it for the sdist's download) each gave a raw traceback."""
    _one_line_error(_gpu_kit("install", tmp_path / "nope"), f"no GPU kit at {tmp_path / 'nope'}",
                    "python -m tools.gpu_kit build --out")
    kit = tmp_path / "kit"
    kit.mkdir()
    (kit / "manifest.json").write_text("not json at all")
    _one_line_error(_gpu_kit("verify-cpu", kit, "--te-venv", tmp_path / "venv"), "manifest.json is unreadable")
    _one_line_error(_gpu_kit("check", kit), "manifest.json is unreadable")
    _one_line_error(_gpu_kit("images", tmp_path / "nope.so"), "nope.so")
    # the build stops before any download, naming the one command to run first
    p = _gpu_kit("build", "--out", tmp_path / "new-kit", env={"GSPO_TE_VENV": str(tmp_path / "no-venv")})
    _one_line_error(p, f"no TE venv python at {tmp_path / 'no-venv'}/bin/python", "bash .ci/setup-te-venv")
    assert not (tmp_path / "new-kit").exists()


def test_check_passes_a_whole_kit_and_returns_its_manifest(tmp_path):
    kit = tmp_path / "kit"
    (kit / "wheels").mkdir(parents=True)
    (kit / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"abc")
    (kit / "ext").mkdir()
    (kit / "ext" / "built.whl").write_bytes(b"brought back from the GPU machine")  # outside the manifest
    manifest = {"files": build.files_of(kit), "library": {"library_sha256": "x"}}
    (kit / "manifest.json").write_text(__import__("json").dumps(manifest))
    assert build.check_kit(kit) == manifest
    p = _gpu_kit("check", kit)
    assert p.returncode == 0 and "1 files" in p.stdout, p.stdout + p.stderr
    (kit / "wheels" / "a-1.0-py3-none-any.whl").write_bytes(b"abd")
    with pytest.raises(KitError, match=r"1 file\(s\) differ .*a-1.0-py3-none-any.whl \(sha256 differs\)"):
        build.check_kit(kit)


def test_verify_cpus_copy_of_the_te_venv_is_ignored_by_git():
    """verify-cpu's copy (374 MB, hard links beside the venv) was left untracked in the checkout, and a
    `git add -A` took it."""
    from tools.gpu_kit.__main__ import default_copy

    if subprocess.run(["git", "rev-parse"], cwd=ROOT, capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    for path in (default_copy(ROOT / ".te-venv"), ROOT / ".te-venv"):
        p = subprocess.run(["git", "check-ignore", "-q", f"{path}/bin/python"], cwd=ROOT, capture_output=True)
        assert p.returncode == 0, f"{path} is not git-ignored"
    assert default_copy(ROOT / ".te-venv") == ROOT / ".te-venv-kit"
