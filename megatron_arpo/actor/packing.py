"""Packing variable-length sequences into micro-batches, and splitting a batch over data-parallel ranks.

Pure logic (torch for the tensors, no Megatron), shared by the local-spec path (explicit block-diagonal
mask) and the Transformer Engine path (THD layout with ``cu_seqlens``).

Packing (:func:`plan_micro_batches`, ``mode="packed"``):

1. Sequences go into *rows* by first-fit-decreasing (longest first; ties by input index, so the plan is
   a pure function of the lengths). A row holds up to ``max(row_tokens, longest sequence)`` tokens
   (within ``max_tokens``); ``row_tokens=None`` makes rows as wide as the longest sequence, which bounds
   the ``s x s`` cost of the dense masked attention of the local spec by what padding the longest
   sequence would cost anyway.
2. Rows, longest first, are grouped into *micro-batches* while ``rows x longest row`` stays within
   ``max_tokens`` and the next row is at least 90% as long as the first (``ROW_SLACK``: a short leftover
   row starts its own micro-batch instead of being padded). Every row of a micro-batch is padded to the
   micro-batch's longest row (rounded up to ``pad_to_multiple``), and nothing else is padded.

With ``row_tokens = max_tokens`` every micro-batch is one row (shape ``[1, s]``); the THD path (TE)
flattens a micro-batch's rows into one ``[1, T]`` row anyway.
``mode="padded"`` is the classic baseline kept for benchmarks: one sequence per row, in input order,
each micro-batch padded to its longest sequence.

In a row, sequence ``k`` occupies ``[offset_k, offset_k + len_k)``, attends only to itself
(:func:`block_causal_mask`), and has position ids ``0..len_k-1``. Padding slots form their own causal
segment (their outputs are never read). Next-token targets are shifted inside a sequence only: the
log-prob of token ``t >= 1`` of a sequence is read at row position ``offset + t - 1``; token 0 has none
(reported as 0, see :func:`unpack_token_values`).

:func:`split_for_data_parallel` cuts a batch (plain data: lists per sequence) into one shard per DP
rank. Sequences are first assigned to PPO mini-batches (``mini_batch_size`` prompt groups each, in
order of first appearance of their ``group_ids``), then each mini-batch is balanced over the ranks by
tokens (longest-processing-time greedy), so every rank runs the same number of optimizer steps with
about the same work.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import torch

logger = logging.getLogger(__name__)

PACKING_MODES = ("packed", "padded")
PAD_SEGMENT = -1
ROW_SLACK = 0.1  # packed mode: a row shorter than (1 - slack) x the micro-batch width starts a new micro-batch


@dataclass(frozen=True)
class PackedRow:
    """Sequences (indices into the caller's list) laid out back to back in one row."""

    seq_indices: tuple[int, ...]
    lengths: tuple[int, ...]
    starts: tuple[int, ...] | None = None  # explicit offsets (THD per-sequence padding); None = back to back

    @property
    def num_tokens(self) -> int:
        return sum(self.lengths)

    @property
    def offsets(self) -> tuple[int, ...]:
        if self.starts is not None:
            return self.starts
        out, pos = [], 0
        for length in self.lengths:
            out.append(pos)
            pos += length
        return tuple(out)


@dataclass(frozen=True)
class MicroBatchPlan:
    rows: tuple[PackedRow, ...]
    row_length: int  # every row is padded to this length

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.rows)

    @property
    def num_slots(self) -> int:
        return len(self.rows) * self.row_length

    @property
    def seq_indices(self) -> tuple[int, ...]:
        return tuple(i for r in self.rows for i in r.seq_indices)


def _round_up(value: int, multiple: int) -> int:
    return -(-value // multiple) * multiple


def plan_micro_batches(lengths: Sequence[int], max_tokens: int, *, row_tokens: int | None = None,
                       pad_to_multiple: int = 1, mode: str = "packed") -> list[MicroBatchPlan]:
    """Assign every sequence to exactly one row of one micro-batch (see the module docstring)."""
    if mode not in PACKING_MODES:
        raise ValueError(f"packing mode {mode!r} is not supported; allowed: {PACKING_MODES}")
    if max_tokens < 1 or pad_to_multiple < 1:
        raise ValueError(f"max_tokens ({max_tokens}) and pad_to_multiple ({pad_to_multiple}) must be >= 1")
    if row_tokens is not None and not 1 <= row_tokens <= max_tokens:
        raise ValueError(f"row_tokens {row_tokens} must be in [1, max_tokens={max_tokens}]")
    lengths = [int(n) for n in lengths]
    for i, n in enumerate(lengths):
        if n < 1:
            raise ValueError(f"sequence {i} is empty; every sequence needs at least one token")
        if _round_up(n, pad_to_multiple) > max_tokens:
            raise ValueError(
                f"sequence {i} has {n} tokens, more than the micro-batch budget of {max_tokens} tokens "
                f"(padded to a multiple of {pad_to_multiple}); raise actor.micro_batch_tokens "
                f"(or actor.logprob_micro_batch_tokens) to at least {_round_up(n, pad_to_multiple)}")
    if mode == "padded":
        rows = [PackedRow((i,), (n,)) for i, n in enumerate(lengths)]
        return _group_rows(rows, max_tokens, pad_to_multiple, sort=False)
    # First-fit decreasing into rows as wide as max(row_tokens, longest sequence).
    row_tokens = min(max_tokens, max(row_tokens or 0, _round_up(max(lengths, default=1), pad_to_multiple)))
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    loads: list[int] = []
    for i in order:
        need = lengths[i]
        for b, load in enumerate(loads):
            if _round_up(load + need, pad_to_multiple) <= row_tokens:
                bins[b].append(i)
                loads[b] += need
                break
        else:
            bins.append([i])
            loads.append(need)
    rows = [PackedRow(tuple(b), tuple(lengths[i] for i in b)) for b in bins]
    return _group_rows(rows, max_tokens, pad_to_multiple, sort=True)


def _group_rows(rows: list[PackedRow], max_tokens: int, multiple: int, sort: bool) -> list[MicroBatchPlan]:
    if sort:
        rows = sorted(rows, key=lambda r: (-r.num_tokens, r.seq_indices))
    plans: list[MicroBatchPlan] = []
    current: list[PackedRow] = []
    width = 0
    for row in rows:
        new_width = max(width, _round_up(row.num_tokens, multiple))
        too_short = sort and current and row.num_tokens < (1.0 - ROW_SLACK) * width
        if current and ((len(current) + 1) * new_width > max_tokens or too_short):
            plans.append(MicroBatchPlan(tuple(current), width))
            current, new_width = [], _round_up(row.num_tokens, multiple)
        current.append(row)
        width = new_width
    if current:
        plans.append(MicroBatchPlan(tuple(current), width))
    return plans


def pad_plans(plans: Sequence[MicroBatchPlan], shapes: Sequence[tuple[int, int]]) -> list[MicroBatchPlan]:
    """``plans`` grown to ``len(shapes)`` micro-batches, micro-batch ``i`` to ``shapes[i] = (rows, row_length)``.

    Used at expert parallelism > 1, where every rank of an expert-parallel group must run the same number
    of micro-batches of the same token count (``shapes`` is the group's element-wise maximum). Added rows
    and micro-batches hold no sequence: all padding, never a target, nothing unpacked from them.
    """
    if len(shapes) < len(plans):
        raise ValueError(f"{len(shapes)} shapes for {len(plans)} micro-batches; the agreed schedule must cover all")
    out = []
    for i, (rows, width) in enumerate(shapes):
        plan = plans[i] if i < len(plans) else MicroBatchPlan((), 0)
        if rows < len(plan.rows) or width < plan.row_length:
            raise ValueError(f"micro-batch {i} of shape ({len(plan.rows)}, {plan.row_length}) does not fit the "
                             f"agreed shape ({rows}, {width})")
        empty = PackedRow((), ())
        out.append(MicroBatchPlan(plan.rows + (empty,) * (rows - len(plan.rows)), width))
    return out


def padding_fraction(plans: Sequence[MicroBatchPlan]) -> float:
    """Share of the computed slots that are padding."""
    slots = sum(p.num_slots for p in plans)
    return 0.0 if slots == 0 else 1.0 - sum(p.num_tokens for p in plans) / slots


def build_row_tensors(plan: MicroBatchPlan, sequences: Sequence[Sequence[int] | torch.Tensor],
                      pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Token ids, position ids, next-token targets and segment ids of a micro-batch, all ``[b, s]``.

    ``targets`` hold the next token inside the same sequence and ``pad_id`` elsewhere; ``target_mask``
    is True exactly where a target exists.
    """
    b, s = len(plan.rows), plan.row_length
    tokens = torch.full((b, s), pad_id, dtype=torch.long)
    positions = torch.zeros((b, s), dtype=torch.long)
    segments = torch.full((b, s), PAD_SEGMENT, dtype=torch.long)
    targets = torch.full((b, s), pad_id, dtype=torch.long)
    target_mask = torch.zeros((b, s), dtype=torch.bool)
    for r, row in enumerate(plan.rows):
        for k, (idx, off, length) in enumerate(zip(row.seq_indices, row.offsets, row.lengths)):
            seq = torch.as_tensor(sequences[idx], dtype=torch.long)
            if seq.numel() != length:
                raise ValueError(f"sequence {idx} has {seq.numel()} tokens but the plan says {length}")
            tokens[r, off:off + length] = seq
            positions[r, off:off + length] = torch.arange(length)
            segments[r, off:off + length] = k
            targets[r, off:off + length - 1] = seq[1:]
            target_mask[r, off:off + length - 1] = True
    return {"tokens": tokens, "position_ids": positions, "segment_ids": segments,
            "targets": targets, "target_mask": target_mask}


def block_causal_mask(segment_ids: torch.Tensor) -> torch.Tensor:
    """``[b, 1, s, s]`` bool, True where attention is masked: a key in another segment or in the future."""
    s = segment_ids.shape[-1]
    same = segment_ids[:, :, None] == segment_ids[:, None, :]  # [b, s, s]
    causal = torch.ones(s, s, dtype=torch.bool, device=segment_ids.device).tril()
    return ~(same & causal)[:, None]


def thd_layout(plan: MicroBatchPlan, pad_to_multiple: int = 1) -> dict[str, Any]:
    """THD (``[1, T]``) layout of a micro-batch for Transformer Engine's packed attention.

    Returns ``plan`` (a one-row plan with every sequence starting at its padded offset), ``cu_seqlens``
    (real lengths) and ``cu_seqlens_padded`` (each sequence padded to ``pad_to_multiple``, which TE needs
    for context or sequence parallelism), both int32 ``[n + 1]``, plus ``max_seqlen`` and
    ``total_tokens`` (padded).
    """
    order = [i for r in plan.rows for i in r.seq_indices]
    lengths = [n for r in plan.rows for n in r.lengths]
    padded = [_round_up(n, pad_to_multiple) for n in lengths]
    # Offsets are host bookkeeping: computed in Python, turned into tensors only for the kernel.
    starts = list(itertools.accumulate(padded, initial=0))
    cu = torch.tensor(list(itertools.accumulate(lengths, initial=0)), dtype=torch.int32)
    cu_pad = torch.tensor(starts, dtype=torch.int32)
    flat = MicroBatchPlan((PackedRow(tuple(order), tuple(lengths), tuple(starts[:-1])),), starts[-1])
    return {"plan": flat, "cu_seqlens": cu, "cu_seqlens_padded": cu_pad, "max_seqlen": max(padded),
            "total_tokens": starts[-1]}


def unpack_token_values(plan: MicroBatchPlan, row_values: torch.Tensor) -> dict[int, torch.Tensor]:
    """Per-sequence values aligned with the tokens from ``[b, s]`` values computed at target positions.

    Token 0 of each sequence gets 0 (it has no prediction); token ``t`` gets ``row_values[offset+t-1]``.
    """
    out: dict[int, torch.Tensor] = {}
    for r, row in enumerate(plan.rows):
        for idx, off, length in zip(row.seq_indices, row.offsets, row.lengths):
            vals = torch.zeros(length, dtype=row_values.dtype)
            vals[1:] = row_values[r, off:off + length - 1]
            out[idx] = vals
    return out


def gather_row_values(plan: MicroBatchPlan, per_sequence: Sequence[Sequence[float] | torch.Tensor],
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Inverse of :func:`unpack_token_values`: token-aligned per-sequence values placed at target positions.

    ``per_sequence[i]`` (indexed by sequence index) has one value per token; value ``t`` lands at row
    position ``offset + t - 1`` (value 0 of every sequence is dropped: token 0 is never predicted).
    Per-sequence scalars (0-dim or length-1 entries for longer sequences) are broadcast over the tokens.
    """
    out = torch.zeros((len(plan.rows), plan.row_length), dtype=dtype)
    for r, row in enumerate(plan.rows):
        for idx, off, length in zip(row.seq_indices, row.offsets, row.lengths):
            vals = torch.as_tensor(per_sequence[idx], dtype=dtype)
            if vals.dim() == 0 or (vals.numel() == 1 and length > 1):
                out[r, off:off + length - 1] = vals.reshape(())
                continue
            if vals.numel() != length:
                raise ValueError(f"sequence {idx}: {vals.numel()} values for {length} tokens; per-token values "
                                 f"must be aligned with input_ids (one per token)")
            out[r, off:off + length - 1] = vals[1:]
    return out


# ----------------------------------------------------------------------------------------- DP split
def _num_sequences(batch: Mapping[str, Any]) -> int:
    if "input_ids" not in batch:
        raise ValueError(f"batch has no 'input_ids' (a list of token-id lists); keys: {sorted(batch)}")
    return len(batch["input_ids"])


def _is_per_sequence(value: Any, num: int) -> bool:
    if isinstance(value, torch.Tensor):
        return value.dim() >= 1 and value.shape[0] == num
    return isinstance(value, (list, tuple)) and len(value) == num


def _subset(value: Any, indices: Sequence[int]) -> Any:
    if isinstance(value, torch.Tensor):
        return value[torch.as_tensor(list(indices), dtype=torch.long)]
    return [value[i] for i in indices]


def assign_mini_batches(batch: Mapping[str, Any], mini_batch_size: int | None) -> list[int]:
    """Mini-batch index of each sequence: consecutive blocks of ``mini_batch_size`` prompt groups.

    Groups come from ``group_ids`` in order of first appearance; without ``group_ids`` every sequence is
    its own group. ``mini_batch_size=None`` puts everything in one mini-batch. An existing
    ``mini_batch`` entry is returned as is.
    """
    num = _num_sequences(batch)
    if "mini_batch" in batch:
        return [int(m) for m in batch["mini_batch"]]
    if mini_batch_size is None:
        return [0] * num
    if mini_batch_size < 1:
        raise ValueError(f"mini_batch_size must be >= 1, got {mini_batch_size}")
    groups = batch.get("group_ids")
    groups = list(range(num)) if groups is None else [g.item() if hasattr(g, "item") else g for g in groups]
    dense: dict[Any, int] = {}
    for g in groups:
        dense.setdefault(g, len(dense))
    return [dense[g] // mini_batch_size for g in groups]


def split_for_data_parallel(batch: Mapping[str, Any], dp_size: int, *,
                            mini_batch_size: int | None = None) -> list[dict[str, Any]]:
    """One shard per DP rank, balanced by tokens within each mini-batch (see the module docstring).

    Per-sequence entries (lists/tuples of length B, tensors with leading dim B, B = len(input_ids)) are
    subset; anything else is copied to every shard. Each shard gets ``sample_index`` (positions in the
    input batch, ascending), ``mini_batch`` (its mini-batch per sequence) and ``num_mini_batches``.
    Raises if a mini-batch has fewer sequences than ranks: every rank must take part in every step.
    """
    if dp_size < 1:
        raise ValueError(f"dp_size must be >= 1, got {dp_size}")
    num = _num_sequences(batch)
    mini = assign_mini_batches(batch, mini_batch_size)
    num_mini = max(mini) + 1 if mini else 0
    lengths = [len(s) for s in batch["input_ids"]]
    per_rank: list[list[int]] = [[] for _ in range(dp_size)]
    for m in range(num_mini):
        members = [i for i in range(num) if mini[i] == m]
        if len(members) < dp_size:
            raise ValueError(
                f"mini-batch {m} has {len(members)} sequence(s) for {dp_size} data-parallel ranks; every rank "
                f"needs at least one per optimizer step: raise actor.mini_batch_size or lower data_parallel")
        loads = [0] * dp_size
        counts = [0] * dp_size
        for i in sorted(members, key=lambda i: (-lengths[i], i)):
            rank = min(range(dp_size), key=lambda r: (counts[r] > 0, loads[r], r))  # each rank first gets one
            per_rank[rank].append(i)
            loads[rank] += lengths[i]
            counts[rank] += 1
    shards = []
    for rank in range(dp_size):
        idx = sorted(per_rank[rank])
        shard = {k: (_subset(v, idx) if _is_per_sequence(v, num) else v) for k, v in batch.items()}
        shard["sample_index"] = idx
        shard["mini_batch"] = [mini[i] for i in idx]
        shard["num_mini_batches"] = num_mini
        shards.append(shard)
    return shards


def merge_data_parallel_outputs(shards: Sequence[Mapping[str, Any]], outputs: Sequence[Sequence[Any]]) -> list:
    """Per-sequence outputs of each shard (in shard order) back into the order of the unsplit batch."""
    total = sum(len(s["sample_index"]) for s in shards)
    merged: list[Any] = [None] * total
    for shard, out in zip(shards, outputs):
        if len(out) != len(shard["sample_index"]):
            raise ValueError(f"a shard has {len(shard['sample_index'])} sequences but {len(out)} outputs")
        for pos, value in zip(shard["sample_index"], out):
            merged[pos] = value
    return merged
