"""The torch-free pickles of hf-to-megatron (conversion/torch_pickle.py) against torch's own objects and bytes.

The oracle is the installed torch: ``.metadata`` unpickles into a ``Metadata`` equal, field by field, to the
one built from torch's classes; ``data.pkl``, ``torch.save({})`` and ``torch.save([None])`` are compared
byte for byte with what ``torch.save`` writes. A same-dtype conversion must import neither torch nor
megatron-core (checked in a subprocess with ``-X importtime``).
"""

import io
import pickle
import re
import subprocess
import sys
import uuid
import zipfile
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata, ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta, TensorProperties,
    TensorStorageMetadata)

from conversion import torch_pickle
from conversion.dcp_write import dcp_metadata, plan_layout
from conversion.torch_record import saved_object
from megatron_arpo.model_config import load_model_config
from megatron_arpo.tiny.checkpoint import tiny_checkpoint


def torch_saved_entries(obj) -> dict[str, bytes]:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    archive = zipfile.ZipFile(buffer)
    return {info.filename: archive.read(info) for info in archive.infolist()}


def torch_built_metadata(layout, dtype, storage_rows, checkpoint_id, save_id) -> Metadata:
    """What the writer used to build with torch's own classes (the reference)."""
    properties = TensorProperties(dtype=dtype)
    state_dict_metadata = {}
    for key, saved in layout.tensors.items():
        state_dict_metadata[key] = TensorStorageMetadata(
            properties, torch.Size(saved.shape),
            [ChunkStorageMetadata(torch.Size(c.offsets), torch.Size(c.sizes)) for c in saved.chunks])
    for key in layout.objects:
        state_dict_metadata[key] = BytesStorageMetadata()
    storage = {(MetadataIndex(fqn) if offsets is None else MetadataIndex(fqn, torch.Size(offsets), index)):
               _StorageInfo(path, offset, length) for fqn, offsets, index, path, offset, length in storage_rows}
    return Metadata(state_dict_metadata=state_dict_metadata, planner_data=None, storage_data=storage,
                    storage_meta=StorageMeta(checkpoint_id=checkpoint_id, save_id=save_id),
                    version=CURRENT_DCP_VERSION)


@pytest.mark.parametrize("name,tp,dtype", [("tiny-qwen2.5", 2, torch.bfloat16), ("tiny-qwen3", 1, torch.float32),
                                           ("tiny-llama", 4, torch.float16)])
def test_metadata_unpickles_equal_to_torch_built(tmp_path, name, tp, dtype):
    layout = plan_layout(load_model_config(name), tp)
    rows = [(key, None, None, "__0_0.distcp", 7 * i, 7) for i, key in enumerate(layout.objects)]
    rows += [(saved.key, chunk.offsets, index, "__0_0.distcp", 1000 + 100 * index, 99 + index)
             for saved in layout.tensors.values() for index, chunk in enumerate(saved.chunks)]
    storage = {(torch_pickle.metadata_index(fqn) if offsets is None else
                torch_pickle.metadata_index(fqn, offsets, index)): torch_pickle.storage_info(path, offset, length)
               for fqn, offsets, index, path, offset, length in rows}
    save_id = str(uuid.uuid4())
    dtype_name = str(dtype).removeprefix("torch.")
    ours = pickle.loads(torch_pickle.metadata_pickle(dcp_metadata(layout, dtype_name, storage, tmp_path, save_id)))
    expected = torch_built_metadata(layout, dtype, rows, tmp_path, save_id)

    assert type(ours) is Metadata
    assert ours.version == expected.version == CURRENT_DCP_VERSION == torch_pickle.CURRENT_DCP_VERSION
    assert ours.planner_data is None and ours.storage_meta == expected.storage_meta
    assert list(ours.state_dict_metadata) == list(expected.state_dict_metadata)
    for key, value in expected.state_dict_metadata.items():
        got = ours.state_dict_metadata[key]
        assert type(got) is type(value) and got == value, key
        if isinstance(value, TensorStorageMetadata):
            assert type(got.size) is torch.Size and all(type(c.offsets) is torch.Size for c in got.chunks)
            props = got.properties
            assert (props.dtype, props.layout, props.requires_grad, props.memory_format, props.pin_memory) == (
                dtype, torch.strided, False, torch.contiguous_format, False)
    assert list(ours.storage_data) == list(expected.storage_data)
    # attribute by attribute, against torch's own object after its own pickle round trip (which, like ours,
    # leaves MetadataIndex.offset and _StorageInfo.transform_descriptors to the class defaults when None)
    roundtrip = pickle.loads(pickle.dumps(expected))
    for (index, info), (got_index, got_info) in zip(roundtrip.storage_data.items(), ours.storage_data.items()):
        assert vars(got_index) == vars(index) and type(got_index.offset) is type(index.offset)
        assert got_info == info and vars(got_info) == vars(info)
    assert ours == expected == roundtrip


@pytest.mark.parametrize("dtype", sorted(torch_pickle.STORAGE_CLASSES))
@pytest.mark.parametrize("shape", [(5,), (1, 3, 7), (2, 1000, 33), ()])
def test_data_pickle_is_byte_identical_to_torch_save(dtype, shape):
    tensor = torch.zeros(shape, dtype=getattr(torch, dtype))
    assert torch_pickle.data_pickle(dtype, shape) == torch_saved_entries(tensor)["archive/data.pkl"]


@pytest.mark.parametrize("obj", [{}, [None]], ids=["common.pt", "extra_state"])
def test_saved_objects_match_torch_save(obj):
    ours = saved_object(torch_pickle.plain_pickle(obj))
    assert torch.load(io.BytesIO(ours), weights_only=True) == obj
    archive = zipfile.ZipFile(io.BytesIO(ours))
    assert archive.testzip() is None
    expected = torch_saved_entries(obj)
    assert [i.filename for i in archive.infolist()] == list(expected)
    for name, data in expected.items():
        if not name.endswith("serialization_id"):
            assert archive.read(name) == data, name
    assert len(archive.read("archive/.data/serialization_id")) == len(expected["archive/.data/serialization_id"])


def test_unknown_dtype_is_refused():
    with pytest.raises(ValueError, match="unsupported checkpoint dtype 'complex64'"):
        torch_pickle.data_pickle("complex64", (2,))


def imported_modules(stderr: str) -> set[str]:
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


@pytest.mark.parametrize("name", ["tiny-qwen2.5", "tiny-qwen3", "tiny-llama"])
def test_same_dtype_conversion_imports_neither_torch_nor_megatron(tmp_path, name):
    hf_dir = tiny_checkpoint(name)
    out = tmp_path / "mg"
    done = subprocess.run([sys.executable, "-X", "importtime", "-m", "conversion", "-v", "hf-to-megatron",
                           "--hf", str(hf_dir), "--out", str(out), "--tp", "2"],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    modules = imported_modules(done.stderr)
    assert "conversion.dcp_write" in modules  # the measurement sees the writer's imports
    heavy = sorted(m for m in modules if m.split(".")[0] in ("torch", "megatron"))
    assert heavy == [], heavy[:10]
    copied, total = map(int, re.search(r"(\d+) of (\d+) chunks copied as byte ranges", done.stderr).groups())
    assert copied == total > 0  # every chunk a byte copy: no rule of the table needs a tensor at the same dtype
    # torch's own reader takes the files
    metadata = FileSystemReader(str(out)).read_metadata()
    assert metadata.version == CURRENT_DCP_VERSION and metadata.storage_meta.save_id
    assert torch.load(out / "common.pt", weights_only=True) == {}


def test_cast_conversion_still_builds_tensors(tmp_path):
    """--dtype different from the source: chunks are built as tensors (torch imported), and load with torch."""
    from conversion.dcp_read import DistCheckpointReader

    hf_dir = tiny_checkpoint("tiny-qwen3")
    out = tmp_path / "mg"
    done = subprocess.run([sys.executable, "-m", "conversion", "-v", "hf-to-megatron", "--hf", str(hf_dir),
                           "--out", str(out), "--dtype", "bfloat16"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert re.search(r" 0 of \d+ chunks copied", done.stderr)
    metadata = FileSystemReader(str(out)).read_metadata()
    dtypes = {m.properties.dtype for m in metadata.state_dict_metadata.values() if hasattr(m, "properties")}
    assert dtypes == {torch.bfloat16}
    reader = DistCheckpointReader(Path(out))
    try:
        assert reader.tensors
    finally:
        reader.close()
