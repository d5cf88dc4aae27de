"""The two pickles of a ``torch_dist`` checkpoint, read without torch: ``.metadata`` and a chunk's ``data.pkl``.

``megatron-to-hf`` copies bytes; it needs to know where they are, not to build tensors. Importing torch
costs over a second and ``torch.distributed.checkpoint`` most of another (DTensor, sympy), so both pickles
are read by restricted unpicklers whose ``find_class`` allows only the names those files contain and
maps them to stand-ins: DCP's metadata dataclasses keep their pickled state as attributes, ``torch.Size``
becomes a tuple, a dtype its name (``"bfloat16"``), a storage class (``torch.BFloat16Storage``) its
dtype name, and ``torch._utils._rebuild_tensor_v2`` a :class:`StoredTensor` recipe (storage key, offset,
size, stride). Anything else:

- a torch name these stand-ins do not know (another torch version's layout) raises
  :class:`UnknownTorchName`; the caller then uses torch's own loaders;
- a name outside torch raises :class:`ForeignPickleError`, which is never retried with an unrestricted
  unpickler (DCP itself would ``pickle.load`` such a file and run what it names).

:class:`TorchMetadataUnpickler` is the allow-list over the real torch classes, for when torch's own objects
are needed (another torch version's layout; Megatron's loader, through :data:`RESTRICTED_PICKLE`, which
``megatron_arpo.actor.checkpoint`` puts in place of DCP's ``pickle``): no name outside it is ever imported.
"""

from __future__ import annotations

import collections
import importlib
import io
import os
import pickle
import types
from dataclasses import dataclass

# torch dtype names a checkpoint can hold, and the legacy storage class torch.save names for each.
STORAGE_CLASSES = {"float32": "FloatStorage", "float16": "HalfStorage", "bfloat16": "BFloat16Storage",
                   "float64": "DoubleStorage", "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage",
                   "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage"}
DTYPE_NAMES = tuple(STORAGE_CLASSES)
STORAGE_DTYPES = {storage: dtype for dtype, storage in STORAGE_CLASSES.items()}


class UnknownTorchName(pickle.UnpicklingError):
    """A torch name the stand-ins do not cover: read the file with torch instead."""


class ForeignPickleError(pickle.UnpicklingError):
    """A non-torch global in a checkpoint pickle: refused, never retried with an unrestricted unpickler."""


def _path(*parts: str) -> str:  # pathlib pickles a path as its class and its parts
    return os.path.join(*parts) if parts else ""


def _refuse(module: str, name: str, what: str):
    if module == "torch" or module.startswith("torch."):
        raise UnknownTorchName(f"{module}.{name}: not known here")
    raise ForeignPickleError(f"refusing to load {module}.{name}: a torch_dist {what} names only torch classes; "
                             f"this file was not written by torch (or was tampered with)")


class _Pickled:
    """Stand-in for one of DCP's metadata dataclasses: keeps the state it was pickled with as attributes."""

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2 and isinstance(state[1], dict):  # (dict, slots)
            state = {**(state[0] or {}), **state[1]}
        if not isinstance(state, dict):
            raise UnknownTorchName(f"unexpected pickled state for {type(self).__name__}")
        self.__dict__.update(state)


class _TensorProperties(_Pickled):
    def __setstate__(self, state):  # DCP pickles (dtype, layout, requires_grad, memory format code, pin_memory)
        self.dtype = state[0]


_DCP_CLASSES = {"torch.distributed.checkpoint.metadata": ("Metadata", "TensorStorageMetadata",
                                                          "BytesStorageMetadata", "ChunkStorageMetadata",
                                                          "MetadataIndex", "StorageMeta"),
                "torch.distributed.checkpoint.filesystem": ("_StorageInfo",)}
# Attributes DCP leaves to class defaults when they are None.
_DEFAULTS = {"MetadataIndex": {"offset": None}, "_StorageInfo": {"transform_descriptors": None}}
_STAND_INS = {name: type(name, (_Pickled,), dict(_DEFAULTS.get(name, {})))
              for names in _DCP_CLASSES.values() for name in names}


class MetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` (a pickled ``Metadata``) into stand-ins."""

    def find_class(self, module: str, name: str):
        if name in _DCP_CLASSES.get(module, ()):
            return _STAND_INS[name]
        if (module, name) == ("torch.distributed.checkpoint.metadata", "TensorProperties"):
            return _TensorProperties
        if (module, name) == ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"):
            return int
        if (module, name) == ("torch", "Size"):
            return tuple
        if (module, name) == ("torch.serialization", "_get_layout"):
            return str
        if module == "torch" and name in DTYPE_NAMES:
            return name
        if module == "pathlib" and name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath"):
            return _path
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        return _refuse(module, name, ".metadata file")


def load_metadata(fh):
    return MetadataUnpickler(fh).load()


# The real classes a DCP ``.metadata`` may name (torch 2.x ``metadata.py`` / ``filesystem.py``), and the rest.
_TORCH_METADATA_NAMES = {
    *((module, name) for module, names in _DCP_CLASSES.items() for name in names),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    # Megatron's save planner leaves its plans in ``planner_data``: plain dataclasses and enums.
    *(("torch.distributed.checkpoint.planner", name) for name in (
        "SavePlan", "WriteItem", "WriteItemType", "BytesIOWriteData", "TensorWriteData", "LoadPlan", "ReadItem",
        "LoadItemType")),
    ("torch", "Size"), ("torch.serialization", "_get_layout"), ("collections", "OrderedDict"),
    *(("pathlib", name) for name in ("PosixPath", "WindowsPath", "PurePosixPath", "PureWindowsPath")),
}


class TorchMetadataUnpickler(pickle.Unpickler):
    """DCP's ``.metadata`` into torch's own classes, importing only the allow-listed names (and dtypes)."""

    def find_class(self, module: str, name: str):
        if (module, name) in _TORCH_METADATA_NAMES:
            return getattr(importlib.import_module(module), name)
        if module == "torch":
            # deferred: pulls in torch (heavy; this module imports without it)
            import torch  # only here: the torch-free readers above never get this far

            value = getattr(torch, name, None)
            if isinstance(value, torch.dtype):
                return value
        raise ForeignPickleError(f"refusing to load {module}.{name}: not a class a torch_dist .metadata file "
                                 f"holds; this file was not written by torch (or was tampered with)")


def load_torch_metadata(fh):
    """A ``.metadata`` file as torch's ``Metadata``; :class:`ForeignPickleError` names the file when refused."""
    try:
        return TorchMetadataUnpickler(fh).load()
    except ForeignPickleError as exc:
        raise ForeignPickleError(f"{getattr(fh, 'name', '.metadata')}: {exc}") from None


def _restricted_load(fh, **_ignored):
    return load_torch_metadata(fh)


# Stands in for the ``pickle`` module inside ``torch.distributed.checkpoint.filesystem``: its reader's
# ``pickle.load`` of ``.metadata`` goes through the allow-list; writing (``pickle.dump``) is unchanged.
RESTRICTED_PICKLE = types.SimpleNamespace(**{**{k: getattr(pickle, k) for k in pickle.__all__}, "load": _restricted_load,
                                             "loads": lambda data, **_: load_torch_metadata(io.BytesIO(data))})


@dataclass(frozen=True)
class StoredTensor:
    """What a chunk's ``data.pkl`` says: one tensor over storage record ``key``."""

    dtype: str
    key: str
    storage_numel: int
    storage_offset: int
    size: tuple[int, ...]
    stride: tuple[int, ...]

    @property
    def is_plain(self) -> bool:
        """Row-major, from the start of its storage, over all of it: the record's bytes are the tensor."""
        expected, numel = [], 1
        for dim in reversed(self.size):
            expected.append(numel)
            numel *= dim
        return (self.storage_offset == 0 and tuple(reversed(expected)) == self.stride
                and numel == self.storage_numel)


@dataclass(frozen=True)
class _Storage:
    dtype: str
    key: str
    numel: int


def _rebuild_tensor(storage, storage_offset, size, stride, *_ignored):
    if not isinstance(storage, _Storage):
        raise UnknownTorchName("tensor over something other than a storage")
    return StoredTensor(storage.dtype, storage.key, storage.numel, int(storage_offset), tuple(size), tuple(stride))


class ChunkUnpickler(pickle.Unpickler):
    """The ``data.pkl`` of one ``torch.save``'d tensor (a DCP chunk) into a :class:`StoredTensor`."""

    def find_class(self, module: str, name: str):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return _rebuild_tensor
        if module == "torch" and name in STORAGE_DTYPES:
            return STORAGE_DTYPES[name]
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        return _refuse(module, name, "tensor record")

    def persistent_load(self, pid):
        # ("storage", storage type -> dtype name, key, location, number of elements)
        if not (isinstance(pid, tuple) and len(pid) == 5 and pid[0] == "storage" and pid[1] in DTYPE_NAMES):
            raise UnknownTorchName(f"unexpected persistent id {pid!r}")
        return _Storage(pid[1], str(pid[2]), int(pid[4]))


def load_chunk_recipe(data: bytes) -> StoredTensor:
    recipe = ChunkUnpickler(io.BytesIO(data)).load()
    if not isinstance(recipe, StoredTensor):
        raise UnknownTorchName(f"data.pkl holds a {type(recipe).__name__}, not one tensor")
    return recipe
