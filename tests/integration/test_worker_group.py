"""WorkerGroup on a real 2-raylet Ray cluster: placement on both nodes, rendezvous from rank 0 and gloo
collectives across the Ray actors, errors that name rank/node/method, timeouts that fire, clean shutdown."""

from __future__ import annotations

import datetime
import os
import sys
import time

import pytest

ray = pytest.importorskip("ray")
from ray import cloudpickle  # noqa: E402

from megatron_arpo.cluster.worker_group import WorkerGroup, WorkerGroupError, WorkerGroupTimeout  # noqa: E402

pytestmark = pytest.mark.timeout(300)

# The stand-in worker below lives in this test module, which Ray workers cannot import: ship it by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])

LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo"}  # gloo pair traffic stays on loopback


class GlooWorker:
    """A Ray-free worker doing real torch.distributed gloo collectives (stand-in for a Megatron rank)."""

    def __init__(self, rank, world_size, master_addr, master_port, fail_in_init_rank=None):
        import torch.distributed as dist

        if rank == fail_in_init_rank:
            raise RuntimeError(f"init refused on rank {rank}")
        self.rank = rank
        dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=120))

    def all_reduce(self, value):
        import torch
        import torch.distributed as dist

        t = torch.tensor([float(value)])
        dist.all_reduce(t)
        dist.barrier()
        return t.item()

    def environment(self):
        import torch.distributed as dist

        return {k: os.environ.get(k) for k in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE",
                                               "OMP_NUM_THREADS", "GLOO_SOCKET_IFNAME", "EXTRA_FLAG")} | {
            "dist_rank": dist.get_rank(), "dist_world": dist.get_world_size()}

    def maybe_fail(self, fail):
        if fail:
            raise ValueError(f"bad shard on rank {self.rank}")
        return self.rank

    def sleep(self, seconds):
        time.sleep(seconds)
        return seconds

    def exit_process(self):
        os._exit(3)

    def shutdown(self):
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _alive_actor_ids() -> set[str]:
    from ray._private import state  # GCS actor table; the public state API needs the dashboard

    return {aid for aid, info in state.actors().items() if info["State"] != "DEAD"}


def _wait_for(predicate, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


@pytest.fixture(scope="module")
def spread_group(ray_two_nodes):
    group = WorkerGroup(GlooWorker, 2, name="gloo-spread", strategy="STRICT_SPREAD", num_cpus_per_rank=1,
                        env={**LOOPBACK_ENV, "EXTRA_FLAG": "on"}, startup_timeout=120, default_timeout=120)
    yield group
    group.shutdown()


def test_ranks_land_on_both_nodes_and_all_reduce_over_gloo(spread_group, ray_two_nodes):
    node_ids = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
    placed = spread_group.nodes()
    assert len(set(placed)) == 2 and set(placed) <= node_ids
    assert [p.rank for p in spread_group.placement] == [0, 1]
    assert "rank 1:" in spread_group.placement_summary()

    assert spread_group.dispatch("all_reduce", [1.5, 2.0]) == [3.5, 3.5]
    assert spread_group.call_all("all_reduce", 1) == [2.0, 2.0]

    envs = spread_group.call_all("environment")
    assert [e["dist_rank"] for e in envs] == [0, 1] and {e["dist_world"] for e in envs} == {2}
    assert {e["MASTER_ADDR"] for e in envs} == {spread_group.master_addr}
    assert {e["MASTER_PORT"] for e in envs} == {str(spread_group.master_port)}
    assert [e["RANK"] for e in envs] == ["0", "1"]
    assert {e["OMP_NUM_THREADS"] for e in envs} == {"1"}
    assert {e["EXTRA_FLAG"] for e in envs} == {"on"}
    assert spread_group.master_addr == spread_group.placement[0].node_ip


def test_exception_names_rank_node_and_method(spread_group):
    with pytest.raises(WorkerGroupError) as info:
        spread_group.dispatch("maybe_fail", [False, True])
    err = info.value
    assert (err.rank, err.method, err.kind) == (1, "maybe_fail", "exception")
    assert "rank 1" in str(err) and "maybe_fail" in str(err) and "bad shard on rank 1" in str(err)
    assert spread_group.placement[1].node_id[:8] in str(err)
    # A plain exception leaves the group usable.
    assert spread_group.call_rank(0, "maybe_fail", False) == 0
    assert spread_group.call_all("all_reduce", 2) == [4.0, 4.0]


def test_dispatch_needs_one_shard_per_rank(spread_group):
    with pytest.raises(ValueError, match="3 shards for 2 ranks"):
        spread_group.dispatch("maybe_fail", [False, False, False])


def test_hung_method_times_out_and_shutdown_frees_everything(ray_two_nodes):
    before = _alive_actor_ids()
    free_cpus = ray.available_resources().get("CPU", 0)
    group = WorkerGroup(GlooWorker, 2, name="gloo-hang", num_cpus_per_rank=1, env=LOOPBACK_ENV,
                        startup_timeout=120)
    pg_id = group.placement_group.id.hex()
    group_actors = _alive_actor_ids() - before
    assert len(group_actors) == 2
    assert _wait_for(lambda: ray.available_resources().get("CPU", 0) == free_cpus - 2)

    with pytest.raises(WorkerGroupTimeout) as info:
        group.call_rank(1, "sleep", 600, timeout=2)
    assert info.value.pending_ranks == [1] and info.value.method == "sleep" and "rank 1" in str(info.value)
    with pytest.raises(WorkerGroupError, match="timed out"):
        group.call_all("all_reduce", 1)  # the group refuses work once a call hung

    group.shutdown()
    group.shutdown()  # idempotent
    assert _wait_for(lambda: not (group_actors & _alive_actor_ids()))
    assert ray.util.placement_group_table()[pg_id]["state"] == "REMOVED"
    assert _wait_for(lambda: ray.available_resources().get("CPU", 0) == free_cpus)
    with pytest.raises(WorkerGroupError, match="after shutdown"):
        group.call_all("sleep", 0)


def test_dead_actor_is_reported_with_rank(ray_two_nodes):
    group = WorkerGroup(GlooWorker, 2, name="gloo-die", num_cpus_per_rank=1, env=LOOPBACK_ENV, startup_timeout=120)
    try:
        with pytest.raises(WorkerGroupError) as info:
            group.call_rank(0, "exit_process", timeout=60)
        assert (info.value.rank, info.value.kind, info.value.method) == (0, "actor_died", "exit_process")
        with pytest.raises(WorkerGroupError, match="died during exit_process"):
            group.call_all("sleep", 0)
    finally:
        group.shutdown()


def test_failing_constructor_does_not_hang_and_cleans_up(ray_two_nodes):
    before_pgs = {k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"}
    before = _alive_actor_ids()
    with pytest.raises(WorkerGroupError) as info:
        WorkerGroup(GlooWorker, 2, name="gloo-badinit", num_cpus_per_rank=1, env=LOOPBACK_ENV,
                    kwargs={"fail_in_init_rank": 1}, startup_timeout=120)
    assert info.value.rank == 1 and "GlooWorker.__init__" in str(info.value)
    assert "init refused on rank 1" in str(info.value)
    assert _wait_for(lambda: _alive_actor_ids() <= before)
    assert {k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"} <= before_pgs


def test_unplaceable_group_fails_with_resources_named(ray_two_nodes):
    before_pgs = {k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"}
    with pytest.raises(WorkerGroupError, match="could not be placed") as info:
        WorkerGroup(GlooWorker, 2, name="too-big", num_cpus_per_rank=3, strategy="STRICT_SPREAD", startup_timeout=3)
    assert info.value.kind == "startup" and "CPU" in str(info.value)
    assert {k for k, v in ray.util.placement_group_table().items() if v["state"] != "REMOVED"} <= before_pgs


def test_colocated_pool_puts_ranks_and_engines_in_the_same_bundles(ray_two_nodes):
    from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

    from megatron_arpo.cluster.placement import ResourcePools, plan_placement
    from megatron_arpo.config import build_config

    cfg = build_config({"model": {"config": "tiny-qwen3"}, "rollout": {"response_length": 512, "num_engines": 2},
                        "data": {"max_prompt_tokens": 256}, "tools": {"search": {"enabled": False}},
                        "launcher": {"gpus_per_node": 0}, "actor": {"tensor_parallel": 2, "data_parallel": 1}})
    plan = plan_placement(cfg, strategy="STRICT_SPREAD")
    pools = ResourcePools.create(plan, timeout=60)
    group = None
    try:
        group = WorkerGroup(GlooWorker, 2, name="colocated-actor", env=LOOPBACK_ENV, startup_timeout=120,
                            **pools.actor_group_kwargs())
        assert group.dispatch("all_reduce", [1, 2]) == [3.0, 3.0]

        @ray.remote
        class EngineStandIn:
            def node(self):
                return ray.get_runtime_context().get_node_id()

        engines = []
        for e in range(2):
            where = pools.engine_placement(e)
            engines.append(EngineStandIn.options(
                num_cpus=where["num_cpus"], scheduling_strategy=PlacementGroupSchedulingStrategy(
                    where["placement_group"], placement_group_bundle_index=where["bundle_index"])).remote())
        engine_nodes = ray.get([eng.node.remote() for eng in engines], timeout=60)
        # Engine e shares bundle e (so its node) with actor rank e; the two bundles are on different nodes.
        assert engine_nodes == group.nodes() and len(set(engine_nodes)) == 2
        for eng in engines:
            ray.kill(eng)
    finally:
        if group is not None:
            group.shutdown()
        pools.remove()
    assert not pools.groups
