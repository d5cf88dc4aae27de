"""Routing replay (R3): ``actor.moe_routing_replay`` in the config, and a micro-batch's recorded-expert layout."""

from __future__ import annotations

import pytest
import torch

from megatron_arpo.actor import packing
from megatron_arpo.actor.routing_replay import NOT_RECORDED, gather_routing, split_recorded
from megatron_arpo.config import ConfigError
from support.configs import tiny_config

MOE = {"config": "tiny-qwen3-moe"}


def test_replay_is_accepted_for_an_moe_model():
    assert tiny_config(model=MOE, actor={"moe_routing_replay": True}).actor.moe_routing_replay


@pytest.mark.parametrize(("model", "actor", "expected"), [
    ({"config": "tiny-qwen3"}, {"moe_routing_replay": True},
     "actor.moe_routing_replay: tiny-qwen3 is a dense model (no routed experts); set actor.moe_routing_replay: false"),
    (MOE, {"moe_routing_replay": True, "recompute": "selective"},
     "actor.moe_routing_replay with actor.recompute: selective: the recomputed forward would route again after the "
     "next micro-batch's routing is set; set actor.recompute: none"),
])
def test_replay_is_refused_where_it_cannot_work(model, actor, expected):
    with pytest.raises(ConfigError) as info:
        tiny_config(model=model, actor=actor)
    assert expected in str(info.value)


def _routing(length: int, seed: int) -> torch.Tensor:
    return torch.randint(0, 4, (length, 2, 2), generator=torch.Generator().manual_seed(seed))


def test_tokens_keep_their_experts_through_packing():
    # Token t of a sequence sits at row position offset + t (not shifted like the targets); slots without a
    # sequence are marked not recorded, and splitting a micro-batch gives every sequence its rows back.
    lengths = [7, 5, 3, 2]
    routed = [_routing(n, i) for i, n in enumerate(lengths)]
    for plan in packing.plan_micro_batches(lengths, 12, row_tokens=8):
        rows = gather_routing(plan, routed, 2, 2)
        assert rows.shape == (len(plan.rows), plan.row_length, 2, 2)
        back = split_recorded(plan, rows)
        for idx in plan.seq_indices:
            assert torch.equal(back[idx].long(), routed[idx])
        assert int((rows[..., 0, 0] != NOT_RECORDED).sum()) == plan.num_tokens


def test_a_sequence_without_routing_is_left_to_the_router_and_bad_shapes_are_named():
    plan = packing.plan_micro_batches([4, 3], 16, row_tokens=16)[0]  # one row holds both
    rows = gather_routing(plan, [None, _routing(3, 1)], 2, 2)
    assert int((rows != NOT_RECORDED).all(dim=(-1, -2)).sum()) == 3
    with pytest.raises(ValueError, match=r"sequence 0: routed_experts has shape \(4, 1, 2\); expected \(4, 2, 2\)"):
        gather_routing(plan, [torch.zeros(4, 1, 2), _routing(3, 1)], 2, 2)
