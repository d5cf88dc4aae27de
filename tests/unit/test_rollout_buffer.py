"""The off-policy rollout buffer (megatron_arpo/rollout/buffer.py): bounded, whole groups, staleness, checkpoint."""

from __future__ import annotations

import json

import pytest

from megatron_arpo.rollout.buffer import BufferedGroup, RolloutBuffer
from megatron_arpo.rollout.trajectory import Trajectory


def group(name: str, *versions: int) -> BufferedGroup:
    """A group with one trajectory per entry of ``versions`` (its sampled tokens' version) plus a tool token."""
    trajs = []
    for k, v in enumerate(versions):
        t = Trajectory(prompt_id=name, prompt_index=0, traj_id=f"{name}/{k}", index=k, origin="initial",
                       parent_id=None, branch_offset=None, prompt_token_ids=[1, 2])
        t.append([7, 8], [-0.5, float("-inf")], 1, versions=v)
        t.append([9], [0.0], 0)
        trajs.append(t)
    return BufferedGroup(name, [1, 2], dataset_index=int(name[1:]), trajectories=trajs)


def test_capacity_counts_reserved_groups_and_put_needs_a_reservation():
    buf = RolloutBuffer(capacity=4, max_staleness=1)
    buf.reserve(3)
    assert buf.room == 1
    with pytest.raises(ValueError, match="cannot reserve 2 groups: 1 free of 4"):
        buf.reserve(2)
    buf.put([group("g0", 0), group("g1", 0)])
    assert len(buf) == 2 and buf.in_flight == 1 and buf.room == 1
    with pytest.raises(ValueError, match="2 groups put but only 1 reserved"):
        buf.put([group("g2", 0), group("g3", 0)])


def test_take_hands_whole_groups_oldest_first_and_drops_stale_ones_counted():
    buf = RolloutBuffer(capacity=8, max_staleness=1)
    buf.reserve(5)
    buf.put([group("g0", 0, 2), group("g1", 1, 1), group("g2", 2), group("g3", 3), group("g4", 3)])
    # training version 2: g0 (oldest token at 0, lag 2 > 1) is dropped; g1 (lag 1) is fit
    assert buf.ready(2, version=2) and not buf.ready(5, version=2)
    taken = buf.take(2, version=2)
    assert [g.prompt_id for g in taken] == ["g1", "g2"] and len(taken[0].trajectories) == 2
    assert buf.counters["dropped_stale"] == 1 and buf.counters["taken"] == 2
    assert buf.version_lags(3) == [0, 0]
    buf.put_back(taken)
    assert [g.prompt_id for g in buf.groups] == ["g1", "g2", "g3", "g4"] and buf.counters["taken"] == 0
    with pytest.raises(ValueError, match="holds 3 groups, 4 asked for"):
        buf.take(4, version=3)  # g1 (lag 2) is dropped first
    assert buf.counters["dropped_stale"] == 2
    # max_staleness 0: only groups sampled entirely by the trained version
    strict = RolloutBuffer(capacity=2, max_staleness=0)
    strict.reserve(2)
    strict.put([group("g5", 4, 5), group("g6", 5)])
    assert [g.prompt_id for g in strict.take(1, version=5)] == ["g6"] and strict.counters["dropped_stale"] == 1


def test_state_round_trips_through_an_atomic_file_and_in_flight_groups_count_as_dropped(tmp_path):
    buf = RolloutBuffer(capacity=6, max_staleness=2)
    buf.reserve(4)
    buf.put([group("g0", 0), group("g1", 1, 0)])
    path = buf.save(tmp_path / "rollout_buffer.json")
    assert not list(tmp_path.glob("*.tmp*")) and json.loads(path.read_text())["in_flight"] == 2
    resumed = RolloutBuffer(capacity=6, max_staleness=2)
    resumed.load(path)
    assert [g.to_dict() for g in resumed.groups] == [g.to_dict() for g in buf.groups]
    assert resumed.in_flight == 0 and resumed.counters["dropped_in_flight"] == 2 and resumed.counters["put"] == 2
    assert resumed.groups[1].trajectories[0].response_logprobs[1] == float("-inf")
    assert resumed.groups[1].oldest_version() == 0
    with pytest.raises(ValueError, match="state version"):
        resumed.load_state_dict({"version": 99})


def test_bad_settings_are_named():
    with pytest.raises(ValueError, match="rollout.buffer_groups, rollout.max_staleness"):
        RolloutBuffer(capacity=0, max_staleness=0)
