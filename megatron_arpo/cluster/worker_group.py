"""A group of Ray actors, one per rank, each owning an instance of a plain (Ray-free) worker class.

``WorkerGroup(worker_cls, world_size, ...)`` is how the trainer runs distributed workers (the Megatron
ranks of ``megatron_arpo.actor.group.ActorGroup``) on Ray:

1. **Placement.** One placement-group bundle per rank — ``{"CPU": c}`` on CPU, ``{"GPU": 1, "CPU": c}`` on
   GPU — with strategy ``PACK`` (fill a node first) or ``SPREAD``/``STRICT_*``. Or the caller passes a
   placement group it owns (a resource pool from ``megatron_arpo.cluster.placement``) and the bundle
   index of each rank; then the rank actors may take a fraction of a bundle (colocated time-slicing).
   Without bundle indices, rank ``r`` takes the ``r``-th bundle in node order
   (``megatron_arpo.cluster.placement.node_order``), so consecutive ranks share a node.
2. **Actors.** Each rank is a ``_RankActor`` started with ``PlacementGroupSchedulingStrategy`` and a
   runtime_env carrying ``OMP_NUM_THREADS`` (from the CPUs per rank), ``GLOO_SOCKET_IFNAME`` /
   ``NCCL_SOCKET_IFNAME`` when the driver has them, and any extra env vars. The rank actor is the only
   Ray-aware piece: the worker class never imports Ray.
3. **Rendezvous.** Rank 0's actor reports its node IP and a port that is free on that node; then every
   rank constructs ``worker_cls(*args, rank=r, world_size=w, master_addr=a, master_port=p, **kwargs)``
   concurrently (a constructor may join a process group, which blocks until all ranks arrive), with
   ``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK`` also in its environment.
4. **Calls.** ``call_all`` (same arguments to every rank), ``dispatch`` (one shard per rank),
   ``call_rank`` (one rank), ``get_all`` (an attribute or property), each returning results in rank
   order, and ``submit_*`` variants returning a ``PendingCall`` for overlap. Every blocking wait has a
   timeout. Results are collected as they finish, so the first failing rank is reported at once — its
   peers may be stuck in a collective waiting for it, and waiting for them would hang. Errors
   (``WorkerGroupError``) name the group, the rank, its node and the method; a dead actor, an exception
   and a timeout are told apart. After a timeout or a dead rank the group refuses further calls.
5. **Shutdown.** ``shutdown()`` optionally calls the worker's own ``shutdown`` method (short timeout),
   then kills exactly this group's actors and removes the placement group if the group created it.

``placement`` lists where each rank landed (node id, IP, hostname, pid, bundle); it is logged at start.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Mapping, Optional, Sequence

from megatron_arpo.cluster.placement import node_order, read_bundle_nodes

logger = logging.getLogger(__name__)

STRATEGIES = ("PACK", "SPREAD", "STRICT_PACK", "STRICT_SPREAD")
FORWARDED_ENV = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME", "NCCL_DEBUG", "TP_SOCKET_IFNAME")


class WorkerGroupError(RuntimeError):
    """A rank of a WorkerGroup failed: ``rank``, ``node`` (IP and short node id), ``method`` and ``kind``
    (``exception``, ``actor_died``, ``timeout``, ``startup``; ``broken``/``closed`` for a call refused
    because an earlier call killed or hung a rank, or after ``shutdown``) say where and how."""

    def __init__(self, message: str, *, group: str, method: str, kind: str, rank: Optional[int] = None,
                 node: Optional[str] = None):
        self.group, self.method, self.kind, self.rank, self.node = group, method, kind, rank, node
        super().__init__(message)


class WorkerGroupTimeout(WorkerGroupError, TimeoutError):
    """A call did not finish on every rank within its timeout; ``pending_ranks`` lists the slow ones."""

    def __init__(self, message: str, *, pending_ranks: Sequence[int], **kw: Any):
        self.pending_ranks = list(pending_ranks)
        super().__init__(message, **kw)


@dataclass(frozen=True)
class RankPlacement:
    """Where one rank's actor runs."""

    rank: int
    node_id: str
    node_ip: str
    hostname: str
    pid: int
    bundle_index: int

    @property
    def node(self) -> str:
        return f"{self.node_ip} (node {self.node_id[:8]})"


class _RankActor:
    """Ray actor body for one rank: reports its location and owns the worker instance."""

    def __init__(self, rank: int, world_size: int):
        self.rank, self.world_size = rank, world_size
        self.worker: Any = None

    def node_info(self) -> dict:
        # deferred: pulls in ray (heavy; this module imports without it)
        import ray

        return {"node_id": ray.get_runtime_context().get_node_id(), "node_ip": ray.util.get_node_ip_address(),
                "hostname": socket.gethostname(), "pid": os.getpid()}

    def get_address(self) -> tuple[str, int]:
        """This node's IP and a TCP port free on it (for rank 0's rendezvous)."""
        # deferred: pulls in ray (heavy; this module imports without it)
        import ray

        ip = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("", 0))
            return ip, sock.getsockname()[1]

    def construct(self, worker_cls: type, args: Sequence, kwargs: Mapping, master_addr: str,
                  master_port: int) -> None:
        os.environ.update({"MASTER_ADDR": str(master_addr), "MASTER_PORT": str(master_port),
                           "RANK": str(self.rank), "WORLD_SIZE": str(self.world_size), "LOCAL_RANK": "0"})
        self.worker = worker_cls(*args, rank=self.rank, world_size=self.world_size, master_addr=master_addr,
                                 master_port=master_port, **kwargs)

    def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if self.worker is None:
            raise RuntimeError(f"rank {self.rank}: the worker was not constructed (call {method!r} after start)")
        return getattr(self.worker, method)(*args, **kwargs)

    def get_attr(self, name: str) -> Any:
        if self.worker is None:
            raise RuntimeError(f"rank {self.rank}: the worker was not constructed (read {name!r} after start)")
        return getattr(self.worker, name)

    def has_method(self, method: str) -> bool:
        return callable(getattr(self.worker, method, None))


class PendingCall:
    """Refs of one call in flight on some ranks; ``result()`` waits (with a timeout) and returns rank order."""

    def __init__(self, group: "WorkerGroup", method: str, ranks: Sequence[int], refs: Sequence[Any],
                 timeout: float):
        self.group, self.method, self.ranks, self.refs, self.timeout = group, method, list(ranks), list(refs), timeout

    def result(self, timeout: Optional[float] = None) -> list:
        return self.group._gather(self.method, self.ranks, self.refs, self.timeout if timeout is None else timeout)


def default_env(num_cpus_per_rank: float, environ: Mapping[str, str] | None = None) -> dict[str, str]:
    """Env vars every rank actor gets: OMP threads from its CPU share, the driver's NIC choices."""
    environ = os.environ if environ is None else environ
    env = {"OMP_NUM_THREADS": str(max(1, int(num_cpus_per_rank))), "RAY_USAGE_STATS_ENABLED": "0"}
    env.update({k: environ[k] for k in FORWARDED_ENV if environ.get(k)})
    return env


def rank_bundles(world_size: int, num_cpus_per_rank: float, num_gpus_per_rank: float) -> list[dict[str, float]]:
    bundle = {"CPU": float(num_cpus_per_rank)}
    if num_gpus_per_rank:
        bundle["GPU"] = float(num_gpus_per_rank)
    return [dict(bundle) for _ in range(world_size)]


class WorkerGroup:
    """``world_size`` Ray actors each owning ``worker_cls(...)``; see the module docstring."""

    def __init__(
        self,
        worker_cls: type,
        world_size: int,
        *,
        args: Sequence = (),
        kwargs: Optional[Mapping[str, Any]] = None,
        rank_kwargs: Optional[Sequence[Mapping[str, Any]]] = None,
        name: str = "workers",
        num_cpus_per_rank: float = 1.0,
        num_gpus_per_rank: float = 0.0,
        strategy: str = "PACK",
        placement_group: Any = None,
        bundle_indices: Optional[Sequence[int]] = None,
        env: Optional[Mapping[str, str]] = None,
        startup_timeout: float = 300.0,
        default_timeout: float = 3600.0,
    ):
        if world_size < 1:
            raise ValueError(f"WorkerGroup {name!r}: world_size must be >= 1, got {world_size}")
        if strategy not in STRATEGIES:
            raise ValueError(f"WorkerGroup {name!r}: strategy {strategy!r} is not one of {STRATEGIES}")
        if rank_kwargs is not None and len(rank_kwargs) != world_size:
            raise ValueError(f"WorkerGroup {name!r}: rank_kwargs has {len(rank_kwargs)} entries for world_size "
                             f"{world_size}; give one mapping per rank")
        if placement_group is None and bundle_indices is not None:
            raise ValueError(f"WorkerGroup {name!r}: bundle_indices needs a placement_group")
        if bundle_indices is not None and len(bundle_indices) != world_size:
            raise ValueError(f"WorkerGroup {name!r}: {len(bundle_indices)} bundle_indices for world_size {world_size}")
        self.worker_cls, self.world_size, self.name = worker_cls, world_size, name
        self.startup_timeout, self.default_timeout = startup_timeout, default_timeout
        self.placement: list[RankPlacement] = []
        self.master_addr: Optional[str] = None
        self.master_port: Optional[int] = None
        self._actors: list[Any] = []
        self._owns_pg = placement_group is None
        self._pg = placement_group
        self._bundle_indices = list(bundle_indices) if bundle_indices is not None else None
        self._broken: Optional[str] = None
        self._closed = False
        env_vars = default_env(num_cpus_per_rank)
        env_vars.update(env or {})
        try:
            self._start(args, dict(kwargs or {}), rank_kwargs, num_cpus_per_rank, num_gpus_per_rank, strategy,
                        env_vars)
        except BaseException:
            self.shutdown(graceful=False)
            raise

    # -- start -----------------------------------------------------------------------------------------

    def _start(self, args, kwargs, rank_kwargs, num_cpus, num_gpus, strategy, env_vars) -> None:
        # deferred: pulls in ray (heavy; this module imports without it)
        import ray
        from ray.util.placement_group import placement_group as make_pg
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        if self._pg is None:
            bundles = rank_bundles(self.world_size, num_cpus, num_gpus)
            self._pg = make_pg(bundles, strategy=strategy, name=f"{self.name}-pg")
            ready, _ = ray.wait([self._pg.ready()], timeout=self.startup_timeout)
            if not ready:
                raise WorkerGroupError(
                    f"WorkerGroup {self.name!r}: placement group of {self.world_size} bundles {bundles[0]} "
                    f"({strategy}) could not be placed within {self.startup_timeout:.0f} s; the cluster has "
                    f"{ray.cluster_resources()} with {ray.available_resources()} free. Lower the world size or "
                    f"the CPUs per rank, or add nodes", group=self.name, method="placement_group", kind="startup")
        if self._bundle_indices is None:
            if not self._owns_pg:
                ray.wait([self._pg.ready()], timeout=self.startup_timeout)
            # Rank r takes the r-th bundle in node order, not bundle r: Ray may scramble a group's bundle order.
            self._bundle_indices = node_order(read_bundle_nodes(self._pg))[:self.world_size]
        rank_actor = ray.remote(_RankActor)
        for rank in range(self.world_size):
            strategy_obj = PlacementGroupSchedulingStrategy(
                placement_group=self._pg, placement_group_bundle_index=self._bundle_indices[rank],
                placement_group_capture_child_tasks=True)
            actor = rank_actor.options(
                num_cpus=num_cpus, num_gpus=num_gpus, scheduling_strategy=strategy_obj,
                runtime_env={"env_vars": env_vars}, name=None, max_restarts=0,
            ).remote(rank, self.world_size)
            self._actors.append(actor)
        infos = self._gather("node_info", range(self.world_size),
                             [a.node_info.remote() for a in self._actors], self.startup_timeout)
        self.placement = [RankPlacement(rank=r, bundle_index=self._bundle_indices[r], **info)
                          for r, info in enumerate(infos)]
        logger.info("WorkerGroup %r placement: %s", self.name, self.placement_summary())
        self.master_addr, self.master_port = self._gather(
            "get_address", [0], [self._actors[0].get_address.remote()], self.startup_timeout)[0]
        refs = [actor.construct.remote(self.worker_cls, tuple(args),
                                       {**kwargs, **(rank_kwargs[r] if rank_kwargs else {})},
                                       self.master_addr, self.master_port)
                for r, actor in enumerate(self._actors)]
        self._gather(f"{self.worker_cls.__name__}.__init__", range(self.world_size), refs, self.startup_timeout)
        logger.info("WorkerGroup %r: %d ranks of %s up, rendezvous %s:%d", self.name, self.world_size,
                    self.worker_cls.__name__, self.master_addr, self.master_port)

    # -- calls -----------------------------------------------------------------------------------------

    @property
    def actors(self) -> list[Any]:
        """The rank actors' handles, in rank order (for callers that need refs, e.g. weight sync)."""
        return list(self._actors)

    @property
    def placement_group(self) -> Any:
        return self._pg

    def nodes(self) -> list[str]:
        """Node id of each rank, in rank order."""
        return [p.node_id for p in self.placement]

    def placement_summary(self) -> str:
        return ", ".join(f"rank {p.rank}: {p.node} pid {p.pid} bundle {p.bundle_index}" for p in self.placement)

    def _check_usable(self, method: str) -> None:
        if self._closed:
            raise WorkerGroupError(f"WorkerGroup {self.name!r}: {method} called after shutdown()", group=self.name,
                                   method=method, kind="closed")
        if self._broken:
            raise WorkerGroupError(f"WorkerGroup {self.name!r}: cannot call {method}: {self._broken}; shut the group "
                                   f"down and start a new one", group=self.name, method=method, kind="broken")

    def submit_all(self, method: str, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> PendingCall:
        self._check_usable(method)
        refs = [actor.call.remote(method, *args, **kwargs) for actor in self._actors]
        return PendingCall(self, method, range(self.world_size), refs, self._timeout(timeout))

    def submit_dispatch(self, method: str, shards: Sequence[Any], *args: Any, timeout: Optional[float] = None,
                        **kwargs: Any) -> PendingCall:
        self._check_usable(method)
        if len(shards) != self.world_size:
            raise ValueError(f"WorkerGroup {self.name!r}: dispatch({method!r}) got {len(shards)} shards for "
                             f"{self.world_size} ranks; give exactly one per rank")
        refs = [actor.call.remote(method, shard, *args, **kwargs) for actor, shard in zip(self._actors, shards)]
        return PendingCall(self, method, range(self.world_size), refs, self._timeout(timeout))

    def call_all(self, method: str, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> list:
        """Call ``worker.method(*args, **kwargs)`` on every rank; results in rank order."""
        return self.submit_all(method, *args, timeout=timeout, **kwargs).result()

    def dispatch(self, method: str, shards: Sequence[Any], *args: Any, timeout: Optional[float] = None,
                 **kwargs: Any) -> list:
        """Call ``worker.method(shards[rank], *args, **kwargs)`` on every rank; results in rank order."""
        return self.submit_dispatch(method, shards, *args, timeout=timeout, **kwargs).result()

    def get_all(self, attribute: str, timeout: Optional[float] = None) -> list:
        """``worker.<attribute>`` (e.g. a property) of every rank, in rank order."""
        self._check_usable(attribute)
        refs = [actor.get_attr.remote(attribute) for actor in self._actors]
        return self._gather(attribute, range(self.world_size), refs, self._timeout(timeout))

    def call_rank(self, rank: int, method: str, *args: Any, timeout: Optional[float] = None, **kwargs: Any) -> Any:
        """Call ``worker.method`` on one rank only (no collective may be involved)."""
        self._check_usable(method)
        if not 0 <= rank < self.world_size:
            raise ValueError(f"WorkerGroup {self.name!r}: rank {rank} out of range 0..{self.world_size - 1}")
        ref = self._actors[rank].call.remote(method, *args, **kwargs)
        return self._gather(method, [rank], [ref], self._timeout(timeout))[0]

    def _timeout(self, timeout: Optional[float]) -> float:
        return self.default_timeout if timeout is None else float(timeout)

    def _node_of(self, rank: int) -> str:
        return self.placement[rank].node if rank < len(self.placement) else "an unplaced node"

    def _gather(self, method: str, ranks: Sequence[int], refs: Sequence[Any], timeout: float) -> list:
        """Wait for ``refs`` (one per rank in ``ranks``); raise on the first failure or at the deadline."""
        # deferred: pulls in ray (heavy; this module imports without it)
        import ray
        from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

        ranks = list(ranks)
        rank_of = {ref: rank for ref, rank in zip(refs, ranks)}
        results: dict[int, Any] = {}
        pending = list(refs)
        deadline = time.monotonic() + timeout
        while pending:
            remaining = deadline - time.monotonic()
            ready, pending = (ray.wait(pending, num_returns=1, timeout=remaining) if remaining > 0
                              else ([], pending))
            if not ready:
                slow = sorted(rank_of[ref] for ref in pending)
                self._broken = f"{method} timed out after {timeout:.1f} s on ranks {slow}"
                nodes = ", ".join(f"rank {r} on {self._node_of(r)}" for r in slow)
                raise WorkerGroupTimeout(
                    f"WorkerGroup {self.name!r}: {method} did not finish within {timeout:.1f} s on {nodes} "
                    f"({len(results)} of {len(ranks)} ranks finished). Those ranks may be stuck (e.g. in a "
                    f"collective whose peer failed); shut the group down", pending_ranks=slow, group=self.name,
                    method=method, kind="timeout", rank=slow[0], node=self._node_of(slow[0]))
            ref = ready[0]
            rank = rank_of[ref]
            try:
                results[rank] = ray.get(ref, timeout=max(1.0, deadline - time.monotonic()))
            except RayTaskError as exc:
                cause = exc.cause if getattr(exc, "cause", None) is not None else exc
                raise WorkerGroupError(
                    f"WorkerGroup {self.name!r}: rank {rank} on {self._node_of(rank)} raised in {method}: "
                    f"{type(cause).__name__}: {cause}", group=self.name, method=method, kind="exception",
                    rank=rank, node=self._node_of(rank)) from exc
            except RayActorError as exc:
                self._broken = f"rank {rank} on {self._node_of(rank)} died during {method}"
                raise WorkerGroupError(
                    f"WorkerGroup {self.name!r}: the actor of rank {rank} on {self._node_of(rank)} died during "
                    f"{method} ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); the group "
                    f"is unusable, shut it down", group=self.name, method=method, kind="actor_died", rank=rank,
                    node=self._node_of(rank)) from exc
            except GetTimeoutError as exc:  # ready refs should not time out; treat it like one anyway
                raise WorkerGroupTimeout(f"WorkerGroup {self.name!r}: fetching the result of {method} from rank "
                                         f"{rank} timed out", pending_ranks=[rank], group=self.name, method=method,
                                         kind="timeout", rank=rank, node=self._node_of(rank)) from exc
        return [results[r] for r in ranks]

    # -- shutdown --------------------------------------------------------------------------------------

    def shutdown(self, graceful: bool = True, method: str = "shutdown", timeout: float = 30.0) -> None:
        """Stop the group: ``worker.<method>()`` on every rank if it exists (errors logged), then kill the
        rank actors and remove the placement group if this group created it. Idempotent."""
        if self._closed:
            return
        # deferred: pulls in ray (heavy; this module imports without it)
        import ray
        from ray.util.placement_group import remove_placement_group

        if graceful and self._actors and not self._broken and len(self.placement) == self.world_size:
            try:
                has = self._gather("has_method", range(self.world_size),
                                   [a.has_method.remote(method) for a in self._actors], timeout)
                if all(has):
                    self.call_all(method, timeout=timeout)
            except WorkerGroupError as exc:
                logger.warning("WorkerGroup %r: graceful %s failed, killing the actors: %s", self.name, method, exc)
        for actor in self._actors:
            try:
                ray.kill(actor, no_restart=True)
            except Exception as exc:  # already dead or never started: nothing to kill
                logger.debug("WorkerGroup %r: ray.kill: %s", self.name, exc)
        self._actors = []
        if self._owns_pg and self._pg is not None:
            try:
                remove_placement_group(self._pg)
            except Exception as exc:
                logger.warning("WorkerGroup %r: removing its placement group failed: %s", self.name, exc)
            self._pg = None
        self._closed = True

    def __enter__(self) -> "WorkerGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown(graceful=exc[0] is None)
