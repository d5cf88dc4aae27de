"""``hf-to-megatron``: HF safetensors -> Megatron distributed checkpoint (``torch_dist``), streaming.

Layout Megatron uses (inspected from ``GPTModel.sharded_state_dict()`` of megatron-core 0.16.1): keys use
the Transformer Engine names for both layer specs (``decoder.layers.self_attention.linear_qkv.layer_norm_weight``
for the local ``input_layernorm``), per-layer tensors are stacked on a leading layer axis
(``decoder.layers.mlp.linear_fc1.weight`` has global shape ``[num_layers, 2*ffn, hidden]``; one chunk per
layer at offset ``(layer, ...)``), ``linear_fc1`` goes through a swiglu factory that stores the gate half
at rows ``[0, ffn)`` and the up half at ``[ffn, 2*ffn)`` of the global tensor whatever the TP size, and the
embedding / output layer are saved with ``allow_shape_mismatch`` so a checkpoint padded for one TP size
loads at another. The format is chunk-based with global offsets, which is why one checkpoint loads at any
TP/PP/DP.

Writing (:func:`convert_hf_to_megatron`): one process builds the TP=1/PP=1 GPTModel *on the meta device*
(vocab padded as a TP=T run pads it), takes its ``sharded_state_dict()`` and hands it to Megatron's own
``dist_checkpointing.save`` with :class:`LazyTorchDistSaveStrategy`. That strategy runs
torch.distributed.checkpoint with one writer thread and a planner whose ``resolve_data`` builds each chunk
(one layer's tensor, or half of ``linear_fc1``) from the safetensors file only when the writer asks for it;
the writer streams it to disk and drops it. Peak memory: the tensor being converted (a few copies of the
largest tensor), independent of the number of layers.

Reading is :mod:`conversion.megatron_to_hf` (no Megatron import there; its names are re-exported here).

Directory written by ``hf-to-megatron``::

    OUT/                       the Megatron checkpoint: metadata.json, .metadata, __0_0.distcp, common.pt
    OUT/conversion.json        {"format": "megatron-arpo-conversion", tp, pp, padded_vocab_size, source, ...}:
                               the report, and the marker that lets a later --overwrite replace OUT
    OUT/model_config.yaml      the model config (ModelConfig fields)
    OUT/hf_extra/config.json   the source config.json, byte for byte (megatron-to-hf carries it over)
    OUT/hf_extra/              tokenizer files and generation_config.json of the source
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
from pathlib import Path

import torch
import yaml

from conversion import mapping
from conversion.hf_io import HFCheckpointReader, copy_tokenizer_files
from conversion.megatron_to_hf import (  # noqa: F401  (re-exported: the reading half)
    convert_megatron_to_hf, dist_key, find_model_config, resolve_checkpoint_dir)
from megatron_arpo.model_config import ModelConfig, read_hf_config

logger = logging.getLogger(__name__)

_LAYER_PREFIX = "decoder.layers."


def _canonical_from_dist(key: str, global_offset: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """(canonical rule name, offsets within the per-layer tensor) of a saved chunk."""
    if not key.startswith(_LAYER_PREFIX):
        return key, tuple(global_offset)
    rest = key[len(_LAYER_PREFIX):]
    rest = {te: local for local, te in mapping.TE_ALIASES.items()}.get(rest, rest)
    return f"{_LAYER_PREFIX}{global_offset[0]}.{rest}", tuple(global_offset[1:])


class ChunkResolver:
    """Builds the bytes of one saved chunk from the HF checkpoint, caching the last full tensor.

    The two halves of ``linear_fc1`` are written back to back, so a one-entry cache turns the second half
    into a slice instead of a second read.
    """

    def __init__(self, reader: HFCheckpointReader, cfg: ModelConfig, padded_tp: int, dtype: torch.dtype | None):
        self.reader, self.cfg, self.padded_tp, self.dtype = reader, cfg, padded_tp, dtype
        self.rules = {r.megatron: r for r in mapping.bind_table(cfg)}
        self._cache: tuple[str, torch.Tensor] | None = None

    def full(self, name: str) -> torch.Tensor:
        if self._cache is not None and self._cache[0] == name:
            return self._cache[1]
        self._cache = None  # drop the previous tensor before building the next
        self.reader.release()
        rule = self.rules[name]
        if isinstance(rule.rule, mapping.VocabEmbedding):
            # TP=1 read with the row count a TP=padded_tp model has.
            tensor = rule.rule.read_shard(self.reader, _with_padding(self.cfg, self.padded_tp), 0, 1)
        else:
            tensor = rule.read_shard(self.reader, self.cfg, 0, 1)
        if self.dtype is not None:
            tensor = tensor.to(self.dtype)
        self._cache = (name, tensor)
        return tensor

    def chunk(self, key: str, global_offset: tuple[int, ...], local_shape: tuple[int, ...]) -> torch.Tensor:
        name, offsets = _canonical_from_dist(key, global_offset)
        if name not in self.rules:
            raise KeyError(f"checkpoint key {key!r} (offset {global_offset}) has no mapping rule ({name!r})")
        rule = self.rules[name]
        if isinstance(rule.rule, mapping.FusedGateUp):
            # TP=1 linear_fc1 is [gate; up]: each saved half is exactly one HF tensor, no concat needed.
            ffn = self.cfg.intermediate_size
            row = offsets[-2]
            if local_shape[-2] == ffn and row in (0, ffn):
                self._cache = None
                self.reader.release()
                source = rule.fill(rule.rule.gate if row == 0 else rule.rule.up)
                tensor = self.reader.read(source)
                return tensor.reshape(local_shape) if self.dtype is None else tensor.to(self.dtype).reshape(local_shape)
        out = self.full(name)
        inner_shape = local_shape[len(local_shape) - out.dim():]
        for dim, (start, size) in enumerate(zip(offsets[-out.dim():], inner_shape)):
            out = out.narrow(dim, start, size)
        # A view is fine: the DCP writer copies it only when it does not own its whole storage.
        return out.reshape(local_shape)


def _with_padding(cfg: ModelConfig, tp: int) -> ModelConfig:
    # padded_vocab_size(1) of the returned config equals cfg.padded_vocab_size(tp).
    return dataclasses.replace(cfg, make_vocab_size_divisible_by=cfg.make_vocab_size_divisible_by * tp)


def _lazy_strategy(resolver: ChunkResolver):
    from megatron.core.dist_checkpointing.strategies.torch import (
        MCoreSavePlanner, TorchDistSaveShardedStrategy, _replace_state_dict_keys_with_sharded_keys,
        mcore_to_pyt_state_dict)
    from torch.distributed import checkpoint as dcp
    from torch.distributed.checkpoint.planner import WriteItemType

    class LazySavePlanner(MCoreSavePlanner):
        def resolve_data(self, write_item):
            if write_item.type == WriteItemType.BYTE_IO:
                return super().resolve_data(write_item)
            chunk = write_item.tensor_data.chunk
            data = resolver.chunk(write_item.index.fqn, tuple(chunk.offsets), tuple(chunk.sizes))
            return data.to(write_item.tensor_data.properties.dtype)

    class LazyTorchDistSaveStrategy(TorchDistSaveShardedStrategy):
        """torch_dist format, one writer thread, tensors materialised on demand by the planner."""

        def save(self, sharded_state_dict, checkpoint_dir: Path):
            sharded_state_dict, _, _ = _replace_state_dict_keys_with_sharded_keys(sharded_state_dict, True)
            pyt_state_dict = mcore_to_pyt_state_dict(sharded_state_dict, False)
            writer = dcp.FileSystemWriter(str(checkpoint_dir), single_file_per_rank=True, thread_count=1,
                                          sync_files=True)
            planner = LazySavePlanner(dedup_replicated_tensors=False, flatten_state_dict=False)
            dcp.save(pyt_state_dict, storage_writer=writer, planner=planner)

    return LazyTorchDistSaveStrategy("torch_dist", 1, thread_count=1)


def write_megatron_checkpoint(reader: HFCheckpointReader, cfg: ModelConfig, out: Path, tp: int,
                              dtype: torch.dtype | None = None) -> None:
    """Write the Megatron checkpoint files of ``reader``'s model into ``out`` (an existing empty dir)."""
    from megatron.core import dist_checkpointing

    from conversion.meta import build_meta_gpt_model, single_process_group

    with single_process_group():
        params_dtype = dtype or reader.read("model.norm.weight").dtype
        model = build_meta_gpt_model(cfg, 1, 1, padded_vocab=cfg.padded_vocab_size(tp), params_dtype=params_dtype)
        # As Megatron's Float16Module does for a bf16/fp16 run: norms too are stored in the params dtype.
        model = model.to(params_dtype)
        sharded = model.sharded_state_dict()
        resolver = ChunkResolver(reader, cfg, tp, params_dtype)
        dist_checkpointing.save(sharded, str(out), sharded_strategy=_lazy_strategy(resolver),
                                validate_access_integrity=True)


def convert_hf_to_megatron(hf_dir: str | os.PathLike, out: str | os.PathLike, tp: int = 1, pp: int = 1,
                           model_cfg: ModelConfig | None = None, overwrite: bool = False,
                           dtype: torch.dtype | None = None) -> Path:
    """``hf-to-megatron``: validate, then write the checkpoint atomically (temp dir, rename)."""
    from conversion.config_json import store_original_config
    from conversion.live import validate_hf_checkpoint
    from conversion.outdir import atomic_output_dir, check_distinct_paths, check_output_dir, write_marker
    from megatron_arpo.actor.model_builder import build_transformer_config
    from megatron_arpo.model_config import model_config_from_hf

    check_distinct_paths(out, {"--hf": hf_dir})
    check_output_dir(out, overwrite)
    hf_config = read_hf_config(hf_dir)
    if model_cfg is None:
        model_cfg = model_config_from_hf(hf_config, name=Path(hf_dir).name)
    mapping.get_table(model_cfg.model_type)
    reader = HFCheckpointReader(hf_dir)
    validate_hf_checkpoint(reader, model_cfg)
    build_transformer_config(model_cfg, tensor_parallel=tp, pipeline_parallel=pp, use_te=False)  # divisibility
    with atomic_output_dir(out, overwrite) as tmp:
        write_megatron_checkpoint(reader, model_cfg, tmp, tp, dtype)
        with open(tmp / "model_config.yaml", "w") as fh:
            yaml.safe_dump(model_cfg.to_dict(), fh, sort_keys=False)
        store_original_config(hf_dir, tmp)
        extra = tmp / "hf_extra"
        copy_tokenizer_files(hf_dir, extra)
        if (Path(hf_dir) / "generation_config.json").exists():
            shutil.copyfile(Path(hf_dir) / "generation_config.json", extra / "generation_config.json")
        write_marker(tmp, {"direction": "hf-to-megatron", "tensor_parallel": tp, "pipeline_parallel": pp,
                           "padded_vocab_size": model_cfg.padded_vocab_size(tp), "model_type": model_cfg.model_type,
                           "source": str(Path(hf_dir).resolve())})
    logger.info("wrote Megatron checkpoint %s (padded for tp=%d)", out, tp)
    return Path(out)
