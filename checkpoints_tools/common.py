"""Shared machinery of the HF <-> Megatron converters: the model-family registry, streaming readers
and writers for both on-disk formats, the atomic output directory and progress / memory reporting.

Nothing here knows a model family. A family is one module (e.g. ``qwen3_moe.py``) that subclasses
``ModelMapping`` and lists its ``Rule``s: each rule pairs ONE chunk of one Megatron global tensor
(whole tensor, one layer, or one (layer, expert) slice) with the Hugging Face tensors it is made
of, and carries the two transforms. Both converters walk the same rules, so the mapping exists once.

Memory: neither direction ever materializes the model.
- safetensors are read with positioned reads of one tensor at a time (no mmap: pages of a mapped
  shard stay resident and count in RSS while the file is open);
- the torch_dist checkpoint is written with torch.distributed.checkpoint's FileSystemWriter, one
  ``write_data`` call per tensor group (embedding, each layer, final), each group producing its
  tensors lazily in ``SavePlanner.resolve_data``; the global ``.metadata`` describes every stacked
  tensor as per-layer / per-(layer, expert) chunks with global offsets, as megatron's own save does;
- the torch_dist checkpoint is read with FileSystemReader and a per-region LoadPlan, so only the
  stored chunks that overlap the requested (layer, expert) region are loaded, whatever TP/EP layout
  wrote them;
- safetensors shards are written with their header first (shapes are known from the metadata) and
  tensor bytes streamed after.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import re
import resource
import shutil
import struct
import sys
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Optional, Sequence

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner


class ConversionError(RuntimeError):
    """Bad input or refused operation; the message names the file / key and the numbers."""


# ----------------------------------------------------------------------------------------------
# Model-family registry and the mapping description
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class MTensor:
    """One Megatron torch_dist global tensor.

    ``stack_dims`` leading axes are chunked one index at a time (0: whole tensor, 1: per layer,
    2: per (layer, expert)). ``aliases`` are other spellings of the same tensor used by another
    megatron layer spec (e.g. Transformer Engine): written too on import, accepted on export.
    """

    key: str
    shape: tuple[int, ...]
    stack_dims: int = 0
    aliases: tuple[str, ...] = ()


@dataclass(frozen=True)
class Rule:
    """One Megatron chunk <-> the HF tensors it is made of.

    ``index`` addresses the chunk on the tensor's leading ``stack_dims`` axes; the chunk's own
    shape (what the transforms see) is ``mtensor.shape[len(index):]``.
    """

    mtensor: MTensor
    index: tuple[int, ...]
    hf_names: tuple[str, ...]
    hf_shapes: tuple[tuple[int, ...], ...]
    to_megatron: Callable[[list[torch.Tensor]], torch.Tensor]
    to_hf: Callable[[torch.Tensor], list[torch.Tensor]]

    @property
    def chunk_shape(self) -> tuple[int, ...]:
        return tuple(self.mtensor.shape[len(self.index):])

    @property
    def offsets(self) -> tuple[int, ...]:
        return tuple(self.index) + (0,) * len(self.chunk_shape)

    @property
    def sizes(self) -> tuple[int, ...]:
        return (1,) * len(self.index) + self.chunk_shape


@dataclass
class Group:
    """A unit of progress and of bounded memory: the embedding, one layer, the final tensors."""

    name: str
    rules: list[Rule] = field(default_factory=list)
    # megatron ShardedObject unique keys ("<key>/shard_<offsets>_<shape>") written with None
    # payload: the `_extra_state` of megatron / TE linear layers, which a load requests.
    objects: list[str] = field(default_factory=list)


def extra_state_key(key: str, index: Sequence[int] = (), lead_shape: Sequence[int] = ()) -> str:
    """megatron ShardedObject.unique_key for an ``_extra_state`` chunk (no offsets -> shard_0_1)."""
    if not index:
        index, lead_shape = (0,), (1,)
    return f"{key}/shard_{'.'.join(map(str, index))}_{'.'.join(map(str, lead_shape))}"


class ModelMapping:
    """Base of a model family's parameter mapping. Subclasses set ``model_type`` (the HF
    config.json value) and implement the four methods below; everything else is generic."""

    model_type: str = ""

    def __init__(self, cfg):
        self.cfg = cfg

    # -- config ---------------------------------------------------------------------------------
    @classmethod
    def model_config_from_hf(cls, hf_config: dict):
        """HF config.json dict -> megatron_gspo ModelConfig."""
        raise NotImplementedError

    def hf_config(self, base: Optional[dict], dtype: torch.dtype) -> dict:
        """config.json for the exported model: ``base`` (an HF config of this family, or None)
        with every architecture field overwritten from ``self.cfg``."""
        raise NotImplementedError

    # -- tensors --------------------------------------------------------------------------------
    def megatron_tensors(self) -> list[MTensor]:
        raise NotImplementedError

    def groups(self) -> list[Group]:
        raise NotImplementedError

    # -- derived --------------------------------------------------------------------------------
    def hf_shapes(self) -> dict[str, tuple[int, ...]]:
        out: dict[str, tuple[int, ...]] = {}
        for g in self.groups():
            for r in g.rules:
                out.update(zip(r.hf_names, r.hf_shapes))
        return out

    def hint(self, name: str) -> str:
        """A config field to suspect when tensor ``name`` mismatches (family specific)."""
        return ""


_REGISTRY: dict[str, type[ModelMapping]] = {}


def register(cls: type[ModelMapping]) -> type[ModelMapping]:
    if not cls.model_type:
        raise ValueError(f"{cls.__name__}.model_type is empty")
    _REGISTRY[cls.model_type] = cls
    return cls


def get_mapping(model_type: Optional[str]) -> type[ModelMapping]:
    if model_type not in _REGISTRY:
        raise ConversionError(
            f"model_type={model_type!r} has no converter; supported: {sorted(_REGISTRY)}")
    return _REGISTRY[model_type]


def supported_model_types() -> list[str]:
    return sorted(_REGISTRY)


# ----------------------------------------------------------------------------------------------
# Sizes, dtypes, memory, progress
# ----------------------------------------------------------------------------------------------

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def parse_size(text: str | int) -> int:
    """'5GB' -> 5e9 (decimal units like transformers' max_shard_size; KiB/MiB/GiB binary)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([KMGT]I?B|B)?\s*", str(text), re.IGNORECASE)
    if not m:
        raise ConversionError(f"cannot parse size {text!r}; use e.g. 5GB, 500MB, 2GiB or a byte count")
    n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").upper()])
    if n <= 0:
        raise ConversionError(f"size must be positive, got {text!r}")
    return n


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000.0
    return f"{n:.2f} TB"


DTYPES = {"fp32": torch.float32, "float32": torch.float32, "bf16": torch.bfloat16,
          "bfloat16": torch.bfloat16, "fp16": torch.float16, "float16": torch.float16}


def parse_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    if name in (None, "auto"):
        return None
    if name not in DTYPES:
        raise ConversionError(f"--dtype {name!r} is not one of auto, fp32, bf16, fp16")
    return DTYPES[name]


def current_rss() -> int:
    """Resident set size of this process now, in bytes."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:  # pragma: no cover - non-Linux
        import psutil

        return psutil.Process().memory_info().rss


def reset_peak_rss() -> bool:
    """Restart the kernel's RSS high-water mark (VmHWM) from the current RSS (Linux >= 4.0)."""
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


class Progress:
    """Per-group progress lines on stderr and the end-of-run summary."""

    def __init__(self, what: str, total_groups: int, quiet: bool = False):
        self.what = what
        self.total = total_groups
        self.quiet = quiet
        self.t0 = time.perf_counter()
        reset_peak_rss()  # measure the conversion, not the imports before it
        self.baseline_rss = current_rss()
        self.done = 0
        self.tensors = 0
        self.bytes = 0

    def log(self, msg: str) -> None:
        if not self.quiet:
            print(f"[{self.what}] {msg}", file=sys.stderr, flush=True)

    def group(self, name: str, tensors: int, nbytes: int) -> None:
        self.done += 1
        self.tensors += tensors
        self.bytes += nbytes
        self.log(f"{self.done}/{self.total} {name}: {tensors} tensors, {human_bytes(nbytes)} "
                 f"({time.perf_counter() - self.t0:.1f}s, rss {human_bytes(current_rss())})")

    def summary(self, out: str, **extra: Any) -> dict:
        s = dict(output=out, tensors=self.tensors, bytes=self.bytes,
                 seconds=round(time.perf_counter() - self.t0, 3),
                 peak_rss_bytes=peak_rss(), baseline_rss_bytes=self.baseline_rss)
        s["peak_rss_growth_bytes"] = max(0, s["peak_rss_bytes"] - self.baseline_rss)
        s.update(extra)
        self.log(f"done: {s['tensors']} tensors, {human_bytes(s['bytes'])} in {s['seconds']:.1f}s; "
                 f"peak RSS {human_bytes(s['peak_rss_bytes'])} "
                 f"(+{human_bytes(s['peak_rss_growth_bytes'])} over the "
                 f"{human_bytes(self.baseline_rss)} at start) -> {out}")
        return s


def write_summary(path: Optional[str], summary: dict) -> None:
    if path:
        with open(path, "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2)


def add_common_args(ap, dtype_help: str) -> None:
    """Options both converters take."""
    ap.add_argument("--force", action="store_true", help="replace an existing output directory")
    ap.add_argument("--dtype", default="auto", help=dtype_help)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch intra-op threads (default 1: the work is copies and I/O; more threads "
                         "mostly contend)")
    ap.add_argument("--summary-json", default=None, help="also write the summary to this JSON file")
    ap.add_argument("--quiet", action="store_true", help="no progress lines")


def run_cli(args, convert_fn) -> int:
    """Run ``convert_fn()`` with ``args.threads`` torch threads; a ConversionError becomes
    ``error: ...`` on stderr and exit status 2 (nothing was written)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(max(1, args.threads))
    try:
        summary = convert_fn()
    except ConversionError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    finally:
        torch.set_num_threads(threads)
    write_summary(args.summary_json, summary)
    return 0


# ----------------------------------------------------------------------------------------------
# Output directory: temp dir next to the target, renamed into place only when complete
# ----------------------------------------------------------------------------------------------


def check_output(target: str, force: bool, inputs: Iterable[str] = ()) -> str:
    """Refuse an existing output without --force, and an output that is (or holds) an input."""
    target = os.path.abspath(target)
    for src in inputs:
        if not src:
            continue
        s = os.path.realpath(src)
        t = os.path.realpath(target)
        if s == t or s.startswith(t + os.sep) or t.startswith(s + os.sep):
            raise ConversionError(f"output {target} overlaps the input {src}; choose another --out")
    if os.path.lexists(target) and not force:
        raise ConversionError(f"output {target} already exists; pass --force to replace it")
    return target


@contextlib.contextmanager
def atomic_output_dir(target: str, force: bool) -> Iterator[str]:
    """Yield a fresh temp dir next to ``target``; on success rename it to ``target`` (replacing
    an existing one only with ``force``), on any error delete it and leave ``target`` untouched."""
    target = os.path.abspath(target)
    parent = os.path.dirname(target)
    os.makedirs(parent, exist_ok=True)
    base = os.path.basename(target)
    tmp = tempfile.mkdtemp(prefix=f".{base}.tmp-", dir=parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)  # mkdtemp makes it 0700; the result is an ordinary directory
    try:
        yield tmp
        if os.path.lexists(target):
            if not force:
                raise ConversionError(f"output {target} appeared during the conversion; not replacing it without --force")
            old = tempfile.mkdtemp(prefix=f".{base}.old-", dir=parent)
            os.rmdir(old)
            os.rename(target, old)
            os.rename(tmp, target)
            if os.path.isdir(old) and not os.path.islink(old):
                shutil.rmtree(old, ignore_errors=True)
            else:
                os.unlink(old)
        else:
            os.rename(tmp, target)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


# Files of an HF model directory that are weights or the model config (everything else at the
# top level -- tokenizer, chat template, generation config, README -- travels along).
_WEIGHT_FILE = re.compile(r".*\.(safetensors|bin|pt|pth|ckpt|h5|msgpack|gguf|distcp)$|.*\.index\.json$")


def copy_side_files(src_dir: str, dst_dir: str, skip: Iterable[str] = ()) -> list[str]:
    """Copy tokenizer & co. (every top-level regular file that is not weights or in ``skip``)."""
    skip = set(skip)
    copied = []
    for name in sorted(os.listdir(src_dir)):
        p = os.path.join(src_dir, name)
        if not os.path.isfile(p) or name in skip or name.startswith(".") or _WEIGHT_FILE.fullmatch(name):
            continue
        shutil.copy2(p, os.path.join(dst_dir, name))
        copied.append(name)
    return copied


def read_json(path: str, what: str) -> dict:
    if not os.path.isfile(path):
        raise ConversionError(f"{what} not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ConversionError(f"{path}: invalid JSON ({e})") from None


def write_json(path: str, obj: Any) -> None:
    with open(path, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")


# ----------------------------------------------------------------------------------------------
# safetensors: header parsing, lazy positioned reads, streaming shard writer
# ----------------------------------------------------------------------------------------------

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


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape) if shape else 1


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
        nbytes = _numel(shape) * torch.empty((), dtype=dt).element_size()
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


def validate_hf_tensors(mapping: ModelMapping, have: dict[str, STEntry], where: str) -> None:
    """Every expected HF tensor present with the right shape, and nothing unexpected."""
    want = mapping.hf_shapes()
    for name, shape in want.items():
        if name in have and tuple(have[name].shape) != tuple(shape):
            hint = mapping.hint(name)
            raise ConversionError(
                f"{where}: tensor {name} has shape {tuple(have[name].shape)} in {have[name].file} but "
                f"the config implies {tuple(shape)}" + (f" (check {hint})" if hint else ""))
    missing = [n for n in want if n not in have]
    if missing:
        hint = mapping.hint(missing[0])
        raise ConversionError(
            f"{where}: {len(missing)} tensor(s) the config implies are missing, e.g. {missing[:3]}"
            + (f" (check {hint})" if hint else ""))
    unexpected = [n for n in have if n not in want]
    if unexpected:
        hint = mapping.hint(unexpected[0])
        raise ConversionError(
            f"{where}: {len(unexpected)} unexpected tensor(s) not described by the config, e.g. "
            f"{unexpected[:3]} (shape {tuple(have[unexpected[0]].shape)})" + (f" (check {hint})" if hint else ""))
    for name, e in have.items():
        if not e.dtype.is_floating_point:
            raise ConversionError(f"{where}: tensor {name} has non-float dtype {e.dtype}")


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
            n = _numel(shape) * torch.empty((), dtype=dt).element_size()
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


# ----------------------------------------------------------------------------------------------
# megatron dist_checkpointing (torch_dist) on disk
# ----------------------------------------------------------------------------------------------

# What megatron.core.dist_checkpointing.save writes as metadata.json for the torch_dist backend.
MCORE_METADATA = {"sharded_backend": "torch_dist", "sharded_backend_version": 1,
                  "common_backend": "torch", "common_backend_version": 1}


def _sharded_object_payload() -> io.BytesIO:
    # megatron serializes the ShardedObjects of one key on one rank as torch.save([obj.data ...]);
    # a layer without FP8 state has data None (local spec) and TE accepts None as "no state".
    b = io.BytesIO()
    torch.save([None], b)
    b.seek(0)
    return b


class DistCheckpointWriter:
    """Stream a torch_dist checkpoint: ``plan(groups)`` fixes every chunk up front (the global
    metadata), then ``write_group`` writes one group's chunks to its own ``__<g>_0.distcp`` file,
    computing each chunk only when the writer asks for it."""

    def __init__(self, path: str):
        from torch.distributed.checkpoint import FileSystemWriter

        self.path = path
        self.writer = FileSystemWriter(path, single_file_per_rank=True, sync_files=True,
                                       thread_count=1, overwrite=False)
        self.writer.set_up_storage_writer(True, rank=0, use_collectives=True)
        self.results: list = []
        self.plans: list = []
        self.state_md: dict = {}

    def plan(self, groups: list[list[tuple[str, Any]]]) -> None:
        """``groups``: per group, a list of (fqn, spec) where spec is either
        ``(global_shape, offsets, sizes, dtype)`` for a tensor chunk or ``None`` for a bytes object."""
        from torch.distributed.checkpoint.metadata import (BytesStorageMetadata, ChunkStorageMetadata,
                                                           MetadataIndex, TensorProperties,
                                                           TensorStorageMetadata)
        from torch.distributed.checkpoint.planner import (SavePlan, TensorWriteData, WriteItem,
                                                          WriteItemType)

        plans = []
        for items in groups:
            witems = []
            for fqn, spec in items:
                if spec is None:
                    if fqn in self.state_md:
                        raise ConversionError(f"internal error: object {fqn} planned twice")
                    self.state_md[fqn] = BytesStorageMetadata()
                    witems.append(WriteItem(index=MetadataIndex(fqn), type=WriteItemType.BYTE_IO))
                    continue
                gshape, offsets, sizes, dtype = spec
                props = TensorProperties(dtype=dtype)
                md = self.state_md.setdefault(fqn, TensorStorageMetadata(props, torch.Size(gshape), []))
                if tuple(md.size) != tuple(gshape) or md.properties.dtype != dtype:
                    raise ConversionError(f"internal error: {fqn} planned with two shapes/dtypes")
                chunk = ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))
                md.chunks.append(chunk)
                witems.append(WriteItem(
                    index=MetadataIndex(fqn, torch.Size(offsets), len(md.chunks) - 1),
                    type=WriteItemType.SHARD,
                    tensor_data=TensorWriteData(chunk=chunk, properties=props, size=torch.Size(gshape))))
            plans.append(SavePlan(items=witems))
        # every chunk of every tensor must tile its global shape exactly once
        for fqn, md in self.state_md.items():
            if hasattr(md, "chunks"):
                vol = sum(_numel(c.sizes) for c in md.chunks)
                if vol != _numel(md.size):
                    raise ConversionError(f"internal error: chunks of {fqn} cover {vol} of {_numel(md.size)} elements")
        self.writer.prepare_local_plan(SavePlan(items=[]))  # creates the dir, refuses an existing checkpoint
        self.plans = self.writer.prepare_global_plan(plans)  # one file prefix per group: __<g>_

    def write_group(self, g: int, produce: Callable[[Any], Any]) -> None:
        """Write group ``g``; ``produce(MetadataIndex)`` returns the chunk tensor (shape = sizes)
        or, for objects, None to write megatron's empty-extra-state payload."""
        planner = _LazySavePlanner(produce)
        fut = self.writer.write_data(self.plans[g], planner)
        fut.wait()
        self.results.append(fut.value())

    def finish(self) -> None:
        from torch.distributed.checkpoint.metadata import Metadata

        self.writer.finish(Metadata(state_dict_metadata=self.state_md), self.results)
        write_json(os.path.join(self.path, "metadata.json"), MCORE_METADATA)
        torch.save({}, os.path.join(self.path, "common.pt"))


class _LazySavePlanner(SavePlanner):
    """Only the part of the SavePlanner protocol FileSystemWriter.write_data uses."""

    def __init__(self, produce: Callable[[Any], Any]):
        self.produce = produce

    def set_up_planner(self, *a, **k):  # pragma: no cover - protocol stub
        raise NotImplementedError

    def create_local_plan(self):  # pragma: no cover
        raise NotImplementedError

    def create_global_plan(self, all_plans):  # pragma: no cover
        raise NotImplementedError

    def finish_plan(self, new_plan):  # pragma: no cover
        raise NotImplementedError

    def resolve_data(self, write_item):
        from torch.distributed.checkpoint.planner import WriteItemType

        if write_item.type == WriteItemType.BYTE_IO:
            obj = self.produce(write_item.index)
            return obj if obj is not None else _sharded_object_payload()
        t = self.produce(write_item.index)
        want = tuple(write_item.tensor_data.chunk.sizes)
        if tuple(t.shape) != want or t.dtype != write_item.tensor_data.properties.dtype:
            raise ConversionError(f"internal error: {write_item.index.fqn} chunk {tuple(t.shape)} {t.dtype}, "
                                  f"planned {want} {write_item.tensor_data.properties.dtype}")
        return t.contiguous()


class _RegionLoadPlanner(LoadPlanner):
    """Copies every ReadItem into the matching sub-block of one destination tensor."""

    def __init__(self, out: torch.Tensor):
        self.out = out
        self.filled = 0

    def set_up_planner(self, *a, **k):  # pragma: no cover - protocol stub
        raise NotImplementedError

    def create_local_plan(self):  # pragma: no cover
        raise NotImplementedError

    def create_global_plan(self, global_plan):  # pragma: no cover
        raise NotImplementedError

    def finish_plan(self, central_plan):  # pragma: no cover
        raise NotImplementedError

    def load_bytes(self, read_item, value):  # pragma: no cover - only tensors are requested
        raise NotImplementedError

    def resolve_tensor(self, read_item):
        t = self.out
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, read_item, tensor):
        self.filled += _numel(read_item.lengths)


class DistCheckpointReader:
    """Lazy region reads from a torch_dist checkpoint written under any TP/EP layout."""

    def __init__(self, path: str):
        from torch.distributed.checkpoint import FileSystemReader

        self.path = path
        if not os.path.isdir(path):
            raise ConversionError(f"checkpoint directory not found: {path}")
        mj = os.path.join(path, "metadata.json")
        if not os.path.isfile(mj):
            raise ConversionError(f"{path}: not a megatron dist_checkpointing checkpoint (no metadata.json)")
        backend = read_json(mj, "metadata.json").get("sharded_backend")
        if backend != "torch_dist":
            raise ConversionError(f"{mj}: sharded_backend={backend!r}; only 'torch_dist' is supported")
        if not os.path.isfile(os.path.join(path, ".metadata")):
            raise ConversionError(f"{path}: torch_dist checkpoint without its .metadata file")
        self.reader = FileSystemReader(path)
        try:
            self.md = self.reader.read_metadata()
        except Exception as e:
            raise ConversionError(f"{os.path.join(path, '.metadata')}: unreadable ({type(e).__name__}: {e})") from e
        self.reader.set_up_storage_reader(self.md, True)
        self.tensors = {k: v for k, v in self.md.state_dict_metadata.items() if hasattr(v, "chunks")}
        self._by_lead: dict[str, tuple[int, dict]] = {}

    def validate_storage(self, fqns: Iterable[str]) -> None:
        """Every stored chunk of ``fqns`` lies inside an existing file (missing / truncated .distcp)."""
        fqns = set(fqns)
        sizes: dict[str, int] = {}
        for idx, info in self.md.storage_data.items():
            if idx.fqn not in fqns:
                continue
            p = os.path.join(self.path, info.relative_path)
            if p not in sizes:
                if not os.path.isfile(p):
                    raise ConversionError(f"checkpoint file missing: {p} (holds {idx.fqn})")
                sizes[p] = os.path.getsize(p)
            if info.offset + info.length > sizes[p]:
                raise ConversionError(
                    f"checkpoint file truncated: {p} has {sizes[p]} bytes but {idx.fqn} is stored at "
                    f"bytes {info.offset}..{info.offset + info.length}")
        for fqn in fqns:
            md = self.tensors[fqn]
            vol = sum(_numel(c.sizes) for c in md.chunks)
            if vol < _numel(md.size):
                raise ConversionError(f"{self.path}: tensor {fqn} is only partly stored ({vol} of {_numel(md.size)} elements)")

    def _candidates(self, fqn: str, offsets: Sequence[int], sizes: Sequence[int]):
        """The tensor's metadata narrowed to the stored chunks that can overlap a request.

        megatron stores stacked tensors as chunks of size 1 on the layer / expert axes; indexing
        them by those leading offsets keeps a (layer, expert) read from scanning every chunk of the
        model (12k chunks per expert tensor for 48 layers x 128 experts)."""
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        md = self.tensors[fqn]
        if fqn not in self._by_lead:
            k = 0
            while k < len(md.size) - 1 and all(c.sizes[k] == 1 for c in md.chunks):
                k += 1
            table: dict[tuple, list] = {}
            for c in md.chunks:
                table.setdefault(tuple(c.offsets[:k]), []).append(c)
            self._by_lead[fqn] = (k, table)
        k, table = self._by_lead[fqn]
        if k == 0 or any(n != 1 for n in sizes[:k]):
            return md
        return TensorStorageMetadata(md.properties, md.size, table.get(tuple(offsets[:k]), []))

    def read(self, fqn: str, offsets: Sequence[int], sizes: Sequence[int]) -> torch.Tensor:
        from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
        from torch.distributed.checkpoint.planner import LoadPlan
        from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

        md = self._candidates(fqn, offsets, sizes)
        out = torch.empty(tuple(sizes), dtype=md.properties.dtype)
        items = create_read_items_for_chunk_list(
            fqn, md, [ChunkStorageMetadata(offsets=torch.Size(offsets), sizes=torch.Size(sizes))])
        planner = _RegionLoadPlanner(out)
        try:
            self.reader.read_data(LoadPlan(items), planner).wait()
        except ConversionError:
            raise
        except Exception as e:
            raise ConversionError(f"{self.path}: reading {fqn} at {tuple(offsets)} failed: {type(e).__name__}: {e}") from e
        if planner.filled != out.numel():
            raise ConversionError(f"{self.path}: {fqn} region {tuple(offsets)}+{tuple(sizes)} is only partly stored")
        return out
