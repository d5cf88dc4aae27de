"""Load HF weights into a live Megatron model and export HF-named full tensors from one, via the tables.

Used by the trainer (initial load with no pre-conversion step, weight sync to the rollout engines) and by
``verify``. Both functions take the model chunk(s) of *this* rank: a ``GPTModel`` (possibly wrapped in
DDP / Float16Module, whose ``module.`` prefixes are stripped) or a one-element list of them. Virtual
pipeline stages (several chunks per rank) are not supported yet and are rejected.

- :func:`load_hf_into_megatron` reads only the rows/columns of the HF tensors this (tp, pp) rank holds,
  lazily from safetensors (``safe_open`` + ``get_slice``): memory is this rank's shards, not the model.
  Before copying it checks the HF config against the model config, coverage of the HF tensors, their
  shapes, and that every parameter of the stage gets exactly one tensor of the right shape.
- :func:`export_hf_weights` is a generator of ``(hf_name, full tensor)`` that every rank of the TP x PP
  grid iterates in lockstep and that yields the same sequence on every rank: each tensor's TP shards are
  gathered on the TP group (``all_gather``), turned into HF tensors by the table (vocab trimmed, no
  ``lm_head`` when tied), and the owning pipeline stage broadcasts them to the other stages bucket by
  bucket (metadata is sent with every bucket: nothing is cached across calls).
"""

from __future__ import annotations

import logging
import os
from typing import Iterator, Sequence

import torch

from conversion import mapping
from conversion.hf_io import HFCheckpointReader
from megatron_arpo.model_config import ModelConfig, check_hf_config, read_hf_config

logger = logging.getLogger(__name__)

DEFAULT_BUCKET_BYTES = 256 * 2**20


def _single_chunk(models) -> torch.nn.Module:
    if isinstance(models, torch.nn.Module):
        return models
    models = list(models)
    if len(models) != 1:
        raise NotImplementedError(
            f"got {len(models)} model chunks on this rank; virtual pipeline parallelism is not supported by "
            f"the converter yet, use one chunk per pipeline stage")
    return models[0]


def stage_parameters(models, cfg: ModelConfig, pp_rank: int, pp_size: int) -> dict[str, torch.nn.Parameter]:
    """This stage's parameters keyed by canonical name (global layer numbers, local-spec norm names)."""
    offset = mapping.stage_layers(cfg, pp_rank, pp_size).start
    params = {}
    for name, param in _single_chunk(models).named_parameters():
        params[mapping.canonical_megatron_name(name, offset)] = param
    return params


def _optional_output(cfg: ModelConfig):
    # Tied models: the output layer shares the embedding on a single stage, so it has no parameter.
    return lambda rule: isinstance(rule.rule, mapping.VocabEmbedding) and rule.rule.is_tied(cfg) \
        and rule.megatron == "output_layer.weight"


def validate_hf_checkpoint(reader: HFCheckpointReader, cfg: ModelConfig, check_config: bool = True) -> list:
    """Config, coverage and shape checks on an HF checkpoint; returns the bound table."""
    if check_config:
        check_hf_config(cfg, read_hf_config(reader.dir), hf_where=str(reader.dir / "config.json"))
    bound = mapping.bind_table(cfg)
    mapping.check_hf_coverage(bound, reader.names(), str(reader.dir))
    mapping.check_hf_shapes(bound, cfg, reader.shapes(), str(reader.dir))
    check_hf_dtypes(reader)
    return bound


def check_hf_dtypes(reader: HFCheckpointReader) -> None:
    """All tensors must share one floating dtype; name the ones that do not."""
    by_dtype: dict[str, list[str]] = {}
    for name in reader.names():
        by_dtype.setdefault(reader.dtype(name), []).append(name)
    majority = max(by_dtype, key=lambda d: len(by_dtype[d]))
    problems = []
    if majority not in ("F32", "BF16", "F16"):
        problems.append(f"tensors are {majority}; expected a floating dtype (F32, BF16 or F16)")
    for dtype, names in sorted(by_dtype.items()):
        if dtype != majority:
            problems.append(f"{len(names)} tensor(s) are {dtype} while {len(by_dtype[majority])} are {majority}: "
                            f"{names[:10]}")
    if problems:
        raise ValueError(f"{reader.dir}: dtype mismatch: " + "; ".join(problems)
                         + ". Re-save the checkpoint in one dtype.")


@torch.no_grad()
def load_hf_into_megatron(models, model_cfg: ModelConfig, hf_dir: str | os.PathLike, tp_rank: int, tp_size: int,
                          pp_rank: int, pp_size: int, *, check_config: bool = True) -> list[str]:
    """Copy this rank's shards of an HF checkpoint into the live model; returns the parameters loaded."""
    reader = HFCheckpointReader(hf_dir)
    bound = validate_hf_checkpoint(reader, model_cfg, check_config)
    rules = mapping.rules_for_stage(bound, model_cfg, pp_rank, pp_size)
    params = stage_parameters(models, model_cfg, pp_rank, pp_size)
    where = f"Megatron model (tp_rank {tp_rank}/{tp_size}, pp_rank {pp_rank}/{pp_size})"
    mapping.check_megatron_coverage(rules, params, where, optional=_optional_output(model_cfg))
    loaded = []
    for rule in rules:
        param = params.get(rule.megatron)
        if param is None:
            continue
        shard = rule.read_shard(reader, model_cfg, tp_rank, tp_size)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(
                f"{where}: {rule.megatron} has shape {list(param.shape)} but the mapping built {list(shard.shape)} "
                f"from {list(rule.hf_sources)}; the model was built with a different config than {model_cfg.name!r}")
        param.data.copy_(shard)
        loaded.append(rule.megatron)
    logger.info("loaded %d tensors from %s into tp_rank %d pp_rank %d", len(loaded), hf_dir, tp_rank, pp_rank)
    return loaded


def _gather_full(rule: mapping.BoundRule, param: torch.Tensor, tp_group, tp_size: int) -> torch.Tensor:
    local = param.detach().contiguous()
    if tp_size == 1 or rule.shard is mapping.Shard.REPLICATED:
        return local
    shards = [torch.empty_like(local) for _ in range(tp_size)]
    torch.distributed.all_gather(shards, local, group=tp_group)
    return mapping.unshard(rule.shard, shards)


def _stage_hf_tensors(models, cfg, pp_rank, pp_size, tp_group, tp_size, dtype) -> Iterator[tuple[str, torch.Tensor]]:
    params = stage_parameters(models, cfg, pp_rank, pp_size)
    for rule in mapping.rules_for_stage(mapping.bind_table(cfg), cfg, pp_rank, pp_size):
        if not rule.hf_outputs:
            continue  # tied output layer: HF has no lm_head
        full = _gather_full(rule, params[rule.megatron], tp_group, tp_size)
        for name, tensor in rule.to_hf(full, cfg).items():
            yield name, tensor.to(dtype) if dtype is not None else tensor


def _broadcast_bucket(items: Sequence[tuple[str, torch.Tensor]] | None, src: int, group) -> list | None:
    """Owner sends names/shapes/dtypes then one flat byte buffer; others rebuild the tensors."""
    meta = [None]
    if items is not None:
        meta = [[(name, tuple(t.shape), t.dtype) for name, t in items]]
    torch.distributed.broadcast_object_list(meta, src=src, group=group)
    if meta[0] is None:
        return None
    sizes = [torch.Size(shape).numel() * torch.empty((), dtype=dt).element_size() for _, shape, dt in meta[0]]
    # The bytes travel on the group's device: the current GPU under NCCL, the host under gloo.
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    if items is not None:
        flat = torch.cat([t.contiguous().view(-1).view(torch.uint8) for _, t in items]).to(device) if items else \
            torch.empty(0, dtype=torch.uint8, device=device)
    else:
        flat = torch.empty(sum(sizes), dtype=torch.uint8, device=device)
    torch.distributed.broadcast(flat, src=src, group=group)
    if items is not None:
        return list(items)
    out, pos = [], 0
    for (name, shape, dt), size in zip(meta[0], sizes):
        out.append((name, flat[pos:pos + size].view(dt).view(shape)))
        pos += size
    return out


def export_hf_weights(models, model_cfg: ModelConfig, bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                      tp_group=None, pp_group=None, dtype: torch.dtype | None = None
                      ) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` for the whole model on every rank (collective: all ranks iterate).

    Groups default to Megatron's parallel state. Memory per rank: one bucket (``bucket_bytes``, or one
    tensor if larger) plus one gathered tensor.
    """
    from megatron.core import parallel_state

    tp_group = tp_group if tp_group is not None else parallel_state.get_tensor_model_parallel_group()
    pp_group = pp_group if pp_group is not None else parallel_state.get_pipeline_model_parallel_group()
    tp_size = torch.distributed.get_world_size(tp_group)
    pp_size = torch.distributed.get_world_size(pp_group)
    pp_rank = torch.distributed.get_rank(pp_group)
    pp_ranks = torch.distributed.get_process_group_ranks(pp_group)
    for stage in range(pp_size):
        if pp_size == 1:
            yield from _stage_hf_tensors(models, model_cfg, stage, pp_size, tp_group, tp_size, dtype)
            continue
        if stage == pp_rank:
            bucket, size = [], 0
            for name, tensor in _stage_hf_tensors(models, model_cfg, stage, pp_size, tp_group, tp_size, dtype):
                bucket.append((name, tensor))
                size += tensor.numel() * tensor.element_size()
                if size >= bucket_bytes:
                    yield from _broadcast_bucket(bucket, pp_ranks[stage], pp_group)
                    bucket, size = [], 0
            if bucket:
                yield from _broadcast_bucket(bucket, pp_ranks[stage], pp_group)
            _broadcast_bucket(None, pp_ranks[stage], pp_group)  # end of stage
        else:
            while (received := _broadcast_bucket(None, pp_ranks[stage], pp_group)) is not None:
                yield from received
