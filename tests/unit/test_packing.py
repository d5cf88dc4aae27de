"""Packing plans, row tensors, block-causal masks and the data-parallel split (pure, no Megatron)."""

import random

import pytest
import torch

from megatron_arpo.actor import packing


def _check_plan_covers(plans, lengths, max_tokens):
    seen = sorted(i for p in plans for i in p.seq_indices)
    assert seen == list(range(len(lengths)))
    for p in plans:
        assert p.num_slots <= max_tokens
        for row in p.rows:
            assert row.num_tokens <= p.row_length
            assert list(row.lengths) == [lengths[i] for i in row.seq_indices]


def test_packed_plan_several_sequences_per_row_and_deterministic():
    lengths = [50, 10, 30, 5, 70, 20, 15, 60]
    plans = packing.plan_micro_batches(lengths, 100, row_tokens=100)
    _check_plan_covers(plans, lengths, 100)
    assert any(len(r.seq_indices) > 1 for p in plans for r in p.rows)
    assert packing.plan_micro_batches(lengths, 100, row_tokens=100) == plans
    # FFD: the 260 tokens fit in 3 rows of 100; one row per micro-batch, so nothing is padded.
    assert len(plans) == 3
    assert packing.padding_fraction(plans) == 0.0


def test_packed_padding_far_below_padded_on_skewed_lengths():
    rng = random.Random(0)
    lengths = [max(1, int(rng.paretovariate(1.2) * 20)) for _ in range(400)]
    lengths = [min(n, 1024) for n in lengths]
    packed = packing.plan_micro_batches(lengths, 2048)
    padded = packing.plan_micro_batches(lengths, 2048, mode="padded")
    _check_plan_covers(packed, lengths, 2048)
    _check_plan_covers(padded, lengths, 2048)
    assert packing.padding_fraction(packed) < 0.05
    assert packing.padding_fraction(padded) > 0.3


def test_row_tokens_splits_micro_batch_into_rows():
    lengths = [8, 8, 8, 8, 6, 2]
    plans = packing.plan_micro_batches(lengths, 32, row_tokens=16)
    _check_plan_covers(plans, lengths, 32)
    assert all(p.row_length <= 16 for p in plans)
    assert max(len(p.rows) for p in plans) == 2
    # Rows are at least as wide as the longest sequence.
    plans = packing.plan_micro_batches([30, 4, 4, 20, 10], 64, row_tokens=16)
    _check_plan_covers(plans, [30, 4, 4, 20, 10], 64)
    assert [r.seq_indices for p in plans for r in p.rows] == [(0,), (3, 4), (1, 2)]
    # Default: rows as wide as the longest sequence.
    plans = packing.plan_micro_batches([30, 4, 4, 20, 10], 64)
    assert [r.seq_indices for p in plans for r in p.rows] == [(0,), (3, 4), (1, 2)]


def test_pad_to_multiple_and_too_long_sequence():
    plans = packing.plan_micro_batches([5, 6], 16, pad_to_multiple=4)
    assert all(p.row_length % 4 == 0 for p in plans)
    with pytest.raises(ValueError, match="micro_batch_tokens"):
        packing.plan_micro_batches([10, 40], 32)
    with pytest.raises(ValueError, match="empty"):
        packing.plan_micro_batches([3, 0], 32)
    with pytest.raises(ValueError, match="packing mode"):
        packing.plan_micro_batches([3], 32, mode="bogus")


def test_row_tensors_targets_and_mask_block_diagonal():
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    plan = packing.MicroBatchPlan((packing.PackedRow((0, 1), (3, 2)), packing.PackedRow((2,), (4,))), 5)
    t = packing.build_row_tensors(plan, seqs, pad_id=0)
    assert t["tokens"].tolist() == [[1, 2, 3, 4, 5], [6, 7, 8, 9, 0]]
    assert t["position_ids"][0].tolist() == [0, 1, 2, 0, 1]
    assert t["targets"].tolist() == [[2, 3, 0, 5, 0], [7, 8, 9, 0, 0]]
    assert t["target_mask"].tolist() == [[True, True, False, True, False], [True, True, True, False, False]]
    mask = packing.block_causal_mask(t["segment_ids"])
    assert mask.shape == (2, 1, 5, 5)
    allowed = ~mask[0, 0]
    # Token 3 (first of sequence 1) sees only itself, not sequence 0.
    assert allowed[3].tolist() == [False, False, False, True, False]
    assert allowed[4].tolist() == [False, False, False, True, True]
    assert allowed[2].tolist() == [True, True, True, False, False]
    # Padding slot only sees itself.
    assert (~mask[1, 0])[4].tolist() == [False, False, False, False, True]


def test_unpack_and_gather_are_inverse_on_predicted_tokens():
    seqs = [[1, 2, 3], [4, 5], [6, 7, 8, 9]]
    plans = packing.plan_micro_batches([3, 2, 4], 6)
    values = [torch.tensor([0.0, 1.0, 2.0]), torch.tensor([0.0, 3.0]), torch.tensor([0.0, 4.0, 5.0, 6.0])]
    got = {}
    for plan in plans:
        row_values = packing.gather_row_values(plan, values)
        got.update(packing.unpack_token_values(plan, row_values))
    for i, v in enumerate(values):
        assert torch.equal(got[i], v)
    # Scalars broadcast over the predicted tokens.
    row = packing.gather_row_values(plans[0], [1.5, -2.0, 0.25])
    t = packing.build_row_tensors(plans[0], seqs)
    assert set(row[t["target_mask"]].tolist()) <= {1.5, -2.0, 0.25}
    with pytest.raises(ValueError, match="aligned"):
        packing.gather_row_values(plans[0], [[1.0, 2.0]] * 3)


def test_thd_layout_pads_each_sequence():
    plan = packing.MicroBatchPlan((packing.PackedRow((0, 1), (3, 6)),), 9)
    layout = packing.thd_layout(plan, pad_to_multiple=4)
    assert layout["cu_seqlens"].tolist() == [0, 3, 9]
    assert layout["cu_seqlens_padded"].tolist() == [0, 4, 12]
    assert layout["total_tokens"] == 12 and layout["max_seqlen"] == 8
    t = packing.build_row_tensors(layout["plan"], [[1, 2, 3], [4, 5, 6, 7, 8, 9]])
    assert t["tokens"].tolist() == [[1, 2, 3, 0, 4, 5, 6, 7, 8, 9, 0, 0]]
    assert t["position_ids"][0, 4:10].tolist() == list(range(6))


def test_split_for_data_parallel_balances_tokens_per_mini_batch():
    lengths = [100, 90, 10, 20, 50, 50, 5, 5]
    batch = {"input_ids": [[1] * n for n in lengths], "advantages": torch.arange(8.0),
             "group_ids": [0, 0, 1, 1, 2, 2, 3, 3], "temperature": 1.0}
    shards = packing.split_for_data_parallel(batch, 2, mini_batch_size=2)
    assert all(s["num_mini_batches"] == 2 for s in shards)
    assert sorted(i for s in shards for i in s["sample_index"]) == list(range(8))
    for s in shards:
        assert s["temperature"] == 1.0
        assert s["advantages"].tolist() == [float(i) for i in s["sample_index"]]
        assert s["mini_batch"] == [0 if i < 4 else 1 for i in s["sample_index"]]
        for m in (0, 1):
            assert m in s["mini_batch"]  # every rank takes part in every step
    loads = [sum(lengths[i] for i in s["sample_index"] if i < 4) for s in shards]
    assert sorted(loads) == [110, 110]
    merged = packing.merge_data_parallel_outputs(shards, [[f"o{i}" for i in s["sample_index"]] for s in shards])
    assert merged == [f"o{i}" for i in range(8)]


def test_split_rejects_mini_batch_smaller_than_dp():
    batch = {"input_ids": [[1, 2], [3, 4], [5]], "group_ids": [0, 1, 2]}
    with pytest.raises(ValueError, match="mini_batch_size"):
        packing.split_for_data_parallel(batch, 2, mini_batch_size=1)
    assert packing.assign_mini_batches(batch, None) == [0, 0, 0]
    assert packing.assign_mini_batches({"input_ids": [[1]] * 3}, 2) == [0, 0, 1]


def test_pad_plans_adds_empty_rows_and_micro_batches():
    seqs = [[1, 2, 3, 4, 5], [6, 7, 8]]
    plans = packing.plan_micro_batches([5, 3], 8)  # two micro-batches: [5] and [3]
    assert [(len(p.rows), p.row_length) for p in plans] == [(1, 5), (1, 3)]
    padded = packing.pad_plans(plans, [(2, 7), (1, 4), (1, 2)])
    assert [(len(p.rows), p.row_length) for p in padded] == [(2, 7), (1, 4), (1, 2)]
    assert [p.seq_indices for p in padded] == [(0,), (1,), ()]
    assert [p.num_tokens for p in padded] == [5, 3, 0]
    rows = packing.build_row_tensors(padded[0], seqs)
    assert not rows["target_mask"][1].any() and int(rows["target_mask"].sum()) == 4
    assert packing.unpack_token_values(padded[2], torch.ones(1, 2)) == {}
    assert float(packing.gather_row_values(padded[0], [[1.0] * 5, [1.0] * 3]).sum()) == 4.0
    with pytest.raises(ValueError, match="does not fit"):
        packing.pad_plans(plans, [(1, 4), (1, 3)])
    with pytest.raises(ValueError, match="must cover all"):
        packing.pad_plans(plans, [(1, 5)])
