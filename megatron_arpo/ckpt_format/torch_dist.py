"""The ``torch_dist`` checkpoint format as the actor and the converter both read it, without Megatron.

A ``torch_dist`` checkpoint is a torch.distributed.checkpoint (DCP) directory: Megatron's
``metadata.json``, DCP's ``.metadata`` (every saved chunk of every tensor and where its bytes are) and
``.distcp`` files of ``torch.save`` records. Here: finding the directory (`resolve_checkpoint_dir`),
reading ``.metadata`` through the allow-listed unpicklers (`read_dcp_metadata`, ``dcp_pickles``), and
the CRC-32 check of one record (`check_record`; torch.load checks none). The offline reader that
streams tensors (``conversion.dcp_read``) and the actor's resume (``megatron_arpo.actor.checkpoint``)
stand on it.
"""

from __future__ import annotations

import io
import os
import struct
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from megatron_arpo.ckpt_format import dcp_pickles
from megatron_arpo.hf.checkpoint_io import dtype_name

MEGATRON_METADATA = "metadata.json"
DCP_METADATA = ".metadata"


class _FileView(io.RawIOBase):
    """The byte range ``[offset, offset + length)`` of an open file; ``readinto`` lets torch.load read
    a storage directly into its buffer (no intermediate ``bytes``)."""

    def __init__(self, fh, offset: int, length: int):
        super().__init__()
        self._fh, self._start, self._len, self._pos = fh, offset, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._pos

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        base = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._len}[whence]
        self._pos = min(max(base + pos, 0), self._len)
        return self._pos

    def readinto(self, buffer) -> int:
        view = memoryview(buffer).cast("B")
        size = min(len(view), self._len - self._pos)
        if size <= 0:
            return 0
        got = os.preadv(self._fh.fileno(), [view[:size]], self._start + self._pos)
        self._pos += got
        return got


# Bytes read per CRC / finiteness step of a record check (cache-sized, as conversion.torch_record.BLOCK).
CHECK_BLOCK = 256 << 10
# Float dtypes: (unsigned view, exponent mask). A value is NaN or Inf when all its exponent bits are set.
_EXPONENT = {"float32": ("<u4", 0x7F800000), "bfloat16": ("<u2", 0x7F80), "float16": ("<u2", 0x7C00),
             "float64": ("<u8", 0x7FF0000000000000)}


class CorruptRecordError(ValueError):
    """A ``torch.save`` record whose bytes do not match the CRC-32 its zip directory holds."""


def check_record(view, where: str, dtype: str | None = None) -> int:
    """Check the CRC-32 of every entry of the ``torch.save`` zip record ``view`` (a seekable view of it).

    torch.load checks none of them, so a flipped byte in a ``.distcp`` loads as a changed weight. Stored
    entries are checksummed here block by block (``zlib.crc32``); compressed ones by ``zipfile``. Returns
    the number of non-finite values in the record's tensor data when ``dtype`` is a float type.
    """
    try:
        archive = zipfile.ZipFile(view)
        infos = archive.infolist()
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
        raise CorruptRecordError(f"{where}: not a readable torch.save record ({exc})") from exc
    pattern = _EXPONENT.get(dtype or "")
    buffer = bytearray(CHECK_BLOCK)
    nonfinite = 0
    for info in infos:
        if info.compress_type != zipfile.ZIP_STORED:
            try:
                archive.read(info)  # zipfile checks the CRC of what it inflates
            except (zipfile.BadZipFile, OSError, EOFError, ValueError) as exc:
                raise CorruptRecordError(f"{where}: entry {info.filename}: {exc}") from exc
            continue
        view.seek(info.header_offset)
        header = view.read(30)
        if len(header) != 30 or header[:4] != b"PK\x03\x04":
            raise CorruptRecordError(f"{where}: entry {info.filename}: no local header at its offset")
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        view.seek(info.header_offset + 30 + name_len + extra_len)
        is_data = pattern is not None and "/data/" in info.filename and "/.data/" not in info.filename
        crc, left = 0, info.file_size
        while left:
            got = view.readinto(memoryview(buffer)[:min(left, CHECK_BLOCK)])
            if not got:
                raise CorruptRecordError(f"{where}: entry {info.filename} is cut short ({left} bytes missing)")
            block = memoryview(buffer)[:got]
            crc = zlib.crc32(block, crc)
            if is_data:
                width = np.dtype(pattern[0]).itemsize
                values = np.frombuffer(block[:got - got % width], dtype=pattern[0])
                nonfinite += int(np.count_nonzero((values & pattern[1]) == pattern[1]))
            left -= got
        if crc != info.CRC:
            raise CorruptRecordError(f"{where}: entry {info.filename} fails its CRC-32 check (stored {info.CRC:08x}, "
                                     f"computed {crc:08x})")
    return nonfinite


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # torch's name: "bfloat16"
    size: tuple[int, ...]
    chunks: tuple[tuple[tuple[int, ...], tuple[int, ...]], ...]  # (global offsets, sizes) of each saved chunk


def _tensor_infos(metadata, is_tensor) -> dict[str, TensorInfo]:
    return {key: TensorInfo(dtype_name(md.properties.dtype), tuple(md.size),
                            tuple((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks))
            for key, md in metadata.state_dict_metadata.items() if is_tensor(md)}


def read_dcp_metadata(path: Path) -> tuple[dict[str, TensorInfo], dict]:
    """``(tensors, storage)`` of a ``.metadata`` file; storage is {(key, chunk offsets): where its bytes are}."""
    try:
        with open(path, "rb") as fh:
            metadata = dcp_pickles.load_metadata(fh)
        tensors = _tensor_infos(metadata, lambda md: type(md).__name__ == "TensorStorageMetadata")
    except dcp_pickles.UnknownTorchName:  # another torch version's layout: torch's classes, still allow-listed
        from torch.distributed.checkpoint.metadata import TensorStorageMetadata

        with open(path, "rb") as fh:
            metadata = dcp_pickles.load_torch_metadata(fh)
        tensors = _tensor_infos(metadata, lambda md: isinstance(md, TensorStorageMetadata))
    storage = {(index.fqn, tuple(index.offset or ())): info for index, info in metadata.storage_data.items()}
    return tensors, storage


def resolve_checkpoint_dir(path: str | os.PathLike) -> Path:
    """The directory holding Megatron's ``metadata.json`` (see the module docstring for the search order)."""
    root = Path(path)
    candidates = [root, root / "model"]
    latest = root / "latest_checkpointed_iteration.txt"
    if latest.exists():
        text = latest.read_text().strip()
        if text.isdigit():
            iter_dir = root / f"iter_{int(text):07d}"
            candidates += [iter_dir, iter_dir / "model"]
    for cand in candidates:
        if (cand / MEGATRON_METADATA).exists():
            return cand
    raise FileNotFoundError(
        f"no Megatron distributed checkpoint under {root}: looked for {MEGATRON_METADATA} in "
        f"{[str(c) for c in candidates]}")
