"""Resource pools for the trainer: which placement-group bundles the actor ranks and the vLLM engines use.

Two placements (``trainer.placement``):

- ``colocated``: one shared pool; actor rank ``i`` and engine slot ``i`` sit in the same bundle and
  time-slice its device: each takes ``colocate_share`` of the bundle's CPUs (and of its GPU on GPU
  nodes), so Ray schedules both into the bundle. The pool has one bundle per device (GPU nodes:
  ``launcher.nodes x launcher.gpus_per_node``) or, on CPU-only nodes, ``max(actor world, engine slots)``.
- ``separate``: two disjoint pools, ``actor`` with ``trainer.actor_devices`` bundles and ``rollout`` with
  ``trainer.rollout_devices`` bundles (on CPU-only nodes, null means "exactly what is needed").

A device is a GPU on GPU nodes and a process slot on CPU-only nodes. Bundles are ``{"GPU": 1, "CPU": c}``
or ``{"CPU": c}``. Engine ``e`` with rollout TP ``t`` owns bundles ``e*t .. e*t+t-1`` of its pool and its
actor is scheduled on the first of them.

``plan_placement(cfg)`` is a pure function of the config (unit-tested); ``ResourcePools.create(plan)``
makes the Ray placement groups, and hands out the ``WorkerGroup`` and engine-actor arguments.
The placement strategy (PACK fills nodes one by one, SPREAD spreads) is a parameter: the config has no
key for it yet.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional

logger = logging.getLogger(__name__)

PLACEMENTS = ("colocated", "separate")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


@dataclass(frozen=True)
class PoolPlan:
    """One placement group: its bundles and strategy."""

    name: str
    bundles: tuple[Mapping[str, float], ...]
    strategy: str

    @property
    def size(self) -> int:
        return len(self.bundles)


@dataclass(frozen=True)
class PlacementPlan:
    """Bundles of every pool, and which bundles each actor rank and each engine uses."""

    placement: str
    on_gpu: bool
    pools: Mapping[str, PoolPlan]
    actor_pool: str
    actor_bundles: tuple[int, ...]  # bundle index of actor rank i
    actor_num_cpus: float
    actor_num_gpus: float
    rollout_pool: str
    engine_bundles: tuple[tuple[int, ...], ...]  # bundles of engine e (its TP slots)
    engine_num_cpus: float
    engine_num_gpus: float

    def describe(self) -> str:
        pools = "; ".join(f"{p.name}: {p.size} x {dict(p.bundles[0])} {p.strategy}" for p in self.pools.values())
        return (f"{self.placement} on {'GPU' if self.on_gpu else 'CPU'} — pools {pools}; actor ranks -> "
                f"{self.actor_pool}{list(self.actor_bundles)}; engines -> {self.rollout_pool}"
                f"{[list(b) for b in self.engine_bundles]}")


def total_devices(cfg: Any) -> int | None:
    """GPUs in the job, or None on CPU-only nodes (where actor ranks and engines are processes)."""
    if cfg.launcher.gpus_per_node == 0:
        return None
    return cfg.launcher.nodes * cfg.launcher.gpus_per_node


def actor_world_size(cfg: Any) -> int | None:
    """TP x PP x DP of the actor group, or None when DP is derived from an unknown device count."""
    a = cfg.actor
    if a.data_parallel is not None:
        return a.tensor_parallel * a.pipeline_parallel * a.data_parallel
    pool = cfg.trainer.actor_devices or total_devices(cfg)
    if pool is None:
        return a.tensor_parallel * a.pipeline_parallel  # CPU default: DP = 1
    return pool


def _bundle(on_gpu: bool, cpus: float) -> dict[str, float]:
    return {"GPU": 1.0, "CPU": float(cpus)} if on_gpu else {"CPU": float(cpus)}


def plan_placement(cfg: Any, *, strategy: str = "PACK", cpus_per_bundle: Optional[float] = None,
                   colocate_share: float = 0.5) -> PlacementPlan:
    """The bundle plan for ``cfg`` (an ExperimentConfig with resolved TP/PP). Raises ValueError naming the
    config keys when the pools cannot hold the actor ranks or the engines."""
    if strategy not in STRATEGIES:
        raise ValueError(f"placement strategy {strategy!r} is not one of {STRATEGIES}")
    if not 0 < colocate_share <= 1:
        raise ValueError(f"colocate_share must be in (0, 1], got {colocate_share}")
    t, la, r = cfg.trainer, cfg.launcher, cfg.rollout
    if t.placement not in PLACEMENTS:
        raise ValueError(f"trainer.placement: {t.placement!r}; allowed: {list(PLACEMENTS)}")
    on_gpu = la.gpus_per_node > 0
    if cpus_per_bundle is None:
        # On GPU nodes the node's CPUs are split over its GPUs; otherwise one CPU per process slot.
        cpus_per_bundle = max(1, (la.cpus_per_task or la.gpus_per_node) // la.gpus_per_node) if on_gpu else 1
    if cpus_per_bundle <= 0:
        raise ValueError(f"cpus_per_bundle must be > 0, got {cpus_per_bundle}")
    world = actor_world_size(cfg)
    slots_per_engine = r.tensor_parallel
    engine_slots = r.num_engines * slots_per_engine
    devices = la.nodes * la.gpus_per_node if on_gpu else None
    if on_gpu and la.gpus_per_node % slots_per_engine:
        # vLLM's ray executor puts an engine's workers on its own bundles; bundles are packed node by node,
        # so an engine whose TP does not divide a node's GPUs would straddle two nodes.
        raise ValueError(f"rollout.tensor_parallel = {slots_per_engine} GPUs per engine do not divide the "
                         f"{la.gpus_per_node} GPUs of a node (launcher.gpus_per_node): an engine would span two "
                         f"nodes; use a divisor of {la.gpus_per_node}")

    if t.placement == "colocated":
        size = devices if on_gpu else max(world, engine_slots)
        if world > size:
            raise ValueError(f"actor world size {world} (tensor x pipeline x data parallel) exceeds the {size} "
                             f"devices of launcher.nodes x launcher.gpus_per_node")
        if engine_slots > size:
            raise ValueError(f"rollout.num_engines x rollout.tensor_parallel = {engine_slots} exceeds the {size} "
                             f"colocated devices")
        pool = PoolPlan("shared", tuple(_bundle(on_gpu, cpus_per_bundle) for _ in range(size)), strategy)
        pools = {"shared": pool}
        actor_pool = rollout_pool = "shared"
        share = colocate_share
    else:
        actor_size = t.actor_devices if t.actor_devices is not None else (None if on_gpu else world)
        rollout_size = t.rollout_devices if t.rollout_devices is not None else (None if on_gpu else engine_slots)
        if actor_size is None or rollout_size is None:
            raise ValueError("trainer.actor_devices and trainer.rollout_devices are required when "
                             "trainer.placement is 'separate' on GPU nodes")
        if world > actor_size:
            raise ValueError(f"actor world size {world} exceeds trainer.actor_devices {actor_size}")
        if engine_slots > rollout_size:
            raise ValueError(f"rollout.num_engines x rollout.tensor_parallel = {engine_slots} exceeds "
                             f"trainer.rollout_devices {rollout_size}")
        if devices is not None and actor_size + rollout_size > devices:
            raise ValueError(f"trainer.actor_devices + trainer.rollout_devices = {actor_size + rollout_size} "
                             f"exceeds the {devices} devices of launcher.nodes x launcher.gpus_per_node")
        pools = {"actor": PoolPlan("actor", tuple(_bundle(on_gpu, cpus_per_bundle) for _ in range(actor_size)),
                                   strategy),
                 "rollout": PoolPlan("rollout", tuple(_bundle(on_gpu, cpus_per_bundle) for _ in range(rollout_size)),
                                     strategy)}
        actor_pool, rollout_pool = "actor", "rollout"
        share = 1.0

    engine_bundles = tuple(tuple(range(e * slots_per_engine, (e + 1) * slots_per_engine))
                           for e in range(r.num_engines))
    return PlacementPlan(
        placement=t.placement, on_gpu=on_gpu, pools=pools,
        actor_pool=actor_pool, actor_bundles=tuple(range(world)),
        actor_num_cpus=cpus_per_bundle * share, actor_num_gpus=share if on_gpu else 0.0,
        rollout_pool=rollout_pool, engine_bundles=engine_bundles,
        engine_num_cpus=cpus_per_bundle * share, engine_num_gpus=share if on_gpu else 0.0,
    )


@dataclass
class ResourcePools:
    """The Ray placement groups of a PlacementPlan (one per pool); ``remove()`` frees them."""

    plan: PlacementPlan
    groups: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def create(cls, plan: PlacementPlan, timeout: float = 300.0, name_prefix: str = "megatron-arpo") -> "ResourcePools":
        import ray
        from ray.util.placement_group import placement_group

        pools = cls(plan)
        try:
            for name, pool in plan.pools.items():
                pools.groups[name] = placement_group([dict(b) for b in pool.bundles], strategy=pool.strategy,
                                                     name=f"{name_prefix}-{name}")
            deadline = time.monotonic() + timeout
            for name, pg in pools.groups.items():
                ready, _ = ray.wait([pg.ready()], timeout=max(0.0, deadline - time.monotonic()))
                if not ready:
                    pool = plan.pools[name]
                    raise TimeoutError(
                        f"resource pool {name!r} ({pool.size} x {dict(pool.bundles[0])}, {pool.strategy}) could not "
                        f"be placed within {timeout:.0f} s; the cluster has {ray.cluster_resources()} with "
                        f"{ray.available_resources()} free. Lower trainer.actor_devices/rollout_devices or the "
                        f"parallel sizes, or add nodes")
        except BaseException:
            pools.remove()
            raise
        logger.info("resource pools: %s", plan.describe())
        return pools

    def actor_group_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``WorkerGroup`` that put the actor ranks in their pool."""
        p = self.plan
        return {"placement_group": self.groups[p.actor_pool], "bundle_indices": list(p.actor_bundles),
                "num_cpus_per_rank": p.actor_num_cpus, "num_gpus_per_rank": p.actor_num_gpus}

    def engine_placement(self, engine_index: int) -> dict[str, Any]:
        """Keyword arguments of ``rollout.engine.create_engine_actor`` for engine ``engine_index``."""
        p = self.plan
        if not 0 <= engine_index < len(p.engine_bundles):
            raise ValueError(f"engine index {engine_index} out of range 0..{len(p.engine_bundles) - 1}")
        return {"placement_group": self.groups[p.rollout_pool], "bundle_index": p.engine_bundles[engine_index][0],
                "bundle_indices": list(p.engine_bundles[engine_index]), "num_cpus": p.engine_num_cpus,
                "num_gpus": p.engine_num_gpus}

    def remove(self) -> None:
        if not self.groups:
            return
        from ray.util.placement_group import remove_placement_group

        for name, pg in self.groups.items():
            try:
                remove_placement_group(pg)
            except Exception as exc:  # already removed, or the cluster is gone
                logger.warning("removing resource pool %r failed: %s", name, exc)
        self.groups = {}
