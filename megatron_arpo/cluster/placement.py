"""Resource pools for the trainer: which placement-group bundles the actor ranks and the vLLM engines use.

Two placements (``trainer.placement``):

- ``colocated``: one shared pool; actor rank ``i`` and engine slot ``i`` sit in the same bundle and
  time-slice its device: each takes ``colocate_share`` of the bundle's CPUs (and of its GPU on GPU
  nodes), so Ray schedules both into the bundle. The pool has one bundle per device (GPU nodes:
  ``launcher.nodes x launcher.gpus_per_node``) or, on CPU-only nodes, ``max(actor world, engine slots)``.
- ``separate``: two disjoint pools, ``actor`` with ``trainer.actor_devices`` bundles and ``rollout`` with
  ``trainer.rollout_devices`` bundles (on CPU-only nodes, null means "exactly what is needed").

A device is a GPU on GPU nodes and a process slot on CPU-only nodes. Bundles are ``{"GPU": 1, "CPU": c}``
or ``{"CPU": c}``. The plan speaks of *slots*: engine ``e`` with rollout TP ``t`` owns slots
``e*t .. e*t+t-1`` of its pool, actor rank ``i`` slot ``i``.

Slots become bundles only once Ray has placed the group (``bind_slots``): Ray does not keep bundle ``i``
of a PACK group on node ``i // gpus_per_node`` (it sorts identical bundles with an unstable sort, which
scrambles groups of more than 16), so slot ``s`` takes the ``s``-th bundle in node order (nodes in the
order of their first bundle, bundles by index within a node), as read from ``placement_group_table``.
Every TP group of the actor and every engine then sits on one node whenever each node holds a multiple
of the TP size. A group that still spans nodes is refused on GPU nodes (its collectives would cross the
network) and logged on CPU-only nodes, where tests spread gloo TP groups over raylets on purpose.

``plan_placement(cfg)`` is a pure function of the config and its parallel layout (unit-tested);
``ResourcePools.create(plan)`` makes the Ray placement groups, binds the slots, and hands out the
``WorkerGroup`` and engine-actor arguments. The placement strategy (PACK fills nodes one by one, SPREAD spreads) is a parameter: the
config has no key for it yet.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Sequence

from megatron_arpo.errors import InputError
from megatron_arpo.parallel_layout import ParallelLayout

logger = logging.getLogger(__name__)

PLACEMENTS = ("colocated", "separate")
STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")


class PlacementError(InputError):
    """A TP group or an engine would span nodes: the cluster's shape does not fit the parallel sizes."""


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
    actor_bundles: tuple[int, ...]  # slot of actor rank i
    actor_tensor_parallel: int  # consecutive ranks of one TP group, which must share a node
    actor_num_cpus: float
    actor_num_gpus: float
    rollout_pool: str
    engine_bundles: tuple[tuple[int, ...], ...]  # slots of engine e (its TP workers)
    engine_num_cpus: float
    engine_num_gpus: float

    def describe(self) -> str:
        pools = "; ".join(f"{p.name}: {p.size} x {dict(p.bundles[0])} {p.strategy}" for p in self.pools.values())
        return (f"{self.placement} on {'GPU' if self.on_gpu else 'CPU'} — pools {pools}; actor ranks -> "
                f"{self.actor_pool}{list(self.actor_bundles)}; engines -> {self.rollout_pool}"
                f"{[list(b) for b in self.engine_bundles]}")


def _bundle(on_gpu: bool, cpus: float) -> dict[str, float]:
    return {"GPU": 1.0, "CPU": float(cpus)} if on_gpu else {"CPU": float(cpus)}


def plan_placement(cfg: Any, *, layout: Optional[ParallelLayout] = None, strategy: str = "PACK",
                   cpus_per_bundle: Optional[float] = None, colocate_share: float = 0.5) -> PlacementPlan:
    """The bundle plan for ``cfg`` (an ExperimentConfig) and its ``layout`` (default ``cfg.layout``, which
    checked that the devices hold the actor ranks and the engines). Raises naming the config keys when a TP
    group or an engine would span nodes."""
    if strategy not in STRATEGIES:
        raise ValueError(f"placement strategy {strategy!r} is not one of {STRATEGIES}")
    if not 0 < colocate_share <= 1:
        raise ValueError(f"colocate_share must be in (0, 1], got {colocate_share}")
    layout = cfg.layout if layout is None else layout  # validated: the pools below hold what it asks for
    gpus_per_node = layout.gpus_per_node
    on_gpu = gpus_per_node > 0
    if layout.placement not in PLACEMENTS:
        raise ValueError(f"trainer.placement: {layout.placement!r}; allowed: {list(PLACEMENTS)}")
    if cpus_per_bundle is None:
        # On GPU nodes the node's CPUs are split over its GPUs; otherwise one CPU per process slot.
        cpus_per_task = cfg.launcher.cpus_per_task
        cpus_per_bundle = max(1, (cpus_per_task or gpus_per_node) // gpus_per_node) if on_gpu else 1
    if cpus_per_bundle <= 0:
        raise ValueError(f"cpus_per_bundle must be > 0, got {cpus_per_bundle}")
    world, slots_per_engine, engine_slots = layout.world_size, layout.engine_tp, layout.engine_slots
    if on_gpu and gpus_per_node % slots_per_engine:
        # vLLM's ray executor puts an engine's workers on its own bundles; bundles are packed node by node,
        # so an engine whose TP does not divide a node's GPUs would straddle two nodes.
        raise ValueError(f"rollout.tensor_parallel = {slots_per_engine} GPUs per engine do not divide the "
                         f"{gpus_per_node} GPUs of a node (launcher.gpus_per_node): an engine would span two "
                         f"nodes; use a divisor of {gpus_per_node}")
    actor_tp = layout.tp
    if on_gpu and gpus_per_node % actor_tp:
        raise PlacementError(f"actor.tensor_parallel = {actor_tp} does not divide the {gpus_per_node} GPUs of a node "
                             f"(launcher.gpus_per_node): a TP group would span nodes and run its collectives over "
                             f"the network; use a divisor of {gpus_per_node}, or nodes with a multiple of "
                             f"{actor_tp} GPUs")

    if layout.placement == "colocated":
        size = layout.total_devices if on_gpu else max(world, engine_slots)
        pool = PoolPlan("shared", tuple(_bundle(on_gpu, cpus_per_bundle) for _ in range(size)), strategy)
        pools = {"shared": pool}
        actor_pool = rollout_pool = "shared"
        share = colocate_share
    else:
        # CPU-only nodes: the pools hold exactly what is needed unless their sizes are given.
        actor_size = layout.actor_devices if layout.actor_devices is not None else world
        rollout_size = layout.rollout_devices if layout.rollout_devices is not None else engine_slots
        pools = {"actor": PoolPlan("actor", tuple(_bundle(on_gpu, cpus_per_bundle) for _ in range(actor_size)),
                                   strategy),
                 "rollout": PoolPlan("rollout", tuple(_bundle(on_gpu, cpus_per_bundle) for _ in range(rollout_size)),
                                     strategy)}
        actor_pool, rollout_pool = "actor", "rollout"
        share = 1.0

    engine_bundles = tuple(tuple(range(e * slots_per_engine, (e + 1) * slots_per_engine))
                           for e in range(layout.num_engines))
    return PlacementPlan(
        placement=layout.placement, on_gpu=on_gpu, pools=pools,
        actor_pool=actor_pool, actor_bundles=tuple(range(world)), actor_tensor_parallel=actor_tp,
        actor_num_cpus=cpus_per_bundle * share, actor_num_gpus=share if on_gpu else 0.0,
        rollout_pool=rollout_pool, engine_bundles=engine_bundles,
        engine_num_cpus=cpus_per_bundle * share, engine_num_gpus=share if on_gpu else 0.0,
    )


def node_order(bundle_nodes: Sequence[str]) -> list[int]:
    """Bundle indices node by node: nodes in the order of their first bundle, bundles by index within one.

    Slot ``s`` of a pool takes bundle ``node_order(...)[s]``; when Ray kept the bundles node-contiguous
    this is the identity."""
    first: dict[str, int] = {}
    for node in bundle_nodes:
        first.setdefault(node, len(first))
    return sorted(range(len(bundle_nodes)), key=lambda b: (first[bundle_nodes[b]], b))


def read_bundle_nodes(placement_group: Any) -> list[str]:
    """Node id of each bundle of a ready placement group, from Ray's placement-group table."""
    # deferred: pulls in ray (heavy; this module imports without it)
    import ray  # optional heavy dependency: planning runs without Ray

    table = ray.util.placement_group_table(placement_group)
    by_bundle = {int(k): v for k, v in (table.get("bundles_to_node_id") or {}).items()}
    nodes = [by_bundle.get(i) for i in range(len(table["bundles"]))]
    if any(n is None for n in nodes):
        raise RuntimeError(f"placement group {table.get('name')!r} ({table.get('state')}): bundles "
                           f"{[i for i, n in enumerate(nodes) if n is None]} have no node yet; wait for pg.ready()")
    return nodes


def split_groups(groups: Sequence[tuple[str, Sequence[str]]]) -> list[str]:
    """Labels of the ``(label, node of each member)`` groups whose members are on more than one node."""
    return [label for label, nodes in groups if len(set(nodes)) > 1]


def refuse_split_groups(groups: Sequence[tuple[str, Sequence[str]]], detail: str, fix: str, *, strict: bool) -> None:
    """Raise ``PlacementError`` (``strict``) or log a warning when a group spans nodes; one line either way."""
    split = split_groups(groups)
    if not split:
        return
    more = f" (and {len(split) - 1} more)" if len(split) > 1 else ""
    message = f"{split[0]}{more} would span nodes: {detail}; {fix}"
    if strict:
        raise PlacementError(message)
    logger.warning("%s (allowed on CPU-only nodes: gloo runs the group over TCP)", message)


def _node_counts(nodes: Sequence[str]) -> str:
    counts: dict[str, int] = {}
    for node in nodes:
        counts[node] = counts.get(node, 0) + 1
    return " + ".join(str(c) for c in counts.values()) + f" bundles on its {len(counts)} node(s) " + \
        ", ".join(node[:8] for node in counts)


@dataclass(frozen=True)
class BoundSlots:
    """Where the slots of a PlacementPlan landed: bundle index and node of each actor rank and engine."""

    actor_bundles: tuple[int, ...]
    actor_nodes: tuple[str, ...]
    engine_bundles: tuple[tuple[int, ...], ...]
    engine_nodes: tuple[tuple[str, ...], ...]


def bind_slots(plan: PlacementPlan, bundle_nodes: Mapping[str, Sequence[str]], *,
               strict: Optional[bool] = None) -> BoundSlots:
    """Map the plan's slots to bundles in node order (``node_order``) given each pool's bundle->node table.

    Refuses (``strict``, default: on GPU nodes) with ``PlacementError`` when an actor TP group (consecutive
    ranks, as Megatron orders them) or an engine still spans nodes; on CPU-only nodes it logs a warning."""
    strict = plan.on_gpu if strict is None else strict
    for name, pool in plan.pools.items():
        if len(bundle_nodes[name]) != pool.size:
            raise ValueError(f"pool {name!r}: {len(bundle_nodes[name])} bundle nodes for {pool.size} bundles")
    order = {name: node_order(nodes) for name, nodes in bundle_nodes.items()}
    actor_nodes_of = bundle_nodes[plan.actor_pool]
    engine_nodes_of = bundle_nodes[plan.rollout_pool]
    actor = tuple(order[plan.actor_pool][s] for s in plan.actor_bundles)
    engines = tuple(tuple(order[plan.rollout_pool][s] for s in slots) for slots in plan.engine_bundles)
    bound = BoundSlots(actor_bundles=actor, actor_nodes=tuple(actor_nodes_of[b] for b in actor),
                       engine_bundles=engines,
                       engine_nodes=tuple(tuple(engine_nodes_of[b] for b in bundles) for bundles in engines))
    tp = plan.actor_tensor_parallel
    refuse_split_groups(
        [(f"actor ranks {g}-{g + tp - 1} (a TP group of actor.tensor_parallel = {tp})", bound.actor_nodes[g:g + tp])
         for g in range(0, len(actor) - tp + 1, tp)],
        f"pool {plan.actor_pool!r} holds {_node_counts(actor_nodes_of)}",
        f"every node must hold a multiple of {tp} of them: give each node a multiple of {tp} free GPUs "
        f"(launcher.gpus_per_node, no other job on them) or lower actor.tensor_parallel", strict=strict)
    refuse_split_groups(
        [(f"engine {e} (rollout.tensor_parallel = {len(nodes)} workers)", nodes)
         for e, nodes in enumerate(bound.engine_nodes)],
        f"pool {plan.rollout_pool!r} holds {_node_counts(engine_nodes_of)}",
        "every node must hold a multiple of rollout.tensor_parallel of them: give each node a multiple of it in "
        "free GPUs, or lower rollout.tensor_parallel", strict=strict)
    return bound


@dataclass
class ResourcePools:
    """The Ray placement groups of a PlacementPlan (one per pool); ``remove()`` frees them."""

    plan: PlacementPlan
    groups: dict[str, Any] = field(default_factory=dict)
    bound: Optional[BoundSlots] = None

    @classmethod
    def create(cls, plan: PlacementPlan, timeout: float = 300.0, name_prefix: str = "megatron-arpo") -> "ResourcePools":
        # deferred: pulls in ray (heavy; this module imports without it)
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
            pools.bind()
        except BaseException:
            pools.remove()
            raise
        return pools

    def bind(self, strict: Optional[bool] = None) -> BoundSlots:
        """Read where Ray put each bundle and map the plan's slots onto them (``bind_slots``); call once the
        groups are ready. ``strict`` (default: on GPU nodes) refuses a TP group or engine across nodes."""
        nodes = {name: read_bundle_nodes(pg) for name, pg in self.groups.items()}
        self.bound = bind_slots(self.plan, nodes, strict=strict)
        logger.info("resource pools: %s; bundles in node order: actor ranks -> %s, engines -> %s",
                    self.plan.describe(), list(self.bound.actor_bundles), [list(b) for b in self.bound.engine_bundles])
        return self.bound

    def _bound(self) -> BoundSlots:
        if self.bound is None:
            raise RuntimeError("ResourcePools: call bind() once the placement groups are ready (create() does)")
        return self.bound

    def actor_group_kwargs(self) -> dict[str, Any]:
        """Keyword arguments of ``WorkerGroup`` that put the actor ranks in their pool."""
        p = self.plan
        return {"placement_group": self.groups[p.actor_pool], "bundle_indices": list(self._bound().actor_bundles),
                "num_cpus_per_rank": p.actor_num_cpus, "num_gpus_per_rank": p.actor_num_gpus}

    def engine_placement(self, engine_index: int) -> dict[str, Any]:
        """Keyword arguments of ``rollout.engine_actor.create_engine_actor`` for engine ``engine_index``."""
        p = self.plan
        if not 0 <= engine_index < len(p.engine_bundles):
            raise ValueError(f"engine index {engine_index} out of range 0..{len(p.engine_bundles) - 1}")
        bundles = self._bound().engine_bundles[engine_index]
        return {"placement_group": self.groups[p.rollout_pool], "bundle_index": bundles[0],
                "bundle_indices": list(bundles), "num_cpus": p.engine_num_cpus,
                "num_gpus": p.engine_num_gpus}

    def remove(self) -> None:
        if not self.groups:
            return
        # deferred: pulls in ray (heavy; this module imports without it)
        from ray.util.placement_group import remove_placement_group

        for name, pg in self.groups.items():
            try:
                remove_placement_group(pg)
            except Exception as exc:  # already removed, or the cluster is gone
                logger.warning("removing resource pool %r failed: %s", name, exc)
        self.groups = {}
        self.bound = None
