"""Writing a Megatron ``torch_dist`` checkpoint from our mapping tables, without megatron-core.

What ``dist_checkpointing.save`` of a TP=1/PP=1 ``GPTModel`` (local layer spec) writes in megatron-core
0.16.1, derived here from :func:`megatron_arpo.hf.mapping.bind_table` instead of from a model (the test
``tests/dist/test_conversion_dist_ckpt.py`` compares it, key by key, with what Megatron's
``sharded_state_dict()`` says):

- keys: the Transformer Engine names for both specs (:func:`conversion.megatron_to_hf.dist_key`);
  per-layer tensors stacked on a leading layer axis, global shape ``[num_layers, *per-layer shape]``,
  one chunk per layer at offset ``(layer, 0, ...)``; ``linear_fc1`` is two chunks per layer, gate rows
  ``[0, ffn)`` and up rows ``[ffn, 2*ffn)`` (the swiglu factory's split, whatever the TP size); the
  embedding and an untied output layer are one chunk with the vocabulary padded for the target TP (they
  load with ``allow_shape_mismatch``, so a checkpoint padded for one TP size loads at another); a tied
  output layer is not saved (the one-stage model shares the embedding);
- every ``linear_*`` module of a layer has an ``_extra_state`` ShardedObject per layer, key
  ``<module>._extra_state/shard_<layer>_<num_layers>``, stored as the bytes of ``torch.save([None])``
  (what Megatron's local linears give); DCP keeps it as ``BytesStorageMetadata``;
- MoE experts (``SequentialMLP``): one key per expert linear, ``decoder.layers.mlp.experts.experts.
  linear_fc1.weight``, stacked on a layer and a global-expert axis, ``[num_layers, num_experts, ...]``,
  one chunk per (layer, expert) (two for ``linear_fc1``); their ``_extra_state`` objects are keyed
  ``shard_<layer>.<expert>_<num_layers>.<num_experts>``; the router is a plain per-layer tensor;
- files: ``__0_0.distcp`` (the byte items, then each tensor chunk as a ``torch.save`` record, which
  DCP's ``FileSystemReader`` reads back with ``torch.load`` on the byte range; written by
  :mod:`conversion.torch_record`), ``.metadata`` (a pickled
  ``torch.distributed.checkpoint.metadata.Metadata``: ``state_dict_metadata``, ``storage_data`` with
  one ``_StorageInfo`` per item, ``storage_meta``, ``version``), ``common.pt`` (``torch.save({})``: a
  model has no common state) and ``metadata.json`` (the ``CheckpointingConfig``: torch_dist v1, torch
  common v1), written last as ``dist_checkpointing.save`` does.

How a chunk's bytes are made: every rule of the tables is a permutation of row blocks, so when the HF
tensors already have the checkpoint's dtype a chunk is a list of byte ranges of the safetensors files
(:func:`copy_segments`; the embedding's padding rows are zeros), streamed through one buffer into the
record: no tensor is built, what ``cp`` does plus a CRC. Otherwise (``--dtype`` casts) the chunk is built
as a tensor by the rule (:class:`ChunkResolver`), written and dropped. Chunks go in layer order, so the
HF files are read front to back. Peak memory: the 256 KB buffer on the copy path, about the largest tensor
on the cast path; neither grows with the number of layers.

Neither megatron-core nor torch is imported on the copy path (megatron-core plus building a meta model cost
several seconds per call; ``import torch`` and ``torch.distributed.checkpoint`` 1.3 s, a third of a small
conversion): the pickles (``.metadata``, each record's ``data.pkl``, ``common.pt``, the ``_extra_state``
bytes) are written by :mod:`conversion.torch_pickle` with stand-ins carrying torch's names. Torch is
imported only to build a chunk as a tensor, which a same-dtype conversion of qwen2/qwen3/llama never does.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from megatron_arpo.hf import mapping
from megatron_arpo.hf.checkpoint_io import ELEMENT_SIZES, torch_dtype
from conversion.megatron_to_hf import dist_key
from conversion import torch_pickle as tp_pickle
from conversion.torch_record import BLOCK, Segment, saved_object, write_tensor_record
from megatron_arpo.model_config import ModelConfig
from megatron_arpo.fsutil import WriteBehind
from megatron_arpo.progress import Progress

if TYPE_CHECKING:
    import torch

    from megatron_arpo.hf.checkpoint_io import HFCheckpointReader

logger = logging.getLogger(__name__)

DATA_FILE = "__0_0.distcp"
DCP_METADATA = ".metadata"
COMMON_FILE = "common.pt"
MEGATRON_METADATA = "metadata.json"
# megatron.core.dist_checkpointing.core.CheckpointingConfig of a torch_dist save, in its field order.
CHECKPOINTING_CONFIG = {"sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
                        "common_backend_version": 1}


@dataclass(frozen=True)
class Chunk:
    """One saved chunk: a region of a global tensor, and the rule that makes it."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    rule: mapping.BoundRule


@dataclass
class SavedTensor:
    key: str
    shape: tuple[int, ...]
    chunks: list[Chunk]


@dataclass(frozen=True)
class Layout:
    """The checkpoint's items, in Megatron's ``sharded_state_dict()`` key order."""

    tensors: dict[str, SavedTensor]
    objects: tuple[str, ...]  # ShardedObject unique keys (the linears' _extra_state)


def with_padding(cfg: ModelConfig, tp: int) -> ModelConfig:
    """A config whose ``padded_vocab_size(1)`` equals ``cfg.padded_vocab_size(tp)``."""
    return dataclasses.replace(cfg, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by * tp)


def stacked_axes(rule: mapping.BoundRule) -> int:
    """Leading axes a rule's tensor is stacked on in the checkpoint: layer (1), layer and expert (2), none (0)."""
    return 0 if rule.layer is None else 1 if rule.expert is None else 2


def _extra_state_module(rule: mapping.BoundRule) -> str | None:
    """``decoder.layers.self_attention.linear_qkv`` for a rule of a layer's ``linear_*`` module.

    Judged on the local-spec name: a pre-norm saved under a TE linear's key (``mlp.linear_fc1.
    layer_norm_weight``) brings no ``_extra_state``; an MoE layer has no dense ``linear_fc1`` to hold one.
    """
    if rule.layer is None or not rule.megatron.rsplit(".", 2)[-2].startswith("linear_"):
        return None
    module = dist_key(rule).rsplit(".", 1)[0]
    return module if module.rsplit(".", 1)[-1].startswith("linear_") else None


def plan_layout(cfg: ModelConfig, tp: int) -> Layout:
    """Keys, global shapes and chunks of the TP=1/PP=1 model whose vocabulary is padded for ``tp``."""
    padded = with_padding(cfg, tp)
    layers = cfg.num_hidden_layers
    tensors: dict[str, SavedTensor] = {}
    objects: dict[str, None] = {}
    per_key: dict[str, list[mapping.BoundRule]] = {}
    for rule in mapping.bind_table(cfg):
        if mapping.is_shared_output(rule, cfg, 1):
            continue
        per_key.setdefault(dist_key(rule), []).append(rule)
    for key, rules in per_key.items():
        first = rules[0]
        shape = first.megatron_shape(padded if isinstance(first.rule, mapping.VocabEmbedding) else cfg, 1)
        if first.layer is None:
            tensors[key] = SavedTensor(key, tuple(shape), [Chunk((0,) * len(shape), tuple(shape), first)])
            continue
        experts = cfg.num_experts if first.expert is not None else None
        lead = (layers,) if experts is None else (layers, experts)
        chunks = []
        for rule in sorted(rules, key=lambda r: (r.layer, r.expert or 0)):
            at = (rule.layer,) if experts is None else (rule.layer, rule.expert)
            ones = (1,) * len(at)
            if isinstance(rule.rule, mapping.FusedGateUp):  # [gate; up], one chunk each
                half = shape[0] // 2
                chunks += [Chunk((*at, row, *([0] * (len(shape) - 1))), (*ones, half, *shape[1:]), rule)
                           for row in (0, half)]
            else:
                chunks.append(Chunk(at + (0,) * len(shape), (*ones, *shape), rule))
        tensors[key] = SavedTensor(key, (*lead, *shape), chunks)
        module = _extra_state_module(first)
        if module is not None:
            for layer in range(layers):
                for expert in ([None] if experts is None else range(experts)):
                    shard = f"{layer}_{layers}" if expert is None else f"{layer}.{expert}_{layers}.{experts}"
                    objects[f"{module}._extra_state/shard_{shard}"] = None
    return Layout(tensors, tuple(objects))


class ChunkResolver:
    """Builds one saved chunk from the HF checkpoint, caching the last full tensor.

    The two halves of ``linear_fc1`` are each exactly one HF tensor (TP=1 ``linear_fc1`` is
    ``[gate; up]``), so they are read directly; anything else is the rule's TP=1 tensor (the embedding
    padded for the target TP), narrowed to the chunk.
    """

    def __init__(self, reader: HFCheckpointReader, cfg: ModelConfig, padded_tp: int, dtype_name: str):
        self.reader, self.cfg, self.padded_tp, self.dtype_name = reader, cfg, padded_tp, dtype_name
        self._cache: tuple[str, torch.Tensor] | None = None

    @property
    def dtype(self) -> torch.dtype:  # torch only when a chunk is built

        return torch_dtype(self.dtype_name)

    def _drop(self) -> None:
        self._cache = None  # drop the previous tensor before building the next
        self.reader.release()

    def full(self, rule: mapping.BoundRule) -> torch.Tensor:
        if self._cache is not None and self._cache[0] == rule.megatron:
            return self._cache[1]
        self._drop()
        if isinstance(rule.rule, mapping.VocabEmbedding):
            tensor = rule.rule.read_shard(self.reader, with_padding(self.cfg, self.padded_tp), 0, 1)
        else:
            tensor = rule.read_shard(self.reader, self.cfg, 0, 1)
        tensor = tensor.to(self.dtype)
        self._cache = (rule.megatron, tensor)
        return tensor

    def chunk(self, chunk: Chunk) -> torch.Tensor:
        rule, offsets, sizes = chunk.rule, chunk.offsets, chunk.sizes
        inner_offsets, inner_sizes = offsets[stacked_axes(rule):], sizes[stacked_axes(rule):]
        if isinstance(rule.rule, mapping.FusedGateUp):
            self._drop()
            source = rule.fill(rule.rule.gate if inner_offsets[0] == 0 else rule.rule.up)
            return self.reader.read(source).to(self.dtype).reshape(sizes)
        out = self.full(rule)
        for dim, (start, size) in enumerate(zip(inner_offsets, inner_sizes)):
            out = out.narrow(dim, start, size)
        return out.reshape(sizes)

    def close(self) -> None:
        self._drop()


def copy_segments(reader: HFCheckpointReader, cfg: ModelConfig, chunk: Chunk, dtype: str,
                  files: dict[Path, int]) -> list[Segment] | None:
    """The chunk's bytes as ranges of the safetensors files (plus zero rows of vocabulary padding).

    Every table rule is a permutation of row blocks (:meth:`mapping.BoundRule.hf_row_blocks`: which rows
    of the Megatron tensor each HF tensor's rows become), so when the HF tensors already have the
    checkpoint's dtype a chunk is those rows read in Megatron order. None when that does not hold (a
    dtype cast, rows no block covers): the caller builds the tensor instead.
    """
    rule = chunk.rule
    inner_offsets, inner_sizes = chunk.offsets[stacked_axes(rule):], chunk.sizes[stacked_axes(rule):]
    if any(inner_offsets[1:]):
        return None
    row_bytes = ELEMENT_SIZES[dtype] * math.prod(inner_sizes[1:])
    first, stop = inner_offsets[0], inner_offsets[0] + inner_sizes[0]
    blocks = []
    for name, name_blocks in rule.hf_row_blocks(cfg).items():
        where = reader.locate(name)
        if where.dtype != dtype or ELEMENT_SIZES[dtype] * math.prod(where.shape[1:]) != row_bytes:
            return None
        blocks += [(start, rows, where, hf_row) for start, rows, hf_row in name_blocks]
    segments, row = [], first
    for start, rows, where, hf_row in sorted(blocks, key=lambda b: b[0]):
        lo, hi = max(start, first), min(start + rows, stop)
        if lo >= hi:
            continue
        if lo != row:
            return None  # a gap before a block: not a permutation of rows
        fd = files.get(where.path)
        if fd is None:
            fd = files[where.path] = os.open(where.path, os.O_RDONLY)
        offset = where.offset + (hf_row + lo - start) * row_bytes
        if segments and segments[-1].fd == fd and segments[-1].offset + segments[-1].nbytes == offset:
            segments[-1] = Segment(segments[-1].nbytes + (hi - lo) * row_bytes, fd, segments[-1].offset)
        else:
            segments.append(Segment((hi - lo) * row_bytes, fd, offset))
        row = hi
    if row != stop:
        if not isinstance(rule.rule, mapping.VocabEmbedding) or row < cfg.vocab_size:
            return None
        segments.append(Segment((stop - row) * row_bytes))  # the padding rows, zeros as read_shard makes them
    return segments


def _tensor_bytes(tensor: torch.Tensor) -> memoryview:
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch

    return tensor.contiguous().reshape(-1).view(torch.uint8).numpy().data


def write_torch_dist(reader: HFCheckpointReader, cfg: ModelConfig, out: Path, tp: int, dtype) -> Layout:
    """Write the checkpoint files into ``out`` (an existing, empty directory); fsync'd, metadata.json last.

    ``dtype`` (a name, ``"bfloat16"``, or a ``torch.dtype``) is the checkpoint's; torch is imported only
    if some chunk must be built as a tensor (a cast).
    """
    layout = plan_layout(cfg, tp)
    dtype_name = str(dtype).removeprefix("torch.")
    out = Path(out)
    _write_file(out / COMMON_FILE, saved_object(tp_pickle.plain_pickle({})))
    extra_state = saved_object(tp_pickle.plain_pickle([None]))
    storage: dict = {}
    resolver = ChunkResolver(reader, cfg, tp, dtype_name)
    files: dict[Path, int] = {}
    buffer = bytearray(BLOCK)
    copied = 0
    chunks = _layer_order(layout)
    report = Progress("hf-to-megatron", len(chunks), unit="chunk", rate_unit="MB")
    fd = os.open(out / DATA_FILE, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    behind = WriteBehind(fd)  # written back as it grows, its pages dropped from the page cache
    try:
        for key in layout.objects:
            offset = os.lseek(fd, 0, os.SEEK_CUR)
            behind.appended(os.write(fd, extra_state))
            storage[tp_pickle.metadata_index(key)] = tp_pickle.storage_info(DATA_FILE, offset, len(extra_state))
        for saved, index, chunk in chunks:
            segments = copy_segments(reader, cfg, chunk, dtype_name, files)
            tensor = None
            if segments is None:
                tensor = resolver.chunk(chunk)
                if tuple(tensor.shape) != chunk.sizes:
                    raise AssertionError(f"{saved.key}: built {list(tensor.shape)} for chunk {list(chunk.sizes)}")
                data = _tensor_bytes(tensor)
                segments = [Segment(len(data), buffer=data)]
            else:
                copied += 1
            offset = os.lseek(fd, 0, os.SEEK_CUR)
            length = write_tensor_record(fd, dtype_name, chunk.sizes, segments, buffer, behind)
            storage[tp_pickle.metadata_index(saved.key, chunk.offsets, index)] = tp_pickle.storage_info(
                DATA_FILE, offset, length)
            del tensor, segments
            report.update(1, length / 1e6)
        behind.finish()
        report.close()
    finally:
        os.close(fd)
        resolver.close()
        for source in files.values():
            os.close(source)
    logger.info("%d of %d chunks copied as byte ranges of the safetensors files, the rest built as tensors", copied,
                len(storage) - len(layout.objects))
    _write_file(out / DCP_METADATA, tp_pickle.metadata_pickle(dcp_metadata(layout, dtype_name, storage, out)))
    _write_file(out / MEGATRON_METADATA, json.dumps(CHECKPOINTING_CONFIG).encode())
    return layout


def dcp_metadata(layout: Layout, dtype_name: str, storage_data: dict, checkpoint_id, save_id: str | None = None):
    """DCP's ``Metadata`` of the checkpoint (as :mod:`conversion.torch_pickle` stand-ins)."""
    properties = tp_pickle.tensor_properties(dtype_name)
    state_dict_metadata: dict = {}
    for key, saved in layout.tensors.items():
        state_dict_metadata[key] = tp_pickle.tensor_storage_metadata(
            properties, saved.shape, [tp_pickle.chunk_storage_metadata(c.offsets, c.sizes) for c in saved.chunks])
    for key in layout.objects:
        state_dict_metadata[key] = tp_pickle.bytes_storage_metadata()
    meta = tp_pickle.storage_meta(checkpoint_id, save_id or str(uuid.uuid4()))
    return tp_pickle.metadata(state_dict_metadata, storage_data, meta)


def _layer_order(layout: Layout):
    """(tensor, chunk index, chunk) with the layers outermost: the HF files are read front to back."""
    items = [(saved, index, chunk) for saved in layout.tensors.values() for index, chunk in enumerate(saved.chunks)]
    return sorted(items, key=lambda item: -1 if item[2].rule.layer is None and item[0].key.startswith("embedding")
                  else (item[2].rule.layer if item[2].rule.layer is not None else 1 << 30))


def _write_file(path: Path, data: bytes) -> None:
    with open(path, "wb") as fh:
        fh.write(data)
        fh.flush()
        os.fsync(fh.fileno())
