"""Routing replay (R3): ``actor.moe_routing_replay`` in the config, each trajectory token's recorded experts
(branches included), and their layout in a packed micro-batch."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from megatron_arpo.actor import packing
from megatron_arpo.actor.routing_replay import NOT_RECORDED, gather_routing, split_recorded
from megatron_arpo.config import ConfigError
from megatron_arpo.rollout.scheduler import RolloutPrompt
from megatron_arpo.rollout.trajectory import Trajectory
from scheduler_helpers import PROMPT, ScriptedRng, make_scheduler, reference_script, run
from support.configs import tiny_config
from support.scripts import load_script

MOE = {"config": "tiny-qwen3-moe"}


def test_replay_is_accepted_for_an_moe_model():
    assert tiny_config(model=MOE, actor={"moe_routing_replay": True}).actor.moe_routing_replay


@pytest.mark.parametrize(("model", "actor", "expected"), [
    ({"config": "tiny-qwen3"}, {"moe_routing_replay": True},
     "actor.moe_routing_replay: tiny-qwen3 is a dense model (no routed experts); set actor.moe_routing_replay: false"),
    (MOE, {"moe_routing_replay": True, "recompute": "selective"},
     "actor.moe_routing_replay with actor.recompute: selective: the recomputed forward would route again after the "
     "next micro-batch's routing is set; set actor.recompute: none"),
    (MOE, {"moe_replay_diagnostics": True},
     "actor.moe_replay_diagnostics compares the actor's log-probs with and without routing replay; set "
     "actor.moe_routing_replay: true, or actor.moe_replay_diagnostics: false"),
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


# ------------------------------------------------------------------ rollout side: each token keeps its experts
def _fake_routing(tokens) -> list:
    """Two layers, top-2: a token's experts are a function of its id, so misalignment shows."""
    return [[[t % 4, (t + 1) % 4], [(t + 2) % 4, (t + 3) % 4]] for t in tokens]


def _routing_engine(engine):
    """The scripted engine returning vLLM's routed experts: every context token and all generated but the last."""
    generate = engine.generate

    async def with_routing(request):
        out = await generate(request)
        out.routed_experts = np.array(_fake_routing(list(request.prompt_token_ids) + out.token_ids[:-1]), np.uint8)
        return out

    engine.generate = with_routing
    return engine


def test_trajectories_keep_each_tokens_experts_branches_included():
    sched, engines = make_scheduler(reference_script(), rng=ScriptedRng({"q0/0": [0.1, 0.3], "q0/1": [0.9]}), n=4,
                                    initial_rollouts=2, beam_size=2, branch_threshold=0.5, entropy_weight=0.2,
                                    branch_timing="reference", call_limit=5, response_length=1000)
    for engine in engines:
        _routing_engine(engine)
    (group,) = run(sched, [RolloutPrompt("q0", PROMPT)]).groups
    assert any(t.origin == "branch" for t in group)
    for traj in group:
        context = traj.context()
        rows = traj.routing_rows(2, 2)
        assert len(rows) == len(context)
        assert rows[:-1] == _fake_routing(context[:-1])
        assert rows[-1] == [[-1, -1], [-1, -1]]  # the last sampled token was never forwarded


def test_a_fork_inherits_its_prefix_routing_and_truncate_cuts_it():
    traj = Trajectory(prompt_id="p", prompt_index=0, traj_id="p/0", index=0, origin="initial", parent_id=None,
                      branch_offset=None, prompt_token_ids=[5, 6])
    traj.append([7, 8, 9, 10], [0.0] * 4, 1, 0)
    traj.record_routing(np.array(_fake_routing([5, 6, 7, 8, 9])))
    child = traj.fork("p/0/b", 1, 2)
    assert child.routed_experts == _fake_routing([5, 6, 7, 8])
    traj.truncate(1)
    assert traj.routing_rows(2, 2) == _fake_routing([5, 6, 7])
    with pytest.raises(ValueError, match="routing for 4 tokens but the context has 3"):
        traj.record_routing(_fake_routing([5, 6, 7, 8]))


# ------------------------------------------------------------------ the measurement's arithmetic
def test_mismatch_counts_predicted_tokens_and_the_ratio_band():
    bench = load_script("benchmarks/moe_routing_replay.py", "moe_routing_replay_benchmark")
    rollout = [torch.tensor([0.0, -1.0, -2.0, -3.0])]
    train = [torch.tensor([5.0, -1.0, -2.0 + math.log(1.3), -3.0 + math.log(0.9)])]  # token 0 has no prediction
    got = bench.mismatch(train, rollout)
    assert got["tokens"] == 3 and got["outside"] == pytest.approx(1 / 3)
    assert got["mean_abs"] == pytest.approx((math.log(1.3) - math.log(0.9)) / 3)
    flips = [torch.tensor([False, True, False, True])]  # a flip at token 1 moves token 2's prediction
    got = bench.mismatch(train, rollout, flips)
    assert got["flipped_tokens"] == 1 and got["mean_abs_flipped"] == pytest.approx(math.log(1.3))
    same, swapped = torch.tensor([[[0, 1], [2, 3]]]), torch.tensor([[[1, 0], [3, 2]]])  # expert order ignored
    other = torch.tensor([[[0, 2], [2, 3]]])
    assert bench.changed_routing([same, other], [swapped, same]) == 0.5


def test_routing_travels_with_its_sequence_through_the_data_parallel_split():
    seqs = [[i] * n for i, n in enumerate([9, 4, 7, 3, 6, 5])]
    batch = {"input_ids": seqs, "routed_experts": [_fake_routing(s) for s in seqs], "group_ids": [0, 0, 1, 1, 2, 2]}
    shards = packing.split_for_data_parallel(batch, 2, mini_batch_size=1)
    assert sum(len(s["input_ids"]) for s in shards) == len(seqs)
    for shard in shards:
        for ids, routed in zip(shard["input_ids"], shard["routed_experts"]):
            assert routed == _fake_routing(ids)
