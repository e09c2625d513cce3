"""CUDA fat binaries in an ELF shared library: read them, and cut them down to one GPU architecture in place.

A library built by nvcc for several architectures holds its device code in the ``.nv_fatbin`` section:
one *container* per compiled translation unit, which the host code registers by address
(``.nvFatBinSegment`` holds a pointer to each container's start). A container is a 16-byte header
(magic 0xBA55ED50, version, header size, size of what follows) and then *entries*, one per
architecture: a header (kind: 1 PTX, 2 ELF/cubin; the header's size; the padded size of the payload
that follows; the architecture as a number, e.g. 90; flags, e.g. 0x100000 for an arch-specific
``sm_90a`` image, 0x8000 for a zstd-compressed payload) and the payload.

``prune`` keeps, in every container, only the entries of the wanted architecture (sm_90 and sm_90a for
Hopper), moved to the container's start, and gives the last kept entry the freed bytes as zero padding:
no container moves and none changes size, so the pointers in ``.nvFatBinSegment``, every other section
and every byte outside ``.nv_fatbin`` stay as they are, and a tool that walks the section entry by
entry (cuobjdump, the CUDA runtime) still finds well-formed containers. The payloads are kept byte for
byte (already compressed by nvcc), so the kept images are the ones NVIDIA built. The freed space is
zeros, which any compressor removes: that is what makes the library small enough to travel.

What the CUDA runtime would pick on a GPU of compute capability 9.0 is an sm_90 / sm_90a cubin, else
PTX of the highest compute capability not above 9.0 (JIT-compiled). ``prune`` keeps exactly those
candidates: every ELF entry of the architecture, and, in a container with none, its PTX entries up to
that architecture; a container with neither (device code that never ran on Hopper) keeps its smallest
entry, so that it still loads as before, with no image for the device.
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Iterator

MAGIC = 0xBA55ED50
KIND_PTX, KIND_ELF = 1, 2
_CONTAINER = struct.Struct("<IHHQ")  # magic, version, header size, size of the entries
_ENTRY = struct.Struct("<HHIQ")  # kind, version, header size, padded payload size
_ARCH_AT, _FLAGS_AT = 28, 40
_ARCH_SPECIFIC = 0x100000  # sm_90a (the "a" images: wgmma, TMA ... run on that chip only)


class FatbinError(ValueError):
    """The library's device code is not laid out as this module reads it (named, with the offset)."""


@dataclasses.dataclass(frozen=True)
class Entry:
    offset: int  # of the entry's header, from the section's start
    kind: int
    arch: int
    flags: int
    header_size: int
    payload_size: int  # padded

    @property
    def size(self) -> int:
        return self.header_size + self.payload_size

    @property
    def name(self) -> str:
        suffix = "a" if self.flags & _ARCH_SPECIFIC else ""
        return f"{'sm' if self.kind == KIND_ELF else 'compute'}_{self.arch}{suffix}"


@dataclasses.dataclass(frozen=True)
class Container:
    offset: int
    header_size: int
    entries_size: int
    entries: tuple

    @property
    def end(self) -> int:
        return self.offset + self.header_size + self.entries_size


def section(elf: bytes, name: str = ".nv_fatbin") -> tuple[int, int]:
    """(file offset, size) of an ELF64 little-endian section, by name; FatbinError if absent."""
    if elf[:4] != b"\x7fELF" or elf[4] != 2 or elf[5] != 1:
        raise FatbinError("not a 64-bit little-endian ELF file")
    shoff, = struct.unpack_from("<Q", elf, 0x28)
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", elf, 0x3A)
    def header(i):  # name, offset, size of section i
        base = shoff + i * shentsize
        return struct.unpack_from("<I", elf, base)[0], *struct.unpack_from("<QQ", elf, base + 0x18)
    _, str_off, _ = header(shstrndx)
    for i in range(shnum):
        name_off, off, size = header(i)
        end = elf.index(b"\0", str_off + name_off)
        if elf[str_off + name_off:end].decode() == name:
            return off, size
    raise FatbinError(f"no {name} section")


def containers(sec: bytes) -> Iterator[Container]:
    """The containers of a ``.nv_fatbin`` section, in order (zero padding between them skipped)."""
    pos = 0
    while pos < len(sec):
        if sec[pos] == 0 and not any(sec[pos:pos + 8]):  # alignment padding between containers
            pos += 8
            continue
        magic, _version, hsize, esize = _CONTAINER.unpack_from(sec, pos)
        if magic != MAGIC:
            raise FatbinError(f"no fat-binary magic at section offset {pos:#x} (found {magic:#x})")
        entries, e, end = [], pos + hsize, pos + hsize + esize
        if end > len(sec):
            raise FatbinError(f"container at {pos:#x} runs past the section's end")
        while e < end:
            kind, _v, ehs, psize = _ENTRY.unpack_from(sec, e)
            arch, = struct.unpack_from("<I", sec, e + _ARCH_AT)
            flags, = struct.unpack_from("<Q", sec, e + _FLAGS_AT)
            if ehs < _FLAGS_AT + 8 or e + ehs + psize > end:
                raise FatbinError(f"entry at {e:#x} of the container at {pos:#x} is malformed")
            entries.append(Entry(e, kind, arch, flags, ehs, psize))
            e += ehs + psize
        yield Container(pos, hsize, esize, tuple(entries))
        pos = end


def keep(entries: tuple, arch: int) -> list:
    """The entries a device of compute capability ``arch`` (90: sm_90, sm_90a) could load (module doc)."""
    elf = [e for e in entries if e.kind == KIND_ELF and e.arch == arch]
    if elf:
        return elf
    ptx = [e for e in entries if e.kind == KIND_PTX and e.arch <= arch]
    if ptx:
        return ptx
    return [min(entries, key=lambda e: e.size)] if entries else []


def prune_section(sec: bytes, arch: int) -> tuple[bytearray, dict]:
    """``sec`` with every container cut down to ``keep``'s entries, in place (module doc); and counts."""
    out = bytearray(sec)
    kept = dropped = 0
    for c in containers(sec):
        chosen = keep(c.entries, arch)
        pos = c.offset + c.header_size
        for i, e in enumerate(chosen):
            blob = bytearray(sec[e.offset:e.offset + e.size])
            if i == len(chosen) - 1:  # the last kept entry takes the freed bytes as zero padding
                pad = c.end - (pos + e.size)
                struct.pack_into("<Q", blob, 8, e.payload_size + pad)
                blob += bytes(pad)
            out[pos:pos + len(blob)] = blob
            pos += len(blob)
        if pos != c.end:
            raise FatbinError(f"container at {c.offset:#x}: rewritten to {pos - c.offset} bytes, not "
                              f"{c.end - c.offset}")
        kept += len(chosen)
        dropped += len(c.entries) - len(chosen)
    return out, {"containers": sum(1 for _ in containers(sec)), "kept": kept, "dropped": dropped}


def prune(elf: bytes, arch: int = 90) -> tuple[bytes, dict]:
    """The library ``elf`` with device code for ``arch`` alone (module doc), and what was kept: {"containers",
    "kept", "dropped", "images": {name: count}}. Everything outside ``.nv_fatbin`` is unchanged."""
    off, size = section(elf)
    sec, counts = prune_section(elf[off:off + size], arch)
    out = elf[:off] + bytes(sec) + elf[off + size:]
    counts["images"] = images(out)
    return out, counts


def images(elf: bytes) -> dict:
    """{image name (sm_90, sm_90a, compute_80, ...): count} over the library's containers."""
    off, size = section(elf)
    counts: dict = {}
    for c in containers(elf[off:off + size]):
        for e in c.entries:
            counts[e.name] = counts.get(e.name, 0) + 1
    return dict(sorted(counts.items()))


def check_pruned(original: bytes, pruned: bytes, arch: int = 90) -> None:
    """FatbinError unless ``pruned`` is ``prune(original, arch)``'s kind of result: the same size, every
    byte outside ``.nv_fatbin`` equal, the same containers at the same offsets and sizes, and in each
    exactly the entries ``keep`` chooses, their headers (but the padded size) and payloads equal."""
    if len(original) != len(pruned):
        raise FatbinError(f"size changed: {len(original)} -> {len(pruned)} bytes")
    off, size = section(original)
    if original[:off] != pruned[:off] or original[off + size:] != pruned[off + size:]:
        raise FatbinError("bytes outside .nv_fatbin differ")
    a_sec, b_sec = original[off:off + size], pruned[off:off + size]
    a_all, b_all = list(containers(a_sec)), list(containers(b_sec))
    if [(c.offset, c.end) for c in a_all] != [(c.offset, c.end) for c in b_all]:
        raise FatbinError("containers moved or changed size")
    for a, b in zip(a_all, b_all):
        want = keep(a.entries, arch)
        if len(want) != len(b.entries):
            raise FatbinError(f"container at {a.offset:#x}: {len(b.entries)} entries, {len(want)} expected")
        for ea, eb in zip(want, b.entries):
            head_a, head_b = a_sec[ea.offset:ea.offset + ea.header_size], b_sec[eb.offset:eb.offset + eb.header_size]
            body_a = a_sec[ea.offset + ea.header_size:ea.offset + ea.size]
            body_b = b_sec[eb.offset + eb.header_size:eb.offset + eb.size]
            if (head_a[:8] + head_a[16:] != head_b[:8] + head_b[16:] or body_b[:len(body_a)] != body_a
                    or any(body_b[len(body_a):])):
                raise FatbinError(f"container at {a.offset:#x}: its {ea.name} image differs from the original's")
