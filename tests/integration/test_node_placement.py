"""Node-contiguous placement and engine actors' CUDA_VISIBLE_DEVICES on a real 2-raylet Ray cluster.

The placement group is built with a deliberately interleaved bundle order (bundle label selectors put
bundle 0 on the second raylet, bundle 1 on the first, and so on), as Ray's unstable sort does to groups
of more than 16 bundles; the actor ranks and the engines must still land node by node."""

from __future__ import annotations

import logging
import os
import sys

import pytest

ray = pytest.importorskip("ray")
from ray import cloudpickle  # noqa: E402
from ray.util.placement_group import placement_group, remove_placement_group  # noqa: E402
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy  # noqa: E402

from megatron_arpo.cluster.placement import (PlacementError, ResourcePools, plan_placement,  # noqa: E402
                                             read_bundle_nodes)
from megatron_arpo.cluster.ray_compat import OVERRIDE_ON_ZERO  # noqa: E402
from megatron_arpo.cluster.worker_group import WorkerGroup  # noqa: E402
from megatron_arpo.config import build_config  # noqa: E402
from megatron_arpo.rollout.engine import EngineConfig  # noqa: E402
from megatron_arpo.rollout.engine_actor import engine_ray_options  # noqa: E402
from ray_cluster import NODE_LABEL  # noqa: E402  (the Ray fixtures: tests/conftest.py)

pytestmark = pytest.mark.timeout(300)

cloudpickle.register_pickle_by_value(sys.modules[__name__])


class NodeWorker:
    """A Ray-free rank worker that only says where it runs."""

    def __init__(self, rank, world_size, master_addr, master_port):
        self.rank = rank


class EngineStandIn:
    """Stands in for VllmEngine: started with the engine's own Ray options, reports its node and env."""

    def where(self):
        return ray.get_runtime_context().get_node_id(), os.environ.get("CUDA_VISIBLE_DEVICES")


@pytest.fixture(autouse=True)
def _idle_cluster(ray_two_nodes):
    """Before each test, not only each module: the previous test's actors and groups die asynchronously, and a
    SPREAD group made before they are gone packs onto the raylet they are not on."""
    ray_two_nodes.wait_until_idle()


def cpu_config(actor, rollout):
    return build_config({"model": {"config": "tiny-qwen3"}, "data": {"max_prompt_tokens": 256},
                         "tools": {"search": {"enabled": False}}, "launcher": {"gpus_per_node": 0},
                         "actor": actor, "rollout": {"response_length": 512, **rollout}})


def node_ids():
    """Node id of raylet 0 and raylet 1 (the fixture labels them)."""
    by_label = {n["Labels"][NODE_LABEL]: n["NodeID"] for n in ray.nodes() if n["Alive"]}
    return by_label["0"], by_label["1"]


def interleaved_group(size):
    """A PACK group whose bundle b sits on raylet (b + 1) % 2: bundle 0 on the second raylet."""
    pg = placement_group([{"CPU": 1.0}] * size, strategy="PACK",
                         bundle_label_selector=[{NODE_LABEL: str((b + 1) % 2)} for b in range(size)])
    ray.get(pg.ready(), timeout=60)
    return pg


def test_ranks_and_engines_take_bundles_in_node_order(ray_two_nodes):
    node0, node1 = node_ids()
    cfg = cpu_config({"tensor_parallel": 2, "data_parallel": 2}, {"num_engines": 2, "tensor_parallel": 2})
    plan = plan_placement(cfg)
    pools = ResourcePools(plan, {"shared": interleaved_group(4)})
    group, engines, workers = None, [], []
    try:
        assert read_bundle_nodes(pools.groups["shared"]) == [node1, node0, node1, node0]  # the permutation
        bound = pools.bind(strict=True)  # the GPU setting: a split group would raise
        assert bound.actor_bundles == (0, 2, 1, 3) and bound.engine_bundles == ((0, 2), (1, 3))

        group = WorkerGroup(NodeWorker, 4, name="node-order", startup_timeout=120, **pools.actor_group_kwargs())
        # Each TP group (ranks 0-1, ranks 2-3) on one raylet; rank 0 on bundle 0's.
        assert group.nodes() == [node1, node1, node0, node0]
        assert [p.bundle_index for p in group.placement] == [0, 2, 1, 3]

        engine_cfg = EngineConfig(model="/nowhere", tensor_parallel_size=2)
        for e in range(2):
            where = pools.engine_placement(e)
            options = engine_ray_options(engine_cfg, **where)
            engines.append(ray.remote(EngineStandIn).options(**options).remote())
            # vLLM's ray executor (GPU, TP > 1) starts one worker on each bundle of VLLM_RAY_BUNDLE_INDICES.
            for bundle in where["bundle_indices"]:
                workers.append(ray.remote(EngineStandIn).options(num_cpus=0, scheduling_strategy=(
                    PlacementGroupSchedulingStrategy(where["placement_group"], bundle))).remote())
        engine_nodes = [n for n, _ in ray.get([eng.where.remote() for eng in engines], timeout=60)]
        worker_nodes = [n for n, _ in ray.get([w.where.remote() for w in workers], timeout=60)]
        assert engine_nodes == [node1, node0]  # engine e shares its node with actor ranks 2e, 2e+1
        assert worker_nodes == [node1, node1, node0, node0]  # both workers of an engine on the engine's node
    finally:
        for actor in engines + workers:
            ray.kill(actor)
        if group is not None:
            group.shutdown()
        pools.remove()


def test_a_worker_group_in_its_own_spread_group_numbers_ranks_node_by_node(ray_two_nodes):
    group = WorkerGroup(NodeWorker, 4, name="own-spread", num_cpus_per_rank=0.5, strategy="SPREAD", startup_timeout=120)
    try:
        table = read_bundle_nodes(group.placement_group)
        assert len(set(table)) == 2
        nodes = group.nodes()
        assert nodes[0] == nodes[1] == table[0] and nodes[2] == nodes[3] != nodes[0], (table, nodes)
    finally:
        group.shutdown()


def test_a_worker_group_given_a_scrambled_group_and_no_bundle_indices_numbers_ranks_node_by_node(ray_two_nodes):
    node0, node1 = node_ids()
    pg = interleaved_group(4)
    try:
        group = WorkerGroup(NodeWorker, 4, name="given-pg", placement_group=pg, num_cpus_per_rank=0.5,
                            startup_timeout=120)
        try:
            assert group.nodes() == [node1, node1, node0, node0]  # bundle r would give node1, node0, node1, node0
            assert [p.bundle_index for p in group.placement] == [0, 2, 1, 3]
        finally:
            group.shutdown()
    finally:
        remove_placement_group(pg)


def test_a_tp_group_that_must_span_nodes_is_refused_with_the_gpu_setting(ray_two_nodes, caplog):
    node0, node1 = node_ids()
    cfg = cpu_config({"tensor_parallel": 2, "data_parallel": 1}, {"num_engines": 1})
    pools = ResourcePools(plan_placement(cfg), {"shared": interleaved_group(2)})
    try:
        with pytest.raises(PlacementError) as info:
            pools.bind(strict=True)
        assert str(info.value) == (
            f"actor ranks 0-1 (a TP group of actor.tensor_parallel = 2) would span nodes: pool 'shared' holds 1 + 1 "
            f"bundles on its 2 node(s) {node1[:8]}, {node0[:8]}; every node must hold a multiple of 2 of them: give "
            f"each node a multiple of 2 free GPUs (launcher.gpus_per_node, no other job on them) or lower "
            f"actor.tensor_parallel")
        with caplog.at_level(logging.WARNING, logger="megatron_arpo.cluster.placement"):
            bound = pools.bind()  # CPU-only nodes: allowed, with a warning
        assert bound.actor_nodes == (node1, node0) and "would span nodes" in caplog.text
    finally:
        pools.remove()


def test_an_engine_actor_with_no_gpu_keeps_cuda_visible_devices(ray_two_nodes):
    """Ray blanks CUDA_VISIBLE_DEVICES of an actor that holds no GPU when RAY_ACCEL_ENV_VAR_OVERRIDE_ON_ZERO is
    true: the default of Ray 2.50-2.55, simulated here on Ray >= 2.56 by setting it, as a cluster could."""
    visible = {"CUDA_VISIBLE_DEVICES": "0,1,2,3"}
    blanking = {**visible, OVERRIDE_ON_ZERO: "1"}
    control = ray.remote(EngineStandIn).options(num_cpus=0, num_gpus=0, runtime_env={"env_vars": blanking}).remote()
    engine_cfg = EngineConfig(model="/nowhere", tensor_parallel_size=2)
    engine = ray.remote(EngineStandIn).options(**engine_ray_options(engine_cfg, num_cpus=0, env=blanking)).remote()
    try:
        (_, control_env), (_, engine_env) = ray.get([control.where.remote(), engine.where.remote()], timeout=60)
        assert control_env == ""  # the blanking runs on this CPU-only cluster too
        assert engine_env == "0,1,2,3"  # the engine's options opt out of it
    finally:
        ray.kill(control)
        ray.kill(engine)
