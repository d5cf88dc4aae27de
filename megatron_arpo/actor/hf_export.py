"""Write the live actor's weights as a Hugging Face checkpoint (for rollout engines, SFT output, save-time export).

Every rank of data-parallel replica 0 iterates ``megatron_arpo.actor.hf_live.export_hf_weights`` (TP gather, PP walk);
global rank 0 streams each tensor into pre-declared safetensors shards (``megatron_arpo.hf.checkpoint_io``), then writes
``config.json`` (from the model config), ``generation_config.json`` and the tokenizer files of the source
checkpoint. The directory appears atomically (temporary sibling, rename). With expert parallelism the
replicas holding the other experts iterate too (``worker.streams_hf_weights``). Other DP replicas only
wait at the final barrier.
"""

from __future__ import annotations

import logging
import os
import shutil
from pathlib import Path

import torch
import torch.distributed as dist

from megatron_arpo.hf import mapping

from megatron_arpo.hf.checkpoint_io import (
    SafetensorsShardWriter, TensorSpec, atomic_output_dir, copy_tokenizer_files, write_json,
)

from megatron_arpo.model_config import hf_config_dict

logger = logging.getLogger(__name__)

MAX_SHARD_BYTES = 5 * 10**9


def hf_tensor_specs(model_cfg, dtype: torch.dtype) -> list:
    specs = []
    for rule in mapping.bind_table(model_cfg):
        shapes = rule.hf_shapes(model_cfg)
        specs += [TensorSpec(name, tuple(shapes[name]), dtype) for name in rule.hf_outputs]
    return specs


def write_hf_checkpoint(worker, out_dir: str | os.PathLike, *, bucket_bytes: int = 256 * 2**20,
                        max_shard_bytes: int = MAX_SHARD_BYTES, overwrite: bool = True) -> Path | None:
    """Collective over all ranks of ``worker``'s group; returns the directory on global rank 0."""
    out = Path(out_dir)
    writer_rank = dist.get_rank() == 0
    result = None
    if worker.streams_hf_weights:
        dtype = worker.params_dtype
        if writer_rank:
            with atomic_output_dir(out, overwrite) as tmp:
                writer = SafetensorsShardWriter(tmp, hf_tensor_specs(worker.model_cfg, dtype), max_shard_bytes)
                try:
                    for bucket in worker.iter_weight_buckets(bucket_bytes):
                        for name, tensor in bucket:
                            writer.write(name, tensor.to(dtype))
                    writer.close()
                except BaseException:
                    writer.abort()
                    raise
                config = hf_config_dict(worker.model_cfg)
                config["torch_dtype"] = str(dtype).removeprefix("torch.")
                write_json(tmp / "config.json", config)
                source = worker._tokenizer_dir()
                if source:
                    copy_tokenizer_files(source, tmp)
                    if (Path(source) / "generation_config.json").exists():
                        shutil.copy2(Path(source) / "generation_config.json", tmp / "generation_config.json")
                else:
                    logger.warning("no tokenizer directory known (model.tokenizer / model.hf_checkpoint); %s has "
                                   "weights and config only", out)
            result = out
            logger.info("wrote HF checkpoint %s", out)
        else:
            for _ in worker.iter_weight_buckets(bucket_bytes):
                pass
    dist.barrier()
    return result
