"""Streaming Hugging Face checkpoint I/O: lazy safetensors reads, planned shard writes, atomic dirs.

- :class:`HFCheckpointReader` opens ``model.safetensors`` or the shards of
  ``model.safetensors.index.json`` with ``safe_open`` (memory-mapped) and reads a tensor, or just the
  rows/columns one tensor-parallel shard needs, on demand. Nothing is read at open time except headers;
  a truncated or corrupt file is reported naming the file.
- :class:`SafetensorsShardWriter` writes safetensors shards *without buffering a shard in memory*: the
  caller declares every output tensor (name, shape, dtype) up front, so each shard's header and every
  tensor's byte offset are known before any data arrives; tensors are then written (in any order) with
  ``os.pwrite`` at their offset, or copied straight from another file's byte range (``copy_range``:
  ``os.copy_file_range``, as ``cp`` does). Peak memory is the tensor being written, not the shard size.
  Each shard is written back as it grows and its pages dropped from the page cache
  (:class:`megatron_arpo.fsutil.WriteBehind`), so a conversion neither fills the cache with its output nor
  waits on reclaim (about 2x the speed of ``cp`` on a machine with a full page cache).
- :func:`atomic_output_dir` (re-exported from :mod:`megatron_arpo.hf.outdir`, which also guards the paths):
  output is built in a temporary sibling directory and renamed into place only when complete. No
  half-written checkpoint is ever visible at the target path.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

if TYPE_CHECKING:
    import torch

from megatron_arpo.hf.outdir import atomic_output_dir, check_output_dir, write_json  # noqa: F401  (the writers' entry points)
from megatron_arpo.fsutil import WriteBehind

logger = logging.getLogger(__name__)

SAFETENSORS_INDEX = "model.safetensors.index.json"
SAFETENSORS_SINGLE = "model.safetensors"

# dtypes by name (torch's, without "torch."): the writer and the byte-copy path run without importing torch.
_DTYPE_CODES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "int64": "I64",
                "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL"}
_DTYPE_NAMES = {code: name for name, code in _DTYPE_CODES.items()}
ELEMENT_SIZES = {"float32": 4, "float16": 2, "bfloat16": 2, "float64": 8, "int64": 8, "int32": 4, "int16": 2,
                 "int8": 1, "uint8": 1, "bool": 1}
_FLOAT_NAMES = ("float32", "float16", "bfloat16")


def torch_dtype(name: str):
    """The ``torch.dtype`` of ``"bfloat16"`` (or ``"torch.bfloat16"``); only the floating types models use."""
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch

    if name.removeprefix("torch.") not in _FLOAT_NAMES:
        raise ValueError(f"unsupported dtype {name!r}; allowed: {sorted(_FLOAT_NAMES)}")
    return getattr(torch, name.removeprefix("torch."))


def dtype_name(dtype) -> str:
    """``"bfloat16"`` for ``torch.bfloat16`` or ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


class HFCheckpointReader:
    """Lazy reader over the safetensors files of one HF checkpoint directory."""

    def __init__(self, hf_dir: str | os.PathLike):
        # deferred: pulls in safetensors (heavy; this module imports without it)
        from safetensors import safe_open

        self.dir = Path(hf_dir)
        index = self.dir / SAFETENSORS_INDEX
        single = self.dir / SAFETENSORS_SINGLE
        if index.exists():
            weight_map = _read_weight_map(index)
        elif single.exists():
            weight_map = None
        else:
            raise FileNotFoundError(
                f"{self.dir}: no {SAFETENSORS_SINGLE} or {SAFETENSORS_INDEX}; --hf must point at a Hugging "
                f"Face checkpoint saved with safetensors")
        files = sorted(set(weight_map.values())) if weight_map else [SAFETENSORS_SINGLE]
        self._handles = {}
        self._headers: dict[str, tuple[int, dict]] = {}  # file -> (data start, safetensors header)
        self._file_of: dict[str, str] = {}
        for fname in files:
            path = self.dir / fname
            if not path.exists():
                raise FileNotFoundError(f"{path}: listed in {SAFETENSORS_INDEX} but missing (incomplete download?)")
            try:  # safetensors validates the header; "numpy": torch is imported only when a tensor is read
                names = list(safe_open(str(path), framework="numpy").keys())
            except Exception as exc:  # safetensors raises its own SafetensorError
                raise ValueError(f"{path}: not a readable safetensors file ({exc}); the file is truncated or "
                                 f"corrupt, re-download or re-export it") from exc
            self._headers[fname] = _check_complete(path)
            self._paths = getattr(self, "_paths", {})
            self._paths[fname] = path
            for name in names:
                self._file_of[name] = fname
        if weight_map:
            listed_missing = [n for n, f in weight_map.items() if self._file_of.get(n) != f]
            if listed_missing:
                raise ValueError(f"{index}: {len(listed_missing)} tensor(s) listed but not in their shard, e.g. "
                                 f"{listed_missing[:5]}")

    def names(self) -> list[str]:
        return sorted(self._file_of)

    def release(self) -> None:
        """Unmap the files (reopen lazily): pages read so far stop counting toward this process's RSS."""
        self._handles = {}

    def _slice(self, name: str):
        # deferred: pulls in safetensors (heavy; this module imports without it)
        from safetensors import safe_open

        fname = self._file(name)
        handle = self._handles.get(fname)
        if handle is None:
            handle = self._handles[fname] = safe_open(str(self._paths[fname]), framework="pt")
        return handle.get_slice(name)

    def _file(self, name: str) -> str:
        fname = self._file_of.get(name)
        if fname is None:
            raise KeyError(f"{self.dir}: no tensor named {name!r}")
        return fname

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._headers[self._file(name)][1][name]["shape"])

    def locate(self, name: str) -> StoredRange:
        """Where tensor ``name``'s bytes are (row-major, as safetensors stores every tensor)."""
        fname = self._file(name)
        start, header = self._headers[fname]
        entry = header[name]
        begin, end = entry["data_offsets"]
        return StoredRange(self._paths[fname], start + begin, end - begin, _DTYPE_NAMES.get(entry["dtype"]),
                           tuple(entry["shape"]))

    def dtype(self, name: str) -> str:
        """The safetensors dtype code (``"BF16"``)."""
        return self._headers[self._file(name)][1][name]["dtype"]

    def shapes(self) -> dict[str, tuple[int, ...]]:
        return {name: self.shape(name) for name in self._file_of}

    def read(self, name: str, dim: int | None = None, start: int | None = None,
             stop: int | None = None) -> torch.Tensor:
        sl = self._slice(name)
        if dim is None:
            return sl[:]
        if dim == 0:
            return sl[start:stop]
        if dim == 1:
            return sl[:, start:stop]
        raise ValueError(f"read({name!r}): dim must be 0 or 1, got {dim}")

    __call__ = read


def _read_weight_map(index: Path) -> dict[str, str]:
    try:
        data = json.loads(index.read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{index}: not valid JSON ({exc}); the file is truncated or corrupt, re-download it "
                         f"(or delete it if the checkpoint is a single model.safetensors)") from exc
    weight_map = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
        raise ValueError(f"{index}: no \"weight_map\" object of tensor name -> shard file; re-download the index")
    return weight_map


@dataclass(frozen=True)
class StoredRange:
    path: Path
    offset: int
    nbytes: int
    dtype: str | None  # torch dtype name; None for a dtype the converters do not handle
    shape: tuple[int, ...]


def _check_complete(path: Path) -> tuple[int, dict]:
    """safe_open maps lazily; compare the header's data extent with the file size to catch truncation.

    Returns (offset of the data section, the parsed header).
    """
    try:
        with open(path, "rb") as fh:
            header_len = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(header_len))
        end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: unreadable safetensors header ({exc}); the file is corrupt, re-download or "
                         f"re-export it") from exc
    size = path.stat().st_size
    if size < 8 + header_len + end:
        raise ValueError(f"{path}: truncated safetensors file ({size} bytes, header needs {8 + header_len + end}); "
                         f"re-download or re-export it")
    return 8 + header_len, header


@dataclass(frozen=True)
class TensorSpec:
    name: str
    shape: tuple[int, ...]
    dtype: Any  # a torch.dtype or its name

    @property
    def nbytes(self) -> int:
        numel = 1
        for d in self.shape:
            numel *= d
        return numel * ELEMENT_SIZES[dtype_name(self.dtype)]


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> bytes (decimal units as transformers uses; ``GiB`` binary)."""
    if isinstance(text, int):
        return text
    units = {"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40,
             "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12, "B": 1}
    upper = text.strip().upper()
    for unit, factor in units.items():
        if upper.endswith(unit):
            try:
                return int(float(upper[: -len(unit)]) * factor)
            except ValueError:
                break
    try:
        return int(upper)
    except ValueError:
        raise ValueError(f"cannot parse size {text!r}; use e.g. 5GB, 500MB or 2GiB") from None


class SafetensorsShardWriter:
    """Write declared tensors into safetensors shards, streaming each tensor to its planned offset."""

    def __init__(self, out_dir: str | os.PathLike, specs: Sequence[TensorSpec], max_shard_bytes: int):
        self.out_dir = Path(out_dir)
        shards: list[list[TensorSpec]] = [[]]
        size = 0
        for spec in specs:
            if shards[-1] and size + spec.nbytes > max_shard_bytes:
                shards.append([])
                size = 0
            shards[-1].append(spec)
            size += spec.nbytes
        total = len(shards)
        self._where: dict[str, tuple[WriteBehind, int, TensorSpec]] = {}  # name -> (its shard, offset, spec)
        # Per shard: its file, written back and dropped from the page cache as it grows, and its final size.
        self._shards: list[tuple[WriteBehind, int]] = []
        self.weight_map: dict[str, str] = {}
        self.total_size = sum(s.nbytes for s in specs)
        for i, shard in enumerate(shards):
            fname = SAFETENSORS_SINGLE if total == 1 else f"model-{i + 1:05d}-of-{total:05d}.safetensors"
            header: dict = {"__metadata__": {"format": "pt"}}
            offset = 0
            for spec in shard:
                header[spec.name] = {"dtype": _DTYPE_CODES[dtype_name(spec.dtype)], "shape": list(spec.shape),
                                     "data_offsets": [offset, offset + spec.nbytes]}
                offset += spec.nbytes
            raw = json.dumps(header, separators=(",", ":")).encode()
            raw += b" " * (-len(raw) % 8)  # data section starts 8-byte aligned
            fd = os.open(self.out_dir / fname, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o666)
            os.pwrite(fd, len(raw).to_bytes(8, "little") + raw, 0)
            base = 8 + len(raw)
            behind = WriteBehind(fd, start=base)
            # No ftruncate to the final size here: on ext4, copies into a preallocated sparse file ran at a
            # third of the speed of appends (measured); tensors arrive in file order, so the file grows.
            self._shards.append((behind, base + offset))
            for spec in shard:
                self._where[spec.name] = (behind, base + header[spec.name]["data_offsets"][0], spec)
                self.weight_map[spec.name] = fname
        self._pending = set(self._where)
        self._copied: dict[str, int] = {}

    def write(self, name: str, tensor: torch.Tensor) -> None:
        # deferred: pulls in torch (heavy; this module imports without it)
        import torch

        try:
            behind, offset, spec = self._where[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} was not declared to the shard writer") from None
        if tuple(tensor.shape) != spec.shape or dtype_name(tensor.dtype) != dtype_name(spec.dtype):
            raise ValueError(f"{name}: expected {list(spec.shape)} {spec.dtype}, got {list(tensor.shape)} "
                             f"{tensor.dtype}")
        data = tensor.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()  # device tensors: host copy
        view = memoryview(data)
        written = 0
        while written < len(view):
            n = os.pwrite(behind.fd, view[written:written + _COPY_BLOCK], offset + written)
            behind.wrote(offset + written, n)
            written += n
        self._pending.discard(name)

    def copy_range(self, name: str, src_fd: int, src_offset: int, nbytes: int, dst_offset: int) -> None:
        """Copy ``nbytes`` of a file into tensor ``name`` at byte ``dst_offset``, in the kernel when it can.

        ``os.copy_file_range`` moves the bytes page cache to page cache, as ``cp`` does: no user-space
        buffer, no tensor. Where the kernel or filesystem refuses, a bounded pread/pwrite loop does it.
        The tensor counts as written once all its bytes have been copied.
        """
        try:
            behind, offset, spec = self._where[name]
        except KeyError:
            raise KeyError(f"tensor {name!r} was not declared to the shard writer") from None
        if dst_offset < 0 or dst_offset + nbytes > spec.nbytes:
            raise ValueError(f"{name}: bytes [{dst_offset}, {dst_offset + nbytes}) fall outside its {spec.nbytes}")
        _copy_file_range(src_fd, src_offset, behind.fd, offset + dst_offset, nbytes, behind)
        self._copied[name] = self._copied.get(name, 0) + nbytes
        if self._copied[name] == spec.nbytes:
            self._pending.discard(name)

    def close(self) -> None:
        if self._pending:
            raise ValueError(f"{len(self._pending)} declared tensor(s) never written: {sorted(self._pending)[:10]}")
        for behind, size in self._shards:
            os.ftruncate(behind.fd, size)  # a no-op unless trailing tensors were empty
            behind.finish()
            os.close(behind.fd)
        self._shards = []
        if len(set(self.weight_map.values())) > 1:
            index = {"metadata": {"total_size": self.total_size}, "weight_map": dict(sorted(self.weight_map.items()))}
            write_json(self.out_dir / SAFETENSORS_INDEX, index)

    def abort(self) -> None:
        for behind, _ in self._shards:
            os.close(behind.fd)
        self._shards = []


_COPY_BLOCK = 64 * 2**20


def _copy_file_range(src: int, src_offset: int, dst: int, dst_offset: int, nbytes: int,
                     behind: WriteBehind | None = None) -> None:
    """Copy in pieces of at most ``_COPY_BLOCK`` bytes, telling ``behind`` after each (see WriteBehind)."""
    done = 0
    use_kernel = hasattr(os, "copy_file_range")
    while done < nbytes:
        if use_kernel:
            try:
                n = os.copy_file_range(src, dst, min(_COPY_BLOCK, nbytes - done), src_offset + done,
                                       dst_offset + done)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM):
                    raise
                use_kernel = False  # e.g. across filesystems on older kernels
                continue
        else:
            data = os.pread(src, min(_COPY_BLOCK, nbytes - done), src_offset + done)
            n = len(data)
            written = 0
            while written < n:
                written += os.pwrite(dst, memoryview(data)[written:], dst_offset + done + written)
        if n == 0:
            raise ValueError(f"source file ended {nbytes - done} bytes early while copying (truncated?)")
        if behind is not None:
            behind.wrote(dst_offset + done, n)
        done += n


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "vocab.json",
                   "merges.txt", "added_tokens.json", "chat_template.jinja", "tokenizer.model")


def copy_tokenizer_files(src: str | os.PathLike, dst: Path) -> list[str]:
    copied = []
    for fname in TOKENIZER_FILES:
        path = Path(src) / fname
        if path.exists():
            shutil.copyfile(path, dst / fname)
            copied.append(fname)
    return copied
