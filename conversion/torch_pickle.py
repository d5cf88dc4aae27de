"""The pickles of a ``torch_dist`` checkpoint, written without importing torch.

``hf-to-megatron`` copies bytes; importing torch (about 0.9 s) and ``torch.distributed.checkpoint`` (about
0.4 s more) was a third of a small conversion. What torch contributes to the files is only names inside
pickles, so they are written here by a pure-Python pickler (:class:`TorchNamePickler`) over light stand-ins
that carry torch's module and qualified names:

- :class:`TorchName` pickles as the global it names (``GLOBAL`` / ``STACK_GLOBAL``), never imported;
- :class:`Reduced` pickles as ``func(*args)`` (``REDUCE``): ``torch.Size((...))``, a layout via
  ``torch.serialization._get_layout`` (the reducer torch registers with copyreg), an enum member;
- :class:`Instance` pickles as ``object.__reduce_ex__`` pickles a dataclass: ``NEWOBJ`` of the class, then
  ``BUILD`` with its state (the instance ``__dict__``, or what the class's ``__getstate__`` returns).

The states are those of torch 2.x's ``torch.distributed.checkpoint`` (``metadata.py``, ``filesystem.py``):
``TensorProperties.__getstate__`` gives ``(dtype, layout, requires_grad, _MEM_FORMAT_ENCODING member,
pin_memory)``; ``_StorageInfo.__getstate__`` drops ``None`` fields; ``MetadataIndex`` keeps ``offset``
only when given. ``tests/unit/test_conversion_torch_pickle.py`` unpickles each file with torch and compares
it with the object torch builds (``.metadata``), or compares the bytes with ``torch.save``'s (``data.pkl``,
``torch.save({})``, ``torch.save([None])``), so a torch release that changes them fails there.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
from dataclasses import dataclass
from typing import Any

from megatron_arpo.ckpt_format.dcp_pickles import STORAGE_CLASSES  # noqa: F401  (re-exported: the writer's table)

DCP_METADATA_MODULE = "torch.distributed.checkpoint.metadata"
DCP_FILESYSTEM_MODULE = "torch.distributed.checkpoint.filesystem"
CURRENT_DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION (a test checks it)
# torch.save's pickle protocol (torch.serialization.DEFAULT_PROTOCOL); DCP pickles .metadata with pickle's default.
TORCH_SAVE_PROTOCOL = 2
METADATA_PROTOCOL = 4


@dataclass(frozen=True)
class TorchName:
    """A module-level torch object (class, function, dtype), pickled by name."""

    module: str
    name: str


@dataclass(frozen=True, eq=False)
class Reduced:
    """An object pickled as ``func(*args)``."""

    func: TorchName
    args: tuple


@dataclass(frozen=True, eq=False)
class Instance:
    """An instance of ``cls`` pickled as ``object.__reduce_ex__`` does: ``cls.__new__(cls)``, then its state."""

    cls: TorchName
    state: Any = None


_NAMES: dict[tuple[str, str], TorchName] = {}


def torch_name(module: str, name: str) -> TorchName:
    """One stand-in per name, so the pickler memoizes it as it memoizes the real global."""
    return _NAMES.setdefault((module, name), TorchName(module, name))


class TorchNamePickler(pickle._Pickler):
    """``pickle``'s pure-Python pickler, taught to write the stand-ins above."""

    dispatch = dict(pickle._Pickler.dispatch)

    def save_torch_name(self, obj: TorchName) -> None:
        if self.proto >= 4:
            self.save(obj.module)
            self.save(obj.name)
            self.write(pickle.STACK_GLOBAL)
        else:
            self.write(pickle.GLOBAL + obj.module.encode("ascii") + b"\n" + obj.name.encode("ascii") + b"\n")
        self.memoize(obj)

    def save_reduced(self, obj: Reduced) -> None:
        self.save(obj.func)
        self.save(tuple(obj.args))
        self.write(pickle.REDUCE)
        self.memoize(obj)

    def save_instance(self, obj: Instance) -> None:
        self.save(obj.cls)
        self.save(())
        self.write(pickle.NEWOBJ)
        self.memoize(obj)
        if obj.state is not None:
            self.save(obj.state)
            self.write(pickle.BUILD)

    dispatch[TorchName] = save_torch_name
    dispatch[Reduced] = save_reduced
    dispatch[Instance] = save_instance


def dumps(obj, protocol: int) -> bytes:
    out = io.BytesIO()
    TorchNamePickler(out, protocol=protocol).dump(obj)
    return out.getvalue()


# ---- torch objects -------------------------------------------------------------------------------------------

def size(values) -> Reduced:
    """``torch.Size(values)``."""
    return Reduced(torch_name("torch", "Size"), (tuple(int(v) for v in values),))


def dtype(name: str) -> TorchName:
    """``torch.bfloat16`` for ``"bfloat16"`` (a dtype pickles as its name in module ``torch``)."""
    if name not in STORAGE_CLASSES:
        raise ValueError(f"unsupported checkpoint dtype {name!r}; allowed: {sorted(STORAGE_CLASSES)}")
    return torch_name("torch", name)


def _dcp(name: str, state=None) -> Instance:
    return Instance(torch_name(DCP_METADATA_MODULE, name), state)


def tensor_properties(dtype_name: str) -> Instance:
    """``TensorProperties(dtype=...)`` with the defaults: strided, no grad, contiguous, not pinned."""
    strided = Reduced(torch_name("torch.serialization", "_get_layout"), ("torch.strided",))
    contiguous = Reduced(torch_name(DCP_METADATA_MODULE, "_MEM_FORMAT_ENCODING"), (0,))  # TORCH_CONTIGUOUS_FORMAT
    return _dcp("TensorProperties", (dtype(dtype_name), strided, False, contiguous, False))


def chunk_storage_metadata(offsets, sizes) -> Instance:
    return _dcp("ChunkStorageMetadata", {"offsets": size(offsets), "sizes": size(sizes)})


def tensor_storage_metadata(properties: Instance, shape, chunks: list[Instance]) -> Instance:
    return _dcp("TensorStorageMetadata", {"properties": properties, "size": size(shape), "chunks": list(chunks)})


def bytes_storage_metadata() -> Instance:
    return _dcp("BytesStorageMetadata")  # no fields: pickled without state


def metadata_index(fqn: str, offset=None, index: int | None = None) -> Instance:
    state = {"fqn": fqn, "index": index}
    if offset is not None:  # MetadataIndex.__init__ sets offset only when given (else the class default None)
        state["offset"] = size(offset)
    return _dcp("MetadataIndex", state)


def storage_info(relative_path: str, offset: int, length: int) -> Instance:
    """``_StorageInfo``; its ``__getstate__`` leaves out ``transform_descriptors`` when None."""
    return Instance(torch_name(DCP_FILESYSTEM_MODULE, "_StorageInfo"),
                    {"relative_path": relative_path, "offset": offset, "length": length})


def storage_meta(checkpoint_id: str | os.PathLike | None, save_id: str | None) -> Instance:
    return _dcp("StorageMeta", {"checkpoint_id": checkpoint_id, "save_id": save_id, "load_id": None, "modules": []})


def metadata(state_dict_metadata: dict, storage_data: dict, meta: Instance,
             version: str = CURRENT_DCP_VERSION) -> Instance:
    return _dcp("Metadata", {"state_dict_metadata": state_dict_metadata, "planner_data": None,
                             "storage_data": storage_data, "storage_meta": meta, "version": version})


def metadata_pickle(obj: Instance) -> bytes:
    """The ``.metadata`` file: ``pickle.dump(metadata)`` as DCP's ``FileSystemWriter`` writes it."""
    return dumps(obj, METADATA_PROTOCOL)


class _TensorPickler(TorchNamePickler):
    def __init__(self, file, storage, pid):
        super().__init__(file, protocol=TORCH_SAVE_PROTOCOL)
        self._storage, self._pid = storage, pid

    def persistent_id(self, obj):
        return self._pid if obj is self._storage else None


def data_pickle(dtype_name: str, shape: tuple[int, ...]) -> bytes:
    """The ``data.pkl`` ``torch.save`` writes for a contiguous CPU tensor of ``dtype_name`` and ``shape``:
    ``_rebuild_tensor_v2(storage "0", 0, size, stride, False, OrderedDict())``."""
    numel, stride = 1, []
    for dim in reversed(shape):
        stride.append(numel)
        numel *= dim
    if dtype_name not in STORAGE_CLASSES:
        raise ValueError(f"unsupported checkpoint dtype {dtype_name!r}; allowed: {sorted(STORAGE_CLASSES)}")
    storage = object()
    pid = ("storage", torch_name("torch", STORAGE_CLASSES[dtype_name]), "0", "cpu", numel)
    tensor = Reduced(torch_name("torch._utils", "_rebuild_tensor_v2"),
                     (storage, 0, tuple(shape), tuple(reversed(stride)), False, collections.OrderedDict()))
    out = io.BytesIO()
    _TensorPickler(out, storage, pid).dump(tensor)
    return out.getvalue()


def plain_pickle(obj) -> bytes:
    """``data.pkl`` of ``torch.save(obj)`` for an object without tensors (``{}``, ``[None]``)."""
    return dumps(obj, TORCH_SAVE_PROTOCOL)

