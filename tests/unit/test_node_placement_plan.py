"""Slots to bundles in node order (megatron_arpo.cluster.placement.bind_slots) on bundle->node tables as Ray
scrambles them, the refusals when a TP group or an engine cannot sit on one node, and the Ray floor that
keeps CUDA_VISIBLE_DEVICES in engine actors (megatron_arpo.cluster.ray_compat, doctor's row)."""

from __future__ import annotations

import logging
import random

import pytest

from megatron_arpo.cluster import ray_compat
from megatron_arpo.cluster.placement import (PlacementError, bind_slots, node_order, plan_placement,
                                             refuse_split_groups)
from megatron_arpo.cluster.ray_compat import OVERRIDE_ON_ZERO, RayVersionError, check_ray_version, ray_version_problem
from megatron_arpo.config import build_config
from megatron_arpo.doctor import FAIL, PASS, check_ray
from megatron_arpo.errors import InputError
from megatron_arpo.rollout.engine import EngineConfig
from megatron_arpo.rollout.engine_actor import engine_ray_options


def gpu_config(nodes=4, gpus_per_node=8, actor_tp=8, engines=8, rollout_tp=4):
    """The 32B recipes' shape: 4 nodes x 8 GPUs, colocated, actor TP 8, 8 engines of TP 4."""
    return build_config({
        "model": {"config": "qwen3-8b"}, "data": {"max_prompt_tokens": 256},
        "tools": {"search": {"enabled": False}},
        "launcher": {"nodes": nodes, "gpus_per_node": gpus_per_node, "cpus_per_task": 64},
        "actor": {"tensor_parallel": actor_tp, "pipeline_parallel": 1},
        "rollout": {"num_engines": engines, "tensor_parallel": rollout_tp, "response_length": 1024}})


def scrambled_table(nodes=4, per_node=8, seed=0):
    table = [f"node{n:02d}" + "f" * 48 for n in range(nodes) for _ in range(per_node)]
    random.Random(seed).shuffle(table)
    return table


def groups_of(seq, size):
    return [tuple(seq[i:i + size]) for i in range(0, len(seq), size)]


@pytest.mark.parametrize("table", [scrambled_table(seed=0), scrambled_table(seed=7),
                                   [f"node{b % 4}" for b in range(32)]],  # interleaved: the worst order
                         ids=["shuffled-0", "shuffled-7", "interleaved"])
def test_every_tp_group_and_engine_lands_on_one_node_of_a_scrambled_32_bundle_pool(table):
    plan = plan_placement(gpu_config())
    assert plan.pools["shared"].size == 32 and plan.actor_tensor_parallel == 8
    # What the plan's slots did before: slot s = bundle s. On this table that splits TP groups across nodes.
    assert any(len({table[b] for b in group}) > 1 for group in groups_of(plan.actor_bundles, 8))

    bound = bind_slots(plan, {"shared": table})  # on GPU: refuses rather than return a split group
    assert sorted(bound.actor_bundles) == list(range(32))  # every bundle used once
    for group in groups_of(bound.actor_nodes, 8):
        assert len(set(group)) == 1, bound.actor_nodes
    assert len(bound.engine_bundles) == 8
    for bundles, nodes in zip(bound.engine_bundles, bound.engine_nodes):
        assert len(set(nodes)) == 1 and {table[b] for b in bundles} == set(nodes)
    # Colocated: engine slot i still shares its bundle with actor rank i.
    assert [b for bundles in bound.engine_bundles for b in bundles] == list(bound.actor_bundles)
    # Bundle 0's node comes first, and within a node the bundles keep their order.
    assert bound.actor_nodes[0] == table[0]
    for group in groups_of(bound.actor_bundles, 8):
        assert list(group) == sorted(group)


def test_node_order_is_the_identity_when_ray_kept_the_bundles_node_contiguous():
    assert node_order(["a", "a", "b", "b"]) == [0, 1, 2, 3]
    assert node_order(["b", "a", "b", "a", "c"]) == [0, 2, 1, 3, 4]  # nodes by their first bundle


def test_a_node_holding_no_multiple_of_the_tp_size_is_refused_with_the_numbers():
    plan = plan_placement(gpu_config(nodes=2, engines=4))  # 16 GPUs
    # Another job holds a GPU of node B, so Ray packs 9 bundles onto A and 7 onto B.
    table = ["A" * 56] * 9 + ["B" * 56] * 7
    random.Random(3).shuffle(table)
    with pytest.raises(PlacementError) as info:
        bind_slots(plan, {"shared": table})
    message = str(info.value)
    assert "\n" not in message and isinstance(info.value, InputError)
    assert message.startswith("actor ranks 8-15 (a TP group of actor.tensor_parallel = 8) would span nodes: "
                              "pool 'shared' holds 9 + 7 bundles on its 2 node(s) AAAAAAAA, BBBBBBBB")
    assert "every node must hold a multiple of 8 of them" in message and "lower actor.tensor_parallel" in message


def test_an_engine_across_nodes_is_refused_and_cpu_nodes_only_warn(caplog):
    plan = plan_placement(gpu_config(nodes=2, actor_tp=1, engines=4))
    table = ["A"] * 9 + ["B"] * 7
    with pytest.raises(PlacementError, match=r"^engine 2 \(rollout.tensor_parallel = 4 workers\) would span nodes: "
                                             r"pool 'shared' holds 9 \+ 7 bundles"):
        bind_slots(plan, {"shared": table})
    # CPU-only nodes (tests spread gloo groups over raylets on purpose): the same finding is a warning.
    with caplog.at_level(logging.WARNING, logger="megatron_arpo.cluster.placement"):
        bound = bind_slots(plan, {"shared": table}, strict=False)
    assert "engine 2 (rollout.tensor_parallel = 4 workers) would span nodes" in caplog.text
    assert bound.engine_nodes[2] == ("A", "B", "B", "B")


def test_a_tp_size_that_does_not_divide_a_node_is_refused_before_ray_starts():
    with pytest.raises(PlacementError, match=r"actor.tensor_parallel = 8 does not divide the 4 GPUs of a node "
                                             r"\(launcher.gpus_per_node\).*use a divisor of 4"):
        plan_placement(gpu_config(nodes=4, gpus_per_node=4, rollout_tp=2))


def test_split_groups_name_the_first_and_count_the_rest():
    groups = [("g0", ["a", "a"]), ("g1", ["a", "b"]), ("g2", ["c", "b"])]
    with pytest.raises(PlacementError, match=r"^g1 \(and 1 more\) would span nodes: 2 nodes; fix it$"):
        refuse_split_groups(groups, "2 nodes", "fix it", strict=True)
    refuse_split_groups(groups[:1], "1 node", "nothing", strict=True)


def test_ray_versions_that_blank_cuda_visible_devices_are_refused_in_one_line():
    for version in ("2.46.0", "2.49.2", "1.13.1"):
        with pytest.raises(RayVersionError) as info:
            check_ray_version(version)
        message = str(info.value)
        assert message.startswith(f"ray {version} blanks CUDA_VISIBLE_DEVICES for num_gpus=0 actors")
        assert "Ray >= 2.50" in message and "pip install 'ray[default]>=2.50'" in message and "\n" not in message
    for version in ("2.50.0", "2.55.1", "2.56.0rc1", "2.60.0", "3.0.0.dev0"):
        assert ray_version_problem(version) is None
    check_ray_version()  # the installed one


def test_doctor_reports_the_ray_row_with_the_fix():
    old = check_ray("2.49.0", environ={})
    assert old.status == FAIL and old.found.startswith("ray 2.49.0 blanks CUDA_VISIBLE_DEVICES")
    assert old.fix.startswith("pip install 'ray[default]>=2.50'")
    mid = check_ray("2.55.1", environ={})
    assert mid.status == PASS and "2.55.1: blanks CUDA_VISIBLE_DEVICES of num_gpus=0 actors by default" in mid.found
    assert f"engine actors set {OVERRIDE_ON_ZERO}=0" in mid.found
    new = check_ray("2.60.0", environ={OVERRIDE_ON_ZERO: "1"})
    assert new.status == PASS and "keeps" in new.found and f"{OVERRIDE_ON_ZERO}='1', which the engines override" in new.found


def test_engine_actors_always_set_the_opt_out_and_refuse_an_old_ray(monkeypatch):
    cfg = EngineConfig(model="/ckpt", tensor_parallel_size=2)
    # A caller (or a cluster-wide setting forwarded by one) asking for the blanking does not get it.
    options = engine_ray_options(cfg, num_cpus=4, num_gpus=0.5, bundle_indices=(4, 5),
                                 env={OVERRIDE_ON_ZERO: "1", "EXTRA": "x"})
    env = options["runtime_env"]["env_vars"]
    assert options["num_gpus"] == 0.0 and env["VLLM_RAY_BUNDLE_INDICES"] == "4,5"
    assert env[OVERRIDE_ON_ZERO] == "0" and env["EXTRA"] == "x"
    assert engine_ray_options(cfg, num_cpus=1)["runtime_env"]["env_vars"][OVERRIDE_ON_ZERO] == "0"  # CPU too
    monkeypatch.setattr(ray_compat, "installed_ray_version", lambda: "2.47.1")
    with pytest.raises(RayVersionError, match=r"^ray 2.47.1 blanks CUDA_VISIBLE_DEVICES"):
        engine_ray_options(cfg, num_cpus=1)
