"""Hugging Face safetensors on disk, one tensor at a time: header parsing and validation, positioned
reads, an HF model directory's index of shards, and a shard writer that streams.

Memory: safetensors are read with positioned reads of one tensor at a time (no mmap: pages of a
mapped shard stay resident and count in RSS while the file is open); shards are written with their
header first (shapes are known from the metadata) and tensor bytes streamed after.
"""

from __future__ import annotations

import json
import math
import os
import struct
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

from checkpoints_tools.errors import ConversionError
from checkpoints_tools.files import read_json

ST_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U8": torch.uint8, "BOOL": torch.bool,
    "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
ST_NAMES = {v: k for k, v in ST_DTYPES.items()}
_MAX_HEADER = 100 * 2**20


@dataclass(frozen=True)
class STEntry:
    file: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    nbytes: int


def tensor_nbytes(shape: Sequence[int], dtype: torch.dtype) -> int:
    """Bytes of a contiguous tensor of ``shape`` and ``dtype`` (a shape () scalar has one element)."""
    return math.prod(shape) * dtype.itemsize


def read_safetensors_header(path: str) -> dict[str, STEntry]:
    """Parse and validate one safetensors file's header against its size (truncation check)."""
    if not os.path.isfile(path):
        raise ConversionError(f"safetensors file missing: {path}")
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            raise ConversionError(f"{path}: truncated safetensors file ({size} bytes, no header)")
        (n,) = struct.unpack("<Q", head)
        if n > _MAX_HEADER or 8 + n > size:
            raise ConversionError(f"{path}: truncated or corrupt safetensors file (header of {n} bytes, file of {size} bytes)")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ConversionError(f"{path}: corrupt safetensors header ({e})") from None
    header.pop("__metadata__", None)
    data_start = 8 + n
    out: dict[str, STEntry] = {}
    end_max = 0
    for name, info in header.items():
        dt = ST_DTYPES.get(info.get("dtype"))
        if dt is None:
            raise ConversionError(f"{path}: tensor {name} has unsupported dtype {info.get('dtype')!r}")
        shape = tuple(int(s) for s in info["shape"])
        b, e = (int(x) for x in info["data_offsets"])
        nbytes = tensor_nbytes(shape, dt)
        if e - b != nbytes:
            raise ConversionError(f"{path}: tensor {name} has {e - b} bytes for shape {shape} {info['dtype']} (needs {nbytes})")
        end_max = max(end_max, e)
        out[name] = STEntry(path, dt, shape, data_start + b, nbytes)
    if data_start + end_max > size:
        raise ConversionError(
            f"{path}: truncated safetensors file: its header needs {data_start + end_max} bytes, "
            f"the file has {size}")
    return out


def read_tensor(entry: STEntry) -> torch.Tensor:
    """One tensor from disk into fresh memory (positioned read, no mapping of the file)."""
    buf = bytearray(entry.nbytes)
    with open(entry.file, "rb") as f:
        f.seek(entry.begin)
        view = memoryview(buf)
        got = 0
        while got < entry.nbytes:
            n = f.readinto(view[got:])
            if not n:
                raise ConversionError(f"{entry.file}: unexpected end of file while reading a tensor at byte {entry.begin + got}")
            got += n
    if entry.nbytes == 0:
        return torch.empty(entry.shape, dtype=entry.dtype)
    return torch.frombuffer(buf, dtype=entry.dtype).reshape(entry.shape)


class HFCheckpoint:
    """An HF model directory's weights: index + every shard's header, validated up front."""

    def __init__(self, hf_dir: str):
        self.dir = hf_dir
        index_path = os.path.join(hf_dir, "model.safetensors.index.json")
        single = os.path.join(hf_dir, "model.safetensors")
        self.entries: dict[str, STEntry] = {}
        if os.path.isfile(index_path):
            index = read_json(index_path, "safetensors index")
            wmap = index.get("weight_map")
            if not isinstance(wmap, dict) or not wmap:
                raise ConversionError(f"{index_path}: no weight_map")
            files = sorted(set(wmap.values()))
            missing = [f for f in files if not os.path.isfile(os.path.join(hf_dir, f))]
            if missing:
                raise ConversionError(f"{index_path} lists shard(s) that do not exist: "
                                      f"{', '.join(os.path.join(hf_dir, m) for m in missing)}")
            headers = {f: read_safetensors_header(os.path.join(hf_dir, f)) for f in files}
            for name, f in wmap.items():
                if name not in headers[f]:
                    raise ConversionError(f"{index_path} maps {name} to {f}, whose header does not contain it")
                self.entries[name] = headers[f][name]
            for f, h in headers.items():
                for name in h:
                    if name not in wmap:
                        raise ConversionError(f"{os.path.join(hf_dir, f)} holds {name}, which the index does not list")
        elif os.path.isfile(single):
            self.entries = read_safetensors_header(single)
        else:
            any_st = [f for f in os.listdir(hf_dir) if f.endswith(".safetensors")]
            raise ConversionError(
                f"{hf_dir}: no model.safetensors.index.json or model.safetensors"
                + (f" (found {any_st[:3]} without an index)" if any_st else ""))

    def get(self, name: str) -> torch.Tensor:
        return read_tensor(self.entries[name])


class SafetensorsStreamWriter:
    """Write one safetensors file whose tensor list is known up front: header first, then each
    tensor's bytes as it is produced (in the declared order)."""

    def __init__(self, path: str, entries: list[tuple[str, torch.dtype, tuple[int, ...]]],
                 metadata: Optional[dict] = None):
        self.path = path
        header: dict[str, Any] = {"__metadata__": metadata or {"format": "pt"}}
        off = 0
        self.expect: list[tuple[str, torch.dtype, tuple[int, ...], int]] = []
        for name, dt, shape in entries:
            n = tensor_nbytes(shape, dt)
            header[name] = {"dtype": ST_NAMES[dt], "shape": list(shape), "data_offsets": [off, off + n]}
            self.expect.append((name, dt, tuple(shape), n))
            off += n
        self.total = off
        blob = json.dumps(header, separators=(",", ":")).encode("utf-8")
        blob += b" " * (-len(blob) % 8)  # 8-byte aligned data, as the safetensors library writes
        self.f = open(path, "wb")
        self.f.write(struct.pack("<Q", len(blob)))
        self.f.write(blob)
        self.pos = 0

    def write(self, name: str, t: torch.Tensor) -> int:
        ename, dt, shape, n = self.expect[self.pos]
        if name != ename or t.dtype != dt or tuple(t.shape) != shape:
            raise ConversionError(f"{self.path}: internal error: writing {name} {t.dtype} {tuple(t.shape)}, "
                                  f"expected {ename} {dt} {shape}")
        if n:
            self.f.write(t.contiguous().view(-1).view(torch.uint8).numpy().data)
        self.pos += 1
        return n

    @property
    def complete(self) -> bool:
        return self.pos == len(self.expect)

    def abort(self) -> None:
        if not self.f.closed:
            self.f.close()

    def close(self) -> None:
        if not self.complete:
            raise ConversionError(f"{self.path}: internal error: {len(self.expect) - self.pos} tensors not written")
        self.f.flush()
        os.fsync(self.f.fileno())
        self.f.close()
