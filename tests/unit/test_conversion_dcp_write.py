"""The hand-written torch.save records of hf-to-megatron (conversion/torch_record.py) against torch itself."""

import io
import os
import zipfile

import pytest
import torch

from conversion import torch_record
from conversion.dcp_read import DistCheckpointReader
from conversion.torch_record import Segment, data_pickle, write_tensor_record

CASES = [(torch.float32, (7,)), (torch.bfloat16, (1, 3, 5)), (torch.float16, (2, 4)), (torch.bfloat16, (1, 64, 33))]


def torch_saved_entries(tensor):
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    archive = zipfile.ZipFile(buffer)
    return {info.filename: archive.read(info) for info in archive.infolist()}


@pytest.mark.parametrize("dtype,shape", CASES)
def test_data_pickle_is_what_torch_save_writes(dtype, shape):
    entries = torch_saved_entries(torch.zeros(shape, dtype=dtype))
    assert data_pickle(str(dtype).removeprefix("torch."), shape) == entries["archive/data.pkl"]


def write_record(tmp_path, tensor, split):
    """The tensor's bytes as: a range of another file, zeros where it is zero, an in-memory buffer."""
    raw = tensor.reshape(-1).view(torch.uint8).numpy().tobytes()
    source = tmp_path / "source.bin"
    source.write_bytes(b"junk" + raw)
    fd_in = os.open(source, os.O_RDONLY)
    out = tmp_path / "records.bin"
    fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    try:
        os.write(fd, b"previous record")
        a, b = split
        segments = [Segment(a, fd_in, 4), Segment(b - a), Segment(len(raw) - b, buffer=memoryview(raw)[b:])]
        length = write_tensor_record(fd, str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), segments,
                                     bytearray(16))  # a tiny buffer: many blocks per segment
    finally:
        os.close(fd)
        os.close(fd_in)
    data = out.read_bytes()
    assert len(data) == len(b"previous record") + length
    return data[len(b"previous record"):]


@pytest.mark.parametrize("dtype,shape", CASES)
def test_record_loads_with_torch_and_checks_out_as_a_zip(tmp_path, dtype, shape):
    tensor = torch.randn(shape).to(dtype)
    numel_bytes = tensor.numel() * tensor.element_size()
    zero_from, zero_to = numel_bytes // 3, numel_bytes // 2
    flat = tensor.reshape(-1).view(torch.uint8)
    flat[zero_from:zero_to] = 0
    record = write_record(tmp_path, tensor, (zero_from, zero_to))
    loaded = torch.load(io.BytesIO(record), weights_only=True)
    assert loaded.dtype == dtype and loaded.shape == tensor.shape and torch.equal(loaded, tensor)
    archive = zipfile.ZipFile(io.BytesIO(record))
    assert archive.testzip() is None  # every CRC right
    expected = torch_saved_entries(tensor)
    assert [i.filename for i in archive.infolist()] == list(expected)
    for name in expected:
        if not name.endswith("serialization_id"):
            assert archive.read(name) == expected[name], name
    data = archive.getinfo("archive/data/0")
    assert data.compress_type == zipfile.ZIP_STORED
    start = data.header_offset + 30 + len(data.filename) + int.from_bytes(record[data.header_offset + 28:
                                                                                 data.header_offset + 30], "little")
    assert start % 64 == 0 and record[start:start + numel_bytes] == flat.numpy().tobytes()


def test_zip64_fields_are_read_back(tmp_path, monkeypatch):
    """Records over 4 GiB take zip64 sizes and offsets; the limit is lowered so a small record uses them."""
    monkeypatch.setattr(torch_record, "ZIP64_LIMIT", 8)
    tensor = torch.randn(3, 40)
    tensor.reshape(-1).view(torch.uint8)[100:200] = 0  # written as a zero segment
    record = write_record(tmp_path, tensor, (100, 200))
    assert torch.equal(torch.load(io.BytesIO(record), weights_only=True), tensor)
    archive = zipfile.ZipFile(io.BytesIO(record))
    assert archive.testzip() is None
    assert archive.getinfo("archive/data/0").file_size == tensor.numel() * 4


def test_short_source_is_an_error(tmp_path):
    source = tmp_path / "short.bin"
    source.write_bytes(b"\0" * 10)
    fd_in = os.open(source, os.O_RDONLY)
    fd = os.open(tmp_path / "out.bin", os.O_WRONLY | os.O_CREAT)
    try:
        with pytest.raises(OSError, match="short read"):
            write_tensor_record(fd, "float32", (8,), [Segment(32, fd_in, 0)])
        with pytest.raises(AssertionError, match="expected 32"):
            write_tensor_record(fd, "float32", (8,), [Segment(16)])
    finally:
        os.close(fd)
        os.close(fd_in)


def test_converted_chunks_are_byte_copies_the_reader_finds(tmp_path, caplog):
    """A same-dtype conversion copies every chunk from the safetensors files, and megatron-to-hf finds the rows
    of every chunk on disk again (its byte-copy path), including the QKV bias and the padded embedding."""
    import json

    from conversion.dist_ckpt import convert_hf_to_megatron
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    with caplog.at_level("INFO", logger="conversion.dcp_write"):
        out = convert_hf_to_megatron(tiny_checkpoint("tiny-qwen2.5"), tmp_path / "mg", tp=2)
    assert "18 of 18 chunks copied as byte ranges" in caplog.text
    reader = DistCheckpointReader(out)
    try:
        for key in reader.tensors:
            assert reader.row_chunks(key, 0 if key.startswith("decoder.layers.") else None) is not None, key
    finally:
        reader.close()
    assert json.loads((out / "metadata.json").read_text())["sharded_backend"] == "torch_dist"
