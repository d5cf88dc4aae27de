"""Per-token log-probs and entropy from vocab-parallel logits, and the model inputs of a packed micro-batch.

Vocab-parallel computation (:func:`vocab_parallel_logprobs`): each tensor-parallel rank holds the logits
of its vocabulary slice ``[vocab_start, vocab_start + v/tp)``; full logits are never gathered.

    m      = all-reduce MAX over TP of the local max               (no gradient: the shift cancels)
    S      = all-reduce SUM of sum_v exp(l_v - m)                  -> lse = m + log S
    l_tgt  = all-reduce SUM of the target logit (0 on ranks that do not own the target)
    logp   = l_tgt - lse
    H      = lse - all-reduce SUM of sum_v p_v * l_v,  p_v = exp(l_v - lse)

The sums use an all-reduce whose backward is the identity (every TP rank holds the same loss, so the
gradient of a replicated sum w.r.t. each rank's local part is the upstream gradient). Rows of the padded
vocabulary (``padded_vocab_size(tp) > vocab_size``) are set to -inf before anything else, so they carry
no probability mass: the HF model has no such rows. Logits are divided by ``temperature`` first (as the
rollout sampled), in float32.

Positions of packed sequences: Megatron's ``GPTModel`` computes RoPE for positions ``0..s-1`` of a row
and ignores ``position_ids``. RoPE is relative, so packed sequences would be exact in real arithmetic, but
float32 angles at large row offsets differ from the HF model's per-sequence positions. :func:`install_position_rope`
makes the model's rotary module use the per-sequence position ids of the current micro-batch instead
(local spec only; the THD path hands ``cu_seqlens`` to Transformer Engine, which restarts positions per
sequence itself).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from megatron_arpo.actor import packing, routing_replay

logger = logging.getLogger(__name__)


class _AllReduceSum(torch.autograd.Function):
    """Sum over a process group; backward passes the gradient through unchanged."""

    @staticmethod
    def forward(ctx, tensor: torch.Tensor, group) -> torch.Tensor:
        out = tensor.clone()
        dist.all_reduce(out, op=dist.ReduceOp.SUM, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad, None


def _sum_over(tensor: torch.Tensor, group, size: int) -> torch.Tensor:
    return tensor if size == 1 else _AllReduceSum.apply(tensor, group)


def vocab_parallel_logprobs(logits: torch.Tensor, targets: torch.Tensor, *, vocab_start: int, vocab_size: int,
                            tp_group=None, with_entropy: bool = False, temperature: float = 1.0
                            ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(logp, entropy)`` of ``targets`` under this rank's logit slice ``[..., v_local]``.

    ``targets`` hold global token ids (< ``vocab_size``). ``entropy`` is None unless asked. Differentiable
    in ``logits`` for both outputs. ``tp_group=None`` means a single rank holding the whole vocabulary.
    """
    tp_size = 1 if tp_group is None else dist.get_world_size(tp_group)
    x = logits.float()  # [b, s, v/tp]
    if temperature != 1.0:
        x = x / temperature
    v_local = x.shape[-1]
    columns = torch.arange(vocab_start, vocab_start + v_local, device=x.device)
    valid = columns < vocab_size  # [v/tp]
    if not bool(valid.all()):
        x = x.masked_fill(~valid, float("-inf"))
    with torch.no_grad():
        shift = x.max(dim=-1).values  # [b, s]; -inf on a rank whose whole slice is padding
        if tp_size > 1:
            dist.all_reduce(shift, op=dist.ReduceOp.MAX, group=tp_group)
    exp = torch.exp(x - shift.unsqueeze(-1))  # padded rows: exp(-inf) = 0
    sum_exp = _sum_over(exp.sum(dim=-1), tp_group, tp_size)
    lse = shift + torch.log(sum_exp)  # [b, s]

    local_t = targets - vocab_start
    owned = (local_t >= 0) & (local_t < v_local)
    picked = x.gather(-1, local_t.clamp(0, v_local - 1).unsqueeze(-1)).squeeze(-1)
    target_logit = _sum_over(torch.where(owned, picked, torch.zeros_like(picked)), tp_group, tp_size)
    logp = target_logit - lse

    entropy = None
    if with_entropy:
        probs = exp / sum_exp.unsqueeze(-1)
        weighted = torch.where(valid, probs * x, torch.zeros_like(x)).sum(dim=-1)  # 0 * -inf avoided
        entropy = lse - _sum_over(weighted, tp_group, tp_size)
    return logp, entropy


# ------------------------------------------------------------------------------------ RoPE positions
class _RopePositions(threading.local):
    position_ids: torch.Tensor | None = None


def install_position_rope(model: torch.nn.Module) -> _RopePositions:
    """Make ``model.rotary_pos_emb`` (a Megatron ``RotaryEmbedding``) follow explicit position ids.

    Returns a handle: set ``handle.position_ids`` (``[b, s]``) before a forward; ``None`` restores the
    stock behaviour (positions ``0..s-1``). The override is an instance attribute, so the module, its
    state dict and checkpoints are unchanged.
    """
    rope = getattr(model, "rotary_pos_emb", None)
    if rope is None:
        raise ValueError("model has no rotary_pos_emb; install_position_rope needs a GPTModel with RoPE")
    if getattr(rope, "rotary_interleaved", False) or getattr(rope, "seq_len_interpolation_factor", None):
        raise NotImplementedError("install_position_rope supports plain (non-interleaved, non-scaled) RoPE only")
    handle = _RopePositions()
    stock = rope.forward

    def forward(max_seq_len: int, offset: int = 0, packed_seq: bool = False, cp_group=None):
        pos = handle.position_ids
        if pos is None or packed_seq:
            return stock(max_seq_len, offset, packed_seq, cp_group)
        if pos.shape[-1] != max_seq_len:
            raise ValueError(f"position ids cover {pos.shape[-1]} tokens but the model runs {max_seq_len}")
        inv_freq = rope.inv_freq.to(pos.device)
        freqs = (pos.to(inv_freq.dtype) + offset).unsqueeze(-1) * inv_freq  # [b, s, dim/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [b, s, dim], halves as Megatron lays them out
        return emb.transpose(0, 1).unsqueeze(2)  # [s, b, 1, dim] broadcasts over heads

    rope.forward = forward
    return handle


# ------------------------------------------------------------------------------------- micro-batches
@dataclass
class MicroBatch:
    """Model inputs of one packed micro-batch plus per-position training inputs (``[b, s]`` each).

    ``extras`` hold token-aligned per-sequence values moved to their target positions
    (:func:`packing.gather_row_values`), e.g. ``loss_mask``, ``advantages``, ``old_logprobs``.
    """

    plan: packing.MicroBatchPlan
    tokens: torch.Tensor
    position_ids: torch.Tensor
    targets: torch.Tensor
    target_mask: torch.Tensor
    attention_mask: torch.Tensor | None = None
    packed_seq_params: Any = None
    extras: dict[str, torch.Tensor] = field(default_factory=dict)
    routing: torch.Tensor | None = None  # routing replay: [b, s, layers, topk] recorded experts (routing_replay)


def build_micro_batch(plan: packing.MicroBatchPlan, sequences, extras: dict[str, Any] | None = None, *,
                      use_thd: bool = False, pad_to_multiple: int = 1, pad_id: int = 0) -> MicroBatch:
    """Tensors for one micro-batch: a block-causal mask (local spec) or THD ``PackedSeqParams`` (TE)."""
    if use_thd:
        return _build_thd_micro_batch(plan, sequences, extras or {}, pad_to_multiple, pad_id)
    rows = packing.build_row_tensors(plan, sequences, pad_id=pad_id)
    mb = MicroBatch(plan=plan, tokens=rows["tokens"], position_ids=rows["position_ids"],
                    targets=rows["targets"], target_mask=rows["target_mask"],
                    attention_mask=packing.block_causal_mask(rows["segment_ids"]))
    for key, values in (extras or {}).items():
        mb.extras[key] = packing.gather_row_values(plan, values)
    return mb


def _build_thd_micro_batch(plan, sequences, extras, pad_to_multiple, pad_id) -> MicroBatch:
    """All sequences of the micro-batch in one ``[1, T]`` row, each padded to ``pad_to_multiple``.

    Written for Transformer Engine on GPU; not exercised on CPU, where TE does not exist.
    """
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core.packed_seq_params import PackedSeqParams

    layout = packing.thd_layout(plan, pad_to_multiple)
    flat = layout["plan"]
    rows = packing.build_row_tensors(flat, sequences, pad_id=pad_id)
    cu, cu_pad = layout["cu_seqlens"].cuda(), layout["cu_seqlens_padded"].cuda()
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=cu_pad,
                             cu_seqlens_kv_padded=cu_pad, max_seqlen_q=layout["max_seqlen"],
                             max_seqlen_kv=layout["max_seqlen"])
    mb = MicroBatch(plan=flat, tokens=rows["tokens"], position_ids=rows["position_ids"], targets=rows["targets"],
                    target_mask=rows["target_mask"], packed_seq_params=params)
    for key, values in extras.items():
        mb.extras[key] = packing.gather_row_values(flat, values)
    return mb


def run_model(model, mb: MicroBatch, rope: _RopePositions | None) -> torch.Tensor:
    """One forward of the (possibly DDP-wrapped) GPTModel stage; logits ``[b, s, v/tp]`` on the last stage."""
    tokens, positions, mask = mb.tokens, mb.position_ids, mb.attention_mask
    if torch.cuda.is_available():  # batches are built on the CPU
        tokens, positions = tokens.cuda(non_blocking=True), positions.cuda(non_blocking=True)
        mask = mask.cuda(non_blocking=True) if mask is not None else None
    if rope is not None:
        rope.position_ids = None if mb.packed_seq_params is not None else positions
    if mb.routing is not None:
        routing_replay.set_routing(model, mb.routing)
    try:
        return model(tokens, positions, mask, packed_seq_params=mb.packed_seq_params)
    finally:
        if rope is not None:
            rope.position_ids = None
        if mb.routing is not None:
            routing_replay.clear_routing(model)
