"""Every pickle a resume reads goes through an allow-list (no code runs from a checkpoint), every record a CRC check.

Megatron's ``dist_checkpointing.load`` reads four kinds of pickle, three of them without torch's
``weights_only`` guard in torch 2.x:

- ``.metadata``: DCP's ``FileSystemReader.read_metadata`` calls ``pickle.load``. The ``pickle`` that
  ``torch.distributed.checkpoint.filesystem`` uses is replaced by
  :data:`megatron_arpo.ckpt_format.dcp_pickles.RESTRICTED_PICKLE`, whose ``load`` imports only DCP's metadata
  classes;
- byte items inside ``.distcp`` files (``ShardedObject`` s): DCP's ``DefaultLoadPlanner.load_bytes``
  calls ``torch.load(weights_only=False)``; each item is first loaded with ``weights_only=True`` and
  refused if that fails;
- ``common.pt``: :class:`WeightsOnlyCommonLoad` loads it with ``weights_only=True`` explicitly (torch's
  default can be flipped by ``TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD``);
- the ``.distcp`` tensors: DCP already passes ``weights_only=True``; each record's zip CRCs are checked
  first (:class:`_CheckedTorch`), which torch does not do.

Our own per-rank RNG file is read by :func:`load_rng_file` with ``weights_only=True`` and the numpy
names a generator state holds. A refusal raises :class:`UnsafeCheckpointError` naming the file.
"""

from __future__ import annotations

import io
import os
import pickle
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np
import torch
import torch.distributed.checkpoint.filesystem as dcp_filesystem
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

from megatron_arpo.ckpt_format import dcp_pickles
from megatron_arpo.ckpt_format.torch_dist import CorruptRecordError, _FileView, check_record


class UnsafeCheckpointError(ValueError):
    """A checkpoint pickle names something outside the allow-list; nothing of it was run."""


def _refusal(where: str, exc: Exception) -> UnsafeCheckpointError:
    # torch's message: long advice, then e.g. "Trying to load unsupported GLOBAL posix.system whose module ...".
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    reason = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), lines[0] if lines else "")
    return UnsafeCheckpointError(f"{where}: refused by torch's weights_only loader ({reason.rstrip('.')}); the "
                                 f"checkpoint was tampered with or written by other code; nothing of it was run")


_original_load_bytes = DefaultLoadPlanner.load_bytes


def _checked_load_bytes(self, read_item, value: io.BytesIO) -> None:
    try:
        torch.load(value, weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refusal(f"checkpoint object {read_item.dest_index.fqn!r}", exc) from None
    value.seek(0)
    _original_load_bytes(self, read_item, value)


class _CheckedTorch:
    """Stands in for ``torch`` inside DCP's ``filesystem`` module: its ``torch.load`` of a chunk first checks
    the CRC-32 of every entry of the record (:func:`megatron_arpo.ckpt_format.torch_dist.check_record`; torch
    checks none)."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def load(f, *args, **kwargs):
        base = getattr(f, "base_stream", None)  # DCP's view of [offset, offset + len) of an open shard file
        if base is not None and hasattr(base, "fileno") and hasattr(f, "offset") and hasattr(f, "len"):
            where = f"{getattr(base, 'name', 'a .distcp file')}: record at bytes {f.offset}..{f.offset + f.len}"
            try:
                check_record(_FileView(base, f.offset, f.len), where)
            except CorruptRecordError as exc:
                raise CorruptRecordError(f"{exc}; the checkpoint is corrupt, resume from an earlier one") from None
            f.seek(0)
        return torch.load(f, *args, **kwargs)


def install_restricted_unpickling() -> None:
    """Route DCP's metadata, byte-item and chunk loads in this process through the allow-lists and the
    record CRC check (idempotent)."""
    dcp_filesystem.pickle = dcp_pickles.RESTRICTED_PICKLE
    dcp_filesystem.torch = _CheckedTorch()
    DefaultLoadPlanner.load_bytes = _checked_load_bytes


REFUSALS = (UnsafeCheckpointError, dcp_pickles.ForeignPickleError, CorruptRecordError)


@contextmanager
def refusals_named() -> Iterator[None]:
    """DCP wraps a rank's error in a ``CheckpointException`` (a ``BaseException``) whose first line names
    only ranks, and a failed metadata read in an ``AssertionError``: a refusal above comes out as itself,
    anything else as a ``RuntimeError`` with the rank's message, so the trainer's one-line error names the file."""
    try:
        yield
    except CheckpointException as exc:
        failure = next(iter(exc.failures.values()), None)
        inner = failure[0] if isinstance(failure, tuple) else failure
        if isinstance(inner, REFUSALS):
            raise inner from None
        message = str(inner)
        if _METADATA_FAILED in message and "refusing to load" in message:  # DCP's wording, read_metadata's error
            raise dcp_pickles.ForeignPickleError(message.split(_METADATA_FAILED, 1)[1]) from None
        raise RuntimeError(f"checkpoint load failed: {type(inner).__name__}: {message}") from exc


_METADATA_FAILED = "global metadata read failed: "


def common_load_strategy():
    """Megatron's ``common.pt`` loader with ``weights_only=True`` and the file named on a refusal."""
    # megatron-core is imported here, not at the top: only the actor's processes load it.
    from megatron.core.dist_checkpointing.strategies.common import COMMON_STATE_FNAME, TorchCommonLoadStrategy

    class WeightsOnlyCommonLoad(TorchCommonLoadStrategy):
        def load_common(self, checkpoint_dir):
            path = Path(checkpoint_dir) / COMMON_STATE_FNAME
            if not path.exists():
                return super().load_common(checkpoint_dir)  # Megatron's own "does not exist" error
            return load_weights_only(path)

    return WeightsOnlyCommonLoad()


def load_weights_only(path: str | os.PathLike, safe_globals: list | None = None):
    """``torch.load(path, weights_only=True)``; a refused global raises :class:`UnsafeCheckpointError`."""
    try:
        with torch.serialization.safe_globals(safe_globals or []):
            return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        raise _refusal(str(path), exc) from None


# What numpy's legacy generator state pickles as (``np.random.get_state()``: a uint32 key array).
_NUMPY_CORE = getattr(np, "_core", None) or np.core  # numpy 2 moved numpy.core to numpy._core
_NUMPY_STATE = [_NUMPY_CORE.multiarray._reconstruct, np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def load_rng_file(path: str | os.PathLike):
    return load_weights_only(path, _NUMPY_STATE)
