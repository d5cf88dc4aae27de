"""``hf-to-megatron``: HF safetensors -> Megatron distributed checkpoint (``torch_dist``), streaming.

Layout Megatron uses (``GPTModel.sharded_state_dict()`` of megatron-core 0.16.1; a test compares it): keys use
the Transformer Engine names for both layer specs (``decoder.layers.self_attention.linear_qkv.layer_norm_weight``
for the local ``input_layernorm``), per-layer tensors are stacked on a leading layer axis
(``decoder.layers.mlp.linear_fc1.weight`` has global shape ``[num_layers, 2*ffn, hidden]``; one chunk per
layer at offset ``(layer, ...)``), ``linear_fc1`` goes through a swiglu factory that stores the gate half
at rows ``[0, ffn)`` and the up half at ``[ffn, 2*ffn)`` of the global tensor whatever the TP size, and the
embedding / output layer are saved with ``allow_shape_mismatch`` so a checkpoint padded for one TP size
loads at another. The format is chunk-based with global offsets, which is why one checkpoint loads at any
TP/PP/DP.

Writing (:func:`convert_hf_to_megatron`) is :func:`conversion.dcp_write.write_torch_dist`: the keys,
shapes and chunks come from our mapping tables; each chunk is copied as byte ranges of the safetensors
files into a ``torch.save`` record (or, when ``--dtype`` casts, built as a tensor, written and dropped).
Peak memory does not grow with the number of layers. No megatron-core import and no process group:
megatron-core alone costs several seconds per call.

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

import logging
import os
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

import yaml

from conversion.dcp_write import write_torch_dist
from megatron_arpo.hf import mapping
from megatron_arpo.hf.checkpoint_io import HFCheckpointReader, copy_tokenizer_files, dtype_name
from conversion.megatron_to_hf import (  # noqa: F401  (re-exported: the reading half)
    convert_megatron_to_hf, dist_key, find_model_config, resolve_checkpoint_dir)
from megatron_arpo.hf.config_json import store_original_config
from megatron_arpo.hf.outdir import atomic_output_dir, check_distinct_paths, check_output_dir, write_marker
from megatron_arpo.model_config import ModelConfig, model_config_from_hf, read_hf_config

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

def write_megatron_checkpoint(reader: HFCheckpointReader, cfg: ModelConfig, out: Path, tp: int,
                              dtype: torch.dtype | str | None = None) -> None:
    """Write the Megatron checkpoint files of ``reader``'s model into ``out`` (an existing empty dir).

    ``dtype`` (default: the checkpoint's) is a name or a ``torch.dtype``; torch is imported only to cast.
    """
    # As Megatron's Float16Module does for a bf16/fp16 run: norms too are stored in the params dtype.
    params_dtype = dtype_name(dtype) if dtype is not None else reader.locate("model.norm.weight").dtype
    write_torch_dist(reader, cfg, out, tp, params_dtype)


def convert_hf_to_megatron(hf_dir: str | os.PathLike, out: str | os.PathLike, tp: int = 1, pp: int = 1,
                           model_cfg: ModelConfig | None = None, overwrite: bool = False,
                           dtype: torch.dtype | str | None = None) -> Path:
    """``hf-to-megatron``: validate, then write the checkpoint atomically (temp dir, rename)."""
    check_distinct_paths(out, {"--hf": hf_dir})
    check_output_dir(out, overwrite)
    hf_config = read_hf_config(hf_dir)
    if model_cfg is None:
        model_cfg = model_config_from_hf(hf_config, name=Path(hf_dir).name)
    mapping.get_table(model_cfg.model_type)
    reader = HFCheckpointReader(hf_dir)
    mapping.validate_hf_checkpoint(reader, model_cfg)
    mapping.check_layout(model_cfg, tp, pp, "hf-to-megatron")
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
