"""``megatron-to-hf``: a Megatron ``torch_dist`` checkpoint -> HF safetensors, streaming, without Megatron.

The reader is :class:`conversion.dcp_read.DistCheckpointReader` (torch.distributed.checkpoint files and
our tables only: no process group, no megatron-core import, which alone costs several seconds per call,
and no torch import either unless some tensor has to go through memory).
Safetensors shards are planned up front (:class:`megatron_arpo.hf.checkpoint_io.SafetensorsShardWriter`), then every
rule of the table, in Megatron order, is written one of two ways:

- as bytes (:func:`copy_rule_bytes`): every reverse transform of the tables is a permutation of row blocks
  (q/k/v out of the per-group interleave, gate/up halves, the real vocabulary rows), and a ``torch_dist``
  chunk stores its rows back to back, so each HF tensor is a few ``os.copy_file_range`` calls from the
  ``.distcp`` files into the shard: what ``cp`` does, with no tensor in memory. This covers converted
  checkpoints and column-parallel splits;
- through memory (:func:`read_rule_tensors`) otherwise (row-parallel TP splits of training checkpoints,
  compressed storage): one layer's tensor is read, turned into HF tensors by the rule and written, then
  dropped. Peak memory is about one tensor, whatever the number of layers.

Directories accepted (see :func:`megatron_arpo.ckpt_format.torch_dist.resolve_checkpoint_dir`): ``DIR``
itself when it holds ``metadata.json``; else ``DIR/model``; else, for a training run directory with ``latest_checkpointed_iteration.txt``,
``DIR/iter_NNNNNNN`` (or its ``model`` subdir). The model config is ``--model-config`` or the first
``model_config.yaml`` found in the checkpoint dir or its parents up to ``DIR``. Keys must be Megatron's
own sharded keys (no prefix), as ``GPTModel.sharded_state_dict()`` makes.

Every chunk read is checked (:meth:`conversion.dcp_read.DistCheckpointReader.check_chunk`): the CRC-32 of
each entry of its ``torch.save`` record, and no NaN/Inf unless ``allow_nonfinite``; a byte-copied chunk
in a background thread while it is copied, all of them before the output directory is kept.

Output: safetensors shards (+ index), ``config.json`` carried over from the original
(:mod:`megatron_arpo.hf.config_json`), ``generation_config.json`` and tokenizer files, and ``conversion.json``:
the report (source, dtype, config.json origin and every field changed) and the marker that lets a later
``--overwrite`` replace this directory.
"""

from __future__ import annotations

import logging
import math
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from megatron_arpo.hf import mapping
from conversion.dcp_read import DistCheckpointReader, check_megatron_metadata
from megatron_arpo.ckpt_format.torch_dist import resolve_checkpoint_dir
from megatron_arpo.hf.checkpoint_io import (ELEMENT_SIZES, SafetensorsShardWriter, TensorSpec, copy_tokenizer_files,
                                            dtype_name, write_json)
from megatron_arpo.hf.config_json import write_config_json
from megatron_arpo.hf.outdir import atomic_output_dir, check_distinct_paths, check_output_dir, write_marker
from megatron_arpo.model_config import ModelConfig, model_config_from_dict
from megatron_arpo.progress import Progress

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

_LAYER_PREFIX = "decoder.layers."


def dist_key(rule: mapping.BoundRule) -> str:
    """The Megatron dist-checkpoint key of a rule's parameter (TE names, no layer or expert number)."""
    if rule.layer is None:
        return rule.megatron
    rest = rule.megatron[len(f"{_LAYER_PREFIX}{rule.layer}."):]
    if rule.expert is not None:  # SequentialMLP saves local_experts.<i> as experts, on a global-expert axis
        rest = rest.replace(f".local_experts.{rule.expert}.", ".experts.", 1)
    return _LAYER_PREFIX + mapping.TE_ALIASES.get(rest, rest)


def stacked_index(rule: mapping.BoundRule) -> tuple[int, ...]:
    """The rule's indices on the leading axes its tensor is stacked on: (), (layer,) or (layer, expert)."""
    if rule.layer is None:
        return ()
    return (rule.layer,) if rule.expert is None else (rule.layer, rule.expert)


def find_model_config(root: str | os.PathLike, ckpt: Path) -> ModelConfig:
    root = Path(root).resolve()
    here = ckpt.resolve()
    while True:
        path = here / "model_config.yaml"
        if path.exists():
            try:
                data = yaml.safe_load(path.read_text())
            except yaml.YAMLError as exc:
                raise ValueError(f"{path}: not valid YAML ({exc}); restore it or pass --model-config") from exc
            return model_config_from_dict(data, where=str(path))
        if here == root or here.parent == here:
            break
        here = here.parent
    raise FileNotFoundError(f"no model_config.yaml in {ckpt} or its parents up to {root}; pass --model-config")


def check_checkpoint(reader: DistCheckpointReader, cfg: ModelConfig) -> list[mapping.BoundRule]:
    """Every tensor the mapping needs is present with the model config's shapes; returns the rules to read."""
    rules = [r for r in mapping.bind_table(cfg) if r.hf_outputs]
    missing = sorted({dist_key(r) for r in rules} - set(reader.tensors))
    if missing:
        raise ValueError(f"{reader.dir}: checkpoint lacks {len(missing)} tensor(s) the {cfg.model_type} mapping "
                         f"needs: {missing}; is the model config right for this checkpoint?")
    for rule in rules:
        key = dist_key(rule)
        shape = reader.shape(key)
        inner = shape[len(stacked_index(rule)):]
        if rule.layer is not None and shape[0] != cfg.num_hidden_layers:
            raise ValueError(f"{reader.dir}: {key} has {shape[0]} layers, model config says {cfg.num_hidden_layers}")
        if rule.expert is not None and shape[1] != cfg.num_experts:
            raise ValueError(f"{reader.dir}: {key} has {shape[1]} experts, model config says {cfg.num_experts}")
        expected = rule.megatron_shape(cfg, 1)
        # The vocab rows are padded for some TP size: only the hidden dimension must match.
        vocab = isinstance(rule.rule, mapping.VocabEmbedding)
        if tuple(inner[1:] if vocab else inner) != tuple(expected[1:] if vocab else expected) or \
                (vocab and inner[0] < cfg.vocab_size):
            raise ValueError(f"{reader.dir}: {key} has per-layer shape {list(inner)}, expected {list(expected)} for "
                             f"model config {cfg.name!r}")
    return rules


def hf_specs(cfg: ModelConfig, reader: DistCheckpointReader, rules: list[mapping.BoundRule]) -> list[TensorSpec]:
    """Names, shapes and dtypes of the HF tensors the checkpoint will produce, in write order."""
    specs = []
    for rule in rules:
        dtype = reader.dtype(dist_key(rule))
        shapes = rule.hf_shapes(cfg)
        specs += [TensorSpec(name, shapes[name], dtype) for name in rule.hf_outputs]
    return specs


def read_rule_tensors(reader: DistCheckpointReader, cfg: ModelConfig,
                      rule: mapping.BoundRule) -> dict[str, torch.Tensor]:
    """The HF tensors of one rule, built in memory from its Megatron tensor (one layer of it)."""
    key = dist_key(rule)
    shape = reader.shape(key)
    index = stacked_index(rule)
    # one [1, (1,) ...] slice of the stacked tensor (the whole tensor when it is not stacked)
    full = reader.read(key, index + (0,) * (len(shape) - len(index)), (1,) * len(index) + tuple(shape[len(index):]))
    return rule.to_hf(full.reshape(shape[len(index):]), cfg)


def copy_rule_bytes(reader: DistCheckpointReader, writer, cfg: ModelConfig, rule: mapping.BoundRule) -> bool:
    """Write a rule's HF tensors as kernel-side copies of byte ranges of the checkpoint files.

    The rule's row blocks (:meth:`mapping.BoundRule.hf_row_blocks`) say which rows of the Megatron tensor
    make which rows of each HF tensor; :meth:`DistCheckpointReader.row_chunks` says where those rows are
    on disk. Returns False, having written nothing, when the rows are not stored whole (a row-parallel
    split) or plainly: the caller then goes through tensors.
    """
    chunks = reader.row_chunks(dist_key(rule), stacked_index(rule))
    if chunks is None:
        return False
    element = ELEMENT_SIZES[reader.dtype(dist_key(rule))]
    blocks = rule.hf_row_blocks(cfg)
    for name, shape in rule.hf_shapes(cfg).items():
        if name in blocks and math.prod(shape[1:]) * element != chunks[0].row_bytes:
            return False
    for name, name_blocks in blocks.items():
        for start, rows, dst in name_blocks:
            for chunk in chunks:
                lo, hi = max(start, chunk.row), min(start + rows, chunk.row + chunk.rows)
                if lo < hi:
                    writer.copy_range(name, chunk.fd, chunk.offset + (lo - chunk.row) * chunk.row_bytes,
                                      (hi - lo) * chunk.row_bytes, (dst + lo - start) * chunk.row_bytes)
    return True


def convert_megatron_to_hf(megatron_dir: str | os.PathLike, out: str | os.PathLike, *,
                           tokenizer: str | os.PathLike | None = None, max_shard_size: int = 5 * 10**9,
                           model_cfg: ModelConfig | None = None, overwrite: bool = False,
                           byte_copy: bool = True, allow_nonfinite: bool = False) -> Path:
    """Write the HF checkpoint; its ``conversion.json`` is the report (see the module docstring)."""
    ckpt = resolve_checkpoint_dir(megatron_dir)
    check_distinct_paths(out, {"--megatron": ckpt, "--tokenizer": tokenizer})
    check_output_dir(out, overwrite)
    check_megatron_metadata(ckpt)
    if model_cfg is None:
        model_cfg = find_model_config(megatron_dir, ckpt)
    mapping.get_table(model_cfg.model_type)
    reader = DistCheckpointReader(ckpt, allow_nonfinite=allow_nonfinite)
    try:
        rules = check_checkpoint(reader, model_cfg)
        specs = hf_specs(model_cfg, reader, rules)
        extra = ckpt / "hf_extra"
        with atomic_output_dir(out, overwrite) as tmp:
            writer = SafetensorsShardWriter(tmp, specs, max_shard_size)
            copied = 0
            nbytes = {spec.name: spec.nbytes for spec in specs}
            report = Progress("megatron-to-hf", len(specs), unit="tensor", rate_unit="MB")
            try:
                for rule in rules:
                    if byte_copy and copy_rule_bytes(reader, writer, model_cfg, rule):
                        copied += len(rule.hf_outputs)
                    else:
                        for name, tensor in read_rule_tensors(reader, model_cfg, rule).items():
                            writer.write(name, tensor)
                    report.update(len(rule.hf_outputs), sum(nbytes[n] for n in rule.hf_outputs) / 1e6)
                report.close()
                reader.finish_checks()  # the byte-copied chunks, checked alongside the copies
                writer.close()
            except BaseException:
                writer.abort()
                raise
            logger.info("%d of %d tensors copied as byte ranges, the rest through memory", copied, len(specs))
            config_report = write_config_json(tmp, ckpt, model_cfg, dtype_name(specs[0].dtype))
            tok_src = Path(tokenizer) if tokenizer else (extra if extra.exists() else None)
            tok_files = copy_tokenizer_files(tok_src, tmp) if tok_src else []
            gen = (tok_src / "generation_config.json") if tok_src else None
            if gen is not None and gen.exists():
                shutil.copyfile(gen, tmp / "generation_config.json")
            else:
                write_json(tmp / "generation_config.json", {
                    k: v for k, v in {"bos_token_id": model_cfg.bos_token_id,
                                      "eos_token_id": model_cfg.eos_token_id}.items() if v is not None})
            if not tok_files:
                logger.warning("no tokenizer files copied; pass --tokenizer DIR to include them")
            write_marker(tmp, {"direction": "megatron-to-hf", "source": str(ckpt.resolve()),
                               "model_type": model_cfg.model_type, "dtype": dtype_name(specs[0].dtype),
                               "num_tensors": len(specs), "byte_copied_tensors": copied, "tokenizer_files": tok_files,
                               "config_json": config_report})
    finally:
        reader.close()
    return Path(out)
