"""megatron dist_checkpointing's torch_dist format on disk, without megatron and without a process
group: a writer that streams one tensor group (embedding, a layer, the final tensors) at a time, and
a reader of any (layer, expert) region of a checkpoint written under any TP/EP layout.

Memory: neither direction holds more than one group.
- the checkpoint is written with torch.distributed.checkpoint's FileSystemWriter, one
  ``write_data`` call per tensor group, each group producing its tensors lazily in
  ``SavePlanner.resolve_data``; the global ``.metadata`` describes every stacked tensor as
  per-layer / per-(layer, expert) chunks with global offsets, as megatron's own save does;
- it is read with FileSystemReader and a per-region LoadPlan, so only the stored chunks that
  overlap the requested (layer, expert) region are loaded, whatever TP/EP layout wrote them.
"""

from __future__ import annotations

import io
import math
import os
from typing import Any, Callable, Iterable, Sequence

import torch
from torch.distributed.checkpoint.planner import LoadPlanner, SavePlanner

from checkpoints_tools.errors import ConversionError
from checkpoints_tools.files import read_json, write_json

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
                vol = sum(math.prod(c.sizes) for c in md.chunks)
                if vol != math.prod(md.size):
                    raise ConversionError(f"internal error: chunks of {fqn} cover {vol} of {math.prod(md.size)} elements")
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


class _NoPlanning:
    """The planning half of torch's Save/LoadPlanner protocol, which the converters never run.

    torch.distributed.checkpoint's save / load plan across ranks and then move data; here the plan
    is made once, up front, by this module (one process, no process group), and only the data half
    (``write_data`` / ``read_data`` calling ``resolve_*`` / ``commit_tensor``) is used. Listed
    before the torch base class (SavePlanner is an ABC that requires them), these fail loudly if
    torch ever calls them."""

    def set_up_planner(self, *a, **k):  # pragma: no cover - never called, see above
        raise NotImplementedError

    def create_local_plan(self):  # pragma: no cover
        raise NotImplementedError

    def create_global_plan(self, all_plans):  # pragma: no cover
        raise NotImplementedError

    def finish_plan(self, new_plan):  # pragma: no cover
        raise NotImplementedError


class _LazySavePlanner(_NoPlanning, SavePlanner):
    """Hands FileSystemWriter.write_data each chunk, produced only when it is written."""

    def __init__(self, produce: Callable[[Any], Any]):
        self.produce = produce

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


class _RegionLoadPlanner(_NoPlanning, LoadPlanner):
    """Copies every ReadItem into the matching sub-block of one destination tensor."""

    def __init__(self, out: torch.Tensor):
        self.out = out
        self.filled = 0

    def load_bytes(self, read_item, value):  # pragma: no cover - only tensors are requested
        raise NotImplementedError

    def resolve_tensor(self, read_item):
        t = self.out
        for d, (o, n) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            t = t.narrow(d, o, n)
        return t

    def commit_tensor(self, read_item, tensor):
        self.filled += math.prod(read_item.lengths)


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
        from megatron_gspo.checkpoint.torch_dist_files import read_dcp_metadata
        from megatron_gspo.errors import CheckpointError

        self.reader = FileSystemReader(path)
        try:  # not FileSystemReader.read_metadata: that is pickle.load, which runs what the file says
            self.md = read_dcp_metadata(path)
        except CheckpointError as e:
            raise ConversionError(str(e)) from None
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
            vol = sum(math.prod(c.sizes) for c in md.chunks)
            if vol < math.prod(md.size):
                raise ConversionError(f"{self.path}: tensor {fqn} is only partly stored ({vol} of {math.prod(md.size)} elements)")

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
