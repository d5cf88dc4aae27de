"""Offline reader of Megatron ``torch_dist`` checkpoints: torch.distributed.checkpoint files, no Megatron.

``megatron-to-hf`` needs no process group and no Megatron module: a ``torch_dist`` checkpoint is a
torch.distributed.checkpoint (DCP) directory whose ``.metadata`` lists every saved chunk of every tensor
(global offsets and sizes) and where its bytes are (file, offset, length; each chunk is one
``torch.save`` record). :class:`DistCheckpointReader` reads that metadata once, checks every ``.distcp``
file against it up front (a truncated copy is reported naming the file, before anything is written),
and answers two questions:

- :meth:`DistCheckpointReader.row_chunks`: where the rows of a tensor (of one layer of it) lie in the
  files, when every chunk spans whole rows and stores them plainly (each chunk is a ``torch.save`` zip
  whose data record is the row-major, uncompressed tensor: its offset comes from the zip's local header,
  its dtype/shape/strides from the chunk's ``data.pkl``). The converter then copies byte ranges file to
  file.
- :meth:`DistCheckpointReader.read`: any rectangular region of a tensor, by loading the chunks that
  intersect it. When one saved chunk is exactly the region, the loaded chunk is returned as is (one copy
  of the tensor in memory, read straight into its storage); otherwise the region is allocated once and
  each intersecting chunk is loaded and copied in, one chunk at a time.

Compared with Megatron's ``TorchDistLoadShardedStrategy`` (what this replaced) there is no per-call
metadata re-read, no planner and no collective. Neither Megatron nor torch is imported until a tensor
must be built in memory: the pickles are read by :mod:`megatron_arpo.ckpt_format.dcp_pickles`, the
records checked by :mod:`megatron_arpo.ckpt_format.torch_dist`.
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import zipfile
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_arpo.ckpt_format import dcp_pickles
from megatron_arpo.ckpt_format.torch_dist import (DCP_METADATA, MEGATRON_METADATA, CorruptRecordError, _FileView,
                                                 check_record, read_dcp_metadata)
from megatron_arpo.hf.checkpoint_io import ELEMENT_SIZES

if TYPE_CHECKING:
    import torch

SUPPORTED_BACKEND = "torch_dist"


@dataclass(frozen=True)
class RowChunk:
    """Rows ``[row, row + rows)`` of a tensor (of one layer of it) stored back to back at ``offset`` in a file."""

    fd: int
    path: Path
    row: int
    rows: int
    offset: int
    row_bytes: int



def check_megatron_metadata(ckpt: Path) -> None:
    """``metadata.json`` must parse and name the ``torch_dist`` backend (the only one read here)."""
    path = ckpt / MEGATRON_METADATA
    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{path}: not readable JSON ({exc}); the checkpoint is corrupt or was copied "
                         f"incompletely, copy it again") from exc
    backend = data.get("sharded_backend") if isinstance(data, dict) else None
    if backend != SUPPORTED_BACKEND:
        raise ValueError(f"{path}: sharded_backend is {backend!r}; only {SUPPORTED_BACKEND!r} checkpoints can be "
                         f"converted (save with Megatron's torch_dist format)")


class DistCheckpointReader:
    """Regions of the tensors of one DCP checkpoint directory, read lazily from its ``.distcp`` files."""

    def __init__(self, ckpt: str | os.PathLike, allow_nonfinite: bool = False):
        self.dir = Path(ckpt)
        self.allow_nonfinite = allow_nonfinite
        self._checked: set[tuple[str, tuple[int, ...]]] = set()
        self._checker: ThreadPoolExecutor | None = None
        self._pending: list[Future] = []
        meta_path = self.dir / DCP_METADATA
        if not meta_path.exists():
            raise FileNotFoundError(f"{meta_path} not found: {self.dir} is not a complete torch_dist checkpoint "
                                    f"(interrupted save or copy?)")
        try:
            self.tensors, self._storage = read_dcp_metadata(meta_path)
        except dcp_pickles.ForeignPickleError as exc:
            raise ValueError(f"{meta_path}: {str(exc).removeprefix(f'{meta_path}: ')}; not converted (a checkpoint "
                             f"pickle may name only torch's checkpoint classes)") from None
        except Exception as exc:  # pickle raises many types on a damaged file
            raise ValueError(f"{meta_path}: cannot be read ({type(exc).__name__}: {exc}); the checkpoint is corrupt "
                             f"or was copied incompletely, copy it again") from exc
        self._check_files()
        self._handles: dict[str, object] = {}
        self._layouts: dict[tuple[str, tuple[int, ...]], int | None] = {}

    def _check_files(self) -> None:
        ends: dict[str, int] = {}
        for info in self._storage.values():
            ends[info.relative_path] = max(ends.get(info.relative_path, 0), info.offset + info.length)
        for name, end in sorted(ends.items()):
            path = self.dir / name
            if not path.exists():
                raise FileNotFoundError(f"{path}: listed in {self.dir / DCP_METADATA} but missing; the checkpoint "
                                        f"is incomplete, copy it again")
            size = path.stat().st_size
            if size < end:
                raise ValueError(f"{path}: truncated .distcp shard ({size} bytes, the checkpoint's {DCP_METADATA} "
                                 f"needs {end}); the checkpoint was copied or saved incompletely, copy it again")

    def shape(self, key: str) -> tuple[int, ...]:
        return self.tensors[key].size

    def dtype(self, key: str) -> str:
        return self.tensors[key].dtype

    def check_chunk(self, key: str, offsets: tuple[int, ...], background: bool = False) -> None:
        """The chunk's record passes its CRC checks and (unless ``allow_nonfinite``) holds no NaN/Inf; once per
        chunk. ``background``: in the reader's check thread (``zlib.crc32`` and numpy release the GIL, so it
        overlaps the byte copies); :meth:`finish_checks` waits for it and raises its first error."""
        if (key, offsets) in self._checked:
            return
        self._checked.add((key, offsets))
        info = self._storage[(key, offsets)]
        handle = self._handle(info.relative_path)
        if not background:
            self._check_now(key, offsets, info, handle)
            return
        if self._checker is None:
            self._checker = ThreadPoolExecutor(1, thread_name_prefix="record-check")
        self._pending.append(self._checker.submit(self._check_now, key, offsets, info, handle))

    def finish_checks(self) -> None:
        """Wait for the background checks; the first failure is raised."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def _check_now(self, key: str, offsets: tuple[int, ...], info, handle) -> None:
        path = self.dir / info.relative_path
        where = f"{path}: {key} at offset {list(offsets)} (bytes {info.offset}..{info.offset + info.length})"
        view = _FileView(handle, info.offset, info.length)
        try:
            nonfinite = check_record(view, where, None if self.allow_nonfinite else self.tensors[key].dtype)
        except CorruptRecordError as exc:
            raise CorruptRecordError(f"{exc}; the shard is corrupt, copy the checkpoint again") from None
        if nonfinite:
            raise ValueError(f"{where}: {nonfinite} non-finite value(s) (NaN or Inf); the weights are damaged or "
                             f"diverged. Convert an earlier checkpoint, or pass --allow-nonfinite to convert as is")

    def _load_chunk(self, key: str, offsets: tuple[int, ...]) -> torch.Tensor:
        # deferred: pulls in torch (heavy; this module imports without it)
        import torch

        info = self._storage[(key, offsets)]
        path = self.dir / info.relative_path
        self.check_chunk(key, offsets)
        if getattr(info, "transform_descriptors", None):
            raise ValueError(f"{path}: {key} is stored with transforms {list(info.transform_descriptors)} "
                             f"(compression?); only plain torch_dist checkpoints can be converted")
        try:
            return torch.load(_FileView(self._handle(info.relative_path), info.offset, info.length),
                              map_location="cpu", weights_only=True)
        except Exception as exc:
            raise ValueError(f"{path}: cannot read {key} at offset {list(offsets)} (bytes {info.offset}.."
                             f"{info.offset + info.length}: {type(exc).__name__}: {exc}); the shard is corrupt, "
                             f"copy the checkpoint again") from exc

    def read(self, key: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The region ``[offsets, offsets + sizes)`` of tensor ``key`` (global coordinates)."""
        # deferred: pulls in torch (heavy; this module imports without it)
        import torch

        info = self.tensors[key]
        offsets, sizes = tuple(offsets), tuple(sizes)
        region_end = [o + s for o, s in zip(offsets, sizes)]
        hits = []
        for chunk_offsets, chunk_sizes in info.chunks:
            lo = [max(a, b) for a, b in zip(offsets, chunk_offsets)]
            hi = [min(a, b + c) for a, b, c in zip(region_end, chunk_offsets, chunk_sizes)]
            if all(h > low for low, h in zip(lo, hi)):
                hits.append((chunk_offsets, lo, hi))
        if len(hits) == 1 and (offsets, sizes) in info.chunks:  # one chunk is exactly the region
            return self._load_chunk(key, offsets)
        out = torch.empty(sizes, dtype=getattr(torch, info.dtype))
        covered = 0
        for chunk_offsets, lo, hi in hits:
            data = self._load_chunk(key, chunk_offsets)
            src, dst = data, out
            for dim, (low, high) in enumerate(zip(lo, hi)):
                src = src.narrow(dim, low - chunk_offsets[dim], high - low)
                dst = dst.narrow(dim, low - offsets[dim], high - low)
            dst.copy_(src)
            covered += dst.numel()
            del data, src
        if covered != out.numel():
            raise ValueError(f"{self.dir}: the saved chunks of {key} cover {covered} of the {out.numel()} elements "
                             f"at offset {list(offsets)} size {list(sizes)}; the checkpoint is incomplete")
        return out

    def _handle(self, relative_path: str):
        handle = self._handles.get(relative_path)
        if handle is None:
            handle = self._handles[relative_path] = open(self.dir / relative_path, "rb")
        return handle

    def _stored_bytes(self, key: str, offsets: tuple[int, ...]) -> int | None:
        """File offset of a chunk's raw tensor bytes, if they are stored plainly (row-major, uncompressed).

        The chunk is a ``torch.save`` zip: ``data.pkl`` says which storage record holds the tensor and
        how (:func:`megatron_arpo.ckpt_format.dcp_pickles.load_chunk_recipe`), the zip's local header where that
        record's bytes start.
        """
        info = self._storage[(key, offsets)]
        if getattr(info, "transform_descriptors", None):
            return None
        view = _FileView(self._handle(info.relative_path), info.offset, info.length)
        try:
            archive = zipfile.ZipFile(view)
            pickles = [i for i in archive.infolist() if i.filename.endswith("/data.pkl")]
            if len(pickles) != 1:
                return None
            recipe = dcp_pickles.load_chunk_recipe(archive.read(pickles[0]))
            record = archive.getinfo(pickles[0].filename[: -len("data.pkl")] + f"data/{recipe.key}")
        except dcp_pickles.ForeignPickleError as exc:
            raise ValueError(f"{self.dir / info.relative_path}: {key}: {exc}") from exc
        except (zipfile.BadZipFile, KeyError, pickle.UnpicklingError, EOFError, ValueError, TypeError):
            return None  # read it through torch.load instead, which names what is wrong
        element = ELEMENT_SIZES.get(recipe.dtype)
        if recipe.dtype != self.tensors[key].dtype or not recipe.is_plain or element is None \
                or record.compress_type != zipfile.ZIP_STORED or record.file_size != recipe.storage_numel * element:
            return None
        view.seek(record.header_offset)
        header = view.read(30)
        if header[:4] != b"PK\x03\x04":
            return None
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        return info.offset + record.header_offset + 30 + name_len + extra_len

    def row_chunks(self, key: str, layer: int | tuple[int, ...] | None) -> list[RowChunk] | None:
        """Where the rows of ``key`` (of one layer of it, or one (layer, expert)) are on disk, or None if not
        as whole rows.

        ``layer``: None for an unstacked tensor, the layer index, or the indices on the leading stacked axes
        (``(layer, expert)`` for MoE experts). Every saved chunk holding rows of the tensor must span all
        its other dimensions (true of converted checkpoints and of column-parallel TP splits; a row-parallel
        split stores half rows) and be stored plainly; the chunks must cover every row.
        """
        index = () if layer is None else (layer,) if isinstance(layer, int) else tuple(layer)
        info = self.tensors[key]
        shape, lead = info.size, len(index)
        if len(shape) <= lead:
            return None
        row_bytes = ELEMENT_SIZES[info.dtype]
        for size in shape[lead + 1:]:
            row_bytes *= size
        out, covered = [], 0
        for offsets, sizes in info.chunks:
            if not all(offsets[i] <= index[i] < offsets[i] + sizes[i] for i in range(lead)):
                continue
            if offsets[lead + 1:] != (0,) * (len(shape) - lead - 1) or sizes[lead + 1:] != shape[lead + 1:]:
                return None
            start = self._layouts.get((key, offsets), -1)
            if start == -1:
                start = self._layouts[(key, offsets)] = self._stored_bytes(key, offsets)
            if start is None:
                return None
            self.check_chunk(key, offsets, background=True)  # copied unseen: checked before the output is kept
            position = 0  # which [rows, ...] block of the chunk: row-major over its leading axes
            for i in range(lead):
                position = position * sizes[i] + index[i] - offsets[i]
            start += position * sizes[lead] * row_bytes
            where = self._storage[(key, offsets)]
            out.append(RowChunk(self._handle(where.relative_path).fileno(), self.dir / where.relative_path,
                                offsets[lead], sizes[lead], start, row_bytes))
            covered += sizes[lead]
        return sorted(out, key=lambda c: c.row) if covered == shape[lead] else None

    def close(self) -> None:
        if self._checker is not None:
            self._checker.shutdown(wait=True, cancel_futures=True)
            self._checker = None
        for handle in self._handles.values():
            handle.close()
        self._handles = {}
