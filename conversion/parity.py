"""Numerical checks shared by ``verify`` and the dist tests: Megatron vs HF logits, export round trip.

:func:`parity_worker` runs on every rank of a gloo group of size ``tp * pp`` (spawned by
``megatron_arpo.device.local_ranks.run_distributed``): it builds the Megatron model for its rank in fp32, loads
the HF checkpoint through :func:`megatron_arpo.actor.hf_live.load_hf_into_megatron` (or a Megatron distributed
checkpoint through Megatron's own ``dist_checkpointing.load`` when ``megatron_dir`` is given), runs a
forward pass on fixed tokens (pipeline stages handed over with plain send/recv) and compares

- the logits with HF transformers' on the same tokens (max abs difference over the real vocabulary), and
- every tensor of :func:`megatron_arpo.actor.hf_live.export_hf_weights`, exported in the checkpoint's own dtype, with
  the original safetensors, bit for bit.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from megatron_arpo.actor import hf_live as live

from megatron_arpo.actor.model_builder import build_gpt_model, causal_attention_mask, initialize_model_parallel

from megatron_arpo.hf.checkpoint_io import HFCheckpointReader

from megatron_arpo.model_config import load_model_config, model_config_from_hf, read_hf_config

logger = logging.getLogger(__name__)


def hf_logits(hf_dir: str, tokens: torch.Tensor) -> torch.Tensor:
    # deferred: pulls in transformers (heavy; this module imports without it)
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(input_ids=tokens).logits.float()


def megatron_logits(model, cfg, tokens: torch.Tensor) -> torch.Tensor | None:
    """Full-vocab logits [batch, seq, vocab] on the last pipeline stage, None elsewhere."""
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import parallel_state as ps

    batch, seq = tokens.shape
    position_ids = torch.arange(seq).unsqueeze(0).expand(batch, seq)
    mask = causal_attention_mask(seq)
    pp_group = ps.get_pipeline_model_parallel_group()
    pp_ranks = torch.distributed.get_process_group_ranks(pp_group)
    pp_rank, pp_size = ps.get_pipeline_model_parallel_rank(), ps.get_pipeline_model_parallel_world_size()
    model.eval()
    with torch.no_grad():
        if pp_rank > 0:
            hidden = torch.empty(seq, batch, cfg.hidden_size)  # [seq, batch, hidden]
            torch.distributed.recv(hidden, src=pp_ranks[pp_rank - 1])
            model.set_input_tensor(hidden)
        out = model(tokens, position_ids, mask)
        if pp_rank < pp_size - 1:
            torch.distributed.send(out.contiguous(), dst=pp_ranks[pp_rank + 1])
            return None
    tp_group = ps.get_tensor_model_parallel_group()
    tp_size = torch.distributed.get_world_size(tp_group)
    parts = [torch.empty_like(out) for _ in range(tp_size)]
    torch.distributed.all_gather(parts, out.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)[..., : cfg.vocab_size]  # [batch, seq, vocab]


def load_megatron_dist_checkpoint(model, megatron_dir: str) -> None:
    """Load a Megatron distributed checkpoint into ``model`` with Megatron's own loader."""
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import dist_checkpointing

    from conversion.dist_ckpt import resolve_checkpoint_dir

    ckpt = resolve_checkpoint_dir(megatron_dir)
    state = dist_checkpointing.load(model.sharded_state_dict(), str(ckpt))
    result = model.load_state_dict(state, strict=False)
    missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
    if missing or result.unexpected_keys:
        raise ValueError(f"{ckpt}: loading left missing keys {missing} and unexpected keys {result.unexpected_keys}")


def parity_worker(rank: int, world_size: int, hf_dir: str, model_config: str | None, tp: int, pp: int,
                  tokens: torch.Tensor, megatron_dir: str | None = None) -> dict[str, Any]:
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import parallel_state as ps

    cfg = load_model_config(model_config) if model_config else model_config_from_hf(read_hf_config(hf_dir))
    initialize_model_parallel(tp, pp, seed=1234)
    model = build_gpt_model(cfg, tensor_parallel=tp, pipeline_parallel=pp, params_dtype=torch.float32,
                            use_te=False)
    if megatron_dir is None:
        live.load_hf_into_megatron(model, cfg, hf_dir, ps.get_tensor_model_parallel_rank(), tp,
                                   ps.get_pipeline_model_parallel_rank(), pp)
    else:
        load_megatron_dist_checkpoint(model, megatron_dir)
    logits = megatron_logits(model, cfg, tokens)
    result: dict[str, Any] = {"rank": rank, "max_abs_diff": None}
    if logits is not None:
        reference = hf_logits(hf_dir, tokens)
        result["max_abs_diff"] = (logits - reference).abs().max().item()
    reader = HFCheckpointReader(hf_dir)
    expected = set(reader.names())
    # The model runs in fp32; export in the checkpoint's own dtype (bf16 -> fp32 -> bf16 is exact), so a
    # bf16 checkpoint is compared bit for bit in bf16 rather than failing on dtype alone.
    ckpt_dtype = reader.read(sorted(expected)[0]).dtype
    mismatches, seen = [], []
    for name, tensor in live.export_hf_weights(model, cfg, bucket_bytes=1 << 20, dtype=ckpt_dtype):
        seen.append(name)
        if name not in expected:
            mismatches.append(f"{name}: exported but not in the original")
            continue
        original = reader.read(name)
        if original.dtype != tensor.dtype or original.shape != tensor.shape or not torch.equal(original, tensor):
            mismatches.append(f"{name}: differs (dtype {tensor.dtype} vs {original.dtype}, shape "
                              f"{list(tensor.shape)} vs {list(original.shape)})")
    missing = expected - set(seen)
    mismatches += [f"{name}: not exported" for name in sorted(missing)]
    if len(seen) != len(set(seen)):
        mismatches.append("some tensors were exported twice")
    result.update(num_exported=len(seen), mismatches=mismatches, dtype=str(ckpt_dtype).removeprefix("torch."))
    # The weight sync's path: this stage's buckets gathered on TP rank 0 only (None on the other TP ranks).
    sent, wrong, empty = [], [], 0
    for bucket in live.stage_hf_buckets(model, cfg, 1 << 20, tp_group=ps.get_tensor_model_parallel_group(),
                                        pp_rank=ps.get_pipeline_model_parallel_rank(), pp_size=pp, dst=0,
                                        dtype=ckpt_dtype):
        if bucket is None:
            empty += 1
            continue
        for name, tensor in bucket[1]:
            sent.append(name)
            if name not in expected or not torch.equal(reader.read(name), tensor):
                wrong.append(name)
    result.update(stage_sent=sent, stage_wrong=wrong, stage_empty_buckets=empty)
    return result
