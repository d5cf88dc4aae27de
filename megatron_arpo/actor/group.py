"""The driver's view of the Megatron actor: one object over TP x PP x DP Ray actors, one per rank.

``ActorGroup(cfg)`` starts a ``megatron_arpo.cluster.worker_group.WorkerGroup`` of
``megatron_arpo.actor.worker.MegatronActorWorker`` (TP x PP x DP from ``cfg.layout``, the run's
``megatron_arpo.parallel_layout.ParallelLayout``), in its own placement group or in the actor pool of
``megatron_arpo.cluster.placement.ResourcePools``, then
``init_model`` on every rank. After start it asks each rank for its Megatron coordinates
(``dp_rank``, ``tp_rank``, ``pp_rank``, ``is_last_stage``) rather than assuming Megatron's rank order.

Every call is collective over the whole group:

- ``compute_log_probs(batch)`` and ``update(batch)`` / ``sft_step(batch)`` cut the batch into one shard
  per DP replica (``packing.split_for_data_parallel``: mini-batch aware, token balanced) and give every
  rank of a replica that replica's shard.
- Per-sequence results are read from one *representative* rank per replica — the last pipeline stage
  with TP rank 0, the rank that owns the unsharded values — and put back in the batch's order
  (``packing.merge_data_parallel_outputs``).
- Metrics are averaged over the replicas' representatives. The worker already all-reduces the loss,
  clip fractions, token counts and grad norm over DP, so those are global values; what stays local
  (padding fraction, tokens/s) becomes the replica mean.
- ``save``/``load`` return rank 0's answer.
- ``sync_weights(engines)``: the weights go from the actor ranks straight into the engines; this object
  only coordinates (``megatron_arpo.weight_sync.protocol``): it opens the transfer once, then per sync
  starts the engines' update, lets every rank stream its share (each pipeline stage's sender its own
  layers; with expert parallelism each EP rank's sender its own experts), finishes the update (the engines check the load) and drops the prefix caches. No weight
  byte passes through the driver; the report counts what did (``driver_bytes``, ``driver_weight_bytes``).
- ``offload_state``/``onload_state`` (colocated ``actor.offload``): every rank's grad buffers and
  optimizer state leave the GPU and come back; returns the slowest rank's seconds and the largest rank's
  bytes.

Each call waits at most the matching ``trainer.timeouts`` value; a failing or dead rank raises
``WorkerGroupError`` naming the rank, its node and the method.
"""

from __future__ import annotations

import logging
import time
from typing import Any, Mapping, Optional, Sequence

from megatron_arpo.actor import packing
from megatron_arpo.actor.sync_sender import TIED_HEAD_ALIASES
from megatron_arpo.actor.worker import MegatronActorWorker
from megatron_arpo.cluster.placement import ResourcePools, refuse_split_groups
from megatron_arpo.cluster.worker_group import WorkerGroup, WorkerGroupError
from megatron_arpo.config import ExperimentConfig, resolved_model
from megatron_arpo.hf.mapping import bind_table
from megatron_arpo.parallel_layout import ParallelLayout
from megatron_arpo.weight_sync import protocol as ws
from megatron_arpo.weight_sync.protocol import WeightSyncError

logger = logging.getLogger(__name__)

LAYOUT_KEYS = ("dp_rank", "tp_rank", "pp_rank", "is_last_stage")
VERIFY_FRACTION = 0.25  # rollout.verify_sync: share of tensor names checksummed per sync (deterministic per sync)


def verifies_sync(mode: str | bool, syncs_done: int) -> bool:
    """``rollout.verify_sync`` for the next sync of this process: ``first`` checks the first one (of a run, or
    of a resumed run's process), ``true`` every one, ``false`` none."""
    if isinstance(mode, bool):
        return mode
    if mode not in ("first", "true", "false"):
        raise ValueError(f"rollout.verify_sync={mode!r}; allowed: first, true, false")
    return mode == "true" or (mode == "first" and syncs_done == 0)


def mean_metrics(metrics: Sequence[Mapping[str, float]]) -> dict[str, float]:
    """Key-wise mean over replicas; keys missing on some replica are averaged over those that have them."""
    keys: list[str] = []
    for m in metrics:
        keys.extend(k for k in m if k not in keys)
    out = {}
    for key in keys:
        values = [float(m[key]) for m in metrics if key in m]
        out[key] = sum(values) / len(values)
    return out


class ActorGroup:
    """TP x PP x DP Megatron ranks as Ray actors, driven as one object (see the module docstring)."""

    def __init__(
        self,
        cfg: ExperimentConfig,
        *,
        role: str = "policy",
        hf_dir: Optional[str] = None,
        load_dir: Optional[str] = None,
        total_steps: Optional[int] = None,
        pools: Optional[ResourcePools] = None,
        strategy: str = "PACK",
        num_cpus_per_rank: Optional[float] = None,
        env: Optional[Mapping[str, str]] = None,
        worker_cls: Optional[type] = None,
        worker_kwargs: Optional[Mapping[str, Any]] = None,
        name: Optional[str] = None,
        optim_settings: Any = None,
        transport: Optional[str] = None,
        parallel: Optional[ParallelLayout] = None,
    ):
        self.cfg, self.role = cfg, role
        self.parallel = cfg.layout if parallel is None else parallel
        self.tp, self.pp, self.dp = self.parallel.tp, self.parallel.pp, self.parallel.dp
        self.world_size = self.parallel.world_size
        self.timeouts = cfg.trainer.timeouts
        self.transport = transport  # the weight-sync transport (`megatron_arpo.weight_sync.protocol.choose_transport`)
        self._sync = None
        self._syncs_done = 0   # finished weight syncs of this process (rollout.verify_sync: first)
        worker_cls = MegatronActorWorker if worker_cls is None else worker_cls
        on_gpu = self.parallel.gpus_per_node > 0
        if pools is not None:
            placement_kwargs = pools.actor_group_kwargs()
            if len(placement_kwargs["bundle_indices"]) != self.world_size:
                raise ValueError(f"the actor pool places {len(placement_kwargs['bundle_indices'])} ranks but the "
                                 f"actor world size is {self.world_size}")
            if num_cpus_per_rank is not None:
                placement_kwargs["num_cpus_per_rank"] = num_cpus_per_rank
        else:
            placement_kwargs = {"strategy": strategy, "num_cpus_per_rank": num_cpus_per_rank or 1.0,
                                "num_gpus_per_rank": 1.0 if on_gpu else 0.0}
        self.workers = WorkerGroup(
            worker_cls, self.world_size, args=(cfg,), kwargs={"role": role, **(worker_kwargs or {})},
            name=name or f"actor-{role}", env=env, startup_timeout=self.timeouts.startup_s,
            default_timeout=self.timeouts.update_s, **placement_kwargs)
        try:
            self._read_layout()
            self._check_tp_groups_on_one_node(on_gpu)
            # optim_settings: the optimizer/LR schedule when it is not RL's (SFT: optimizer.settings_for_sft).
            extra = {} if optim_settings is None else {"optim_settings": optim_settings}
            self.init_state = self.workers.call_all("init_model", hf_dir=hf_dir, load_dir=load_dir,
                                                    total_steps=total_steps, timeout=self.timeouts.startup_s,
                                                    **extra)[0]
        except BaseException:
            self.workers.shutdown(graceful=False)
            raise
        logger.info("ActorGroup %s: tp=%d pp=%d dp=%d on %s", role, self.tp, self.pp, self.dp,
                    self.workers.placement_summary())

    def _read_layout(self) -> None:
        columns = {key: self.workers.get_all(key, timeout=self.timeouts.startup_s) for key in LAYOUT_KEYS}
        self.layout = [dict(zip(LAYOUT_KEYS, row)) for row in zip(*(columns[k] for k in LAYOUT_KEYS))]
        self.representatives: list[int] = []
        for dp_rank in range(self.dp):
            owners = [r for r, lay in enumerate(self.layout)
                      if lay["dp_rank"] == dp_rank and lay["tp_rank"] == 0 and lay["is_last_stage"]]
            if len(owners) != 1:
                raise RuntimeError(f"ActorGroup: expected one last-stage TP-rank-0 rank for DP replica {dp_rank}, "
                                   f"found {owners}; layout {self.layout}")
            self.representatives.append(owners[0])

    def _check_tp_groups_on_one_node(self, on_gpu: bool) -> None:
        """Refuse (on GPU nodes; warn on CPU-only ones) a TP group whose ranks landed on several nodes, before
        any checkpoint is loaded. The groups come from the ranks' own Megatron coordinates."""
        groups: dict[tuple[int, int], list[int]] = {}
        for rank, lay in enumerate(self.layout):
            groups.setdefault((lay["dp_rank"], lay["pp_rank"]), []).append(rank)
        nodes = self.workers.nodes()
        refuse_split_groups(
            [(f"actor ranks {ranks} (the TP group of DP rank {dp}, PP rank {pp}; actor.tensor_parallel = {self.tp})",
              [nodes[r] for r in ranks]) for (dp, pp), ranks in sorted(groups.items())],
            f"the ranks landed on nodes {[n[:8] for n in nodes]}",
            f"give each node a multiple of {self.tp} free GPUs (launcher.gpus_per_node) or lower "
            f"actor.tensor_parallel", strict=on_gpu)

    @property
    def placement(self) -> list:
        """Where each rank runs (``RankPlacement``: node id, IP, pid, bundle)."""
        return self.workers.placement

    # -- batches -------------------------------------------------------------------------------------

    def split(self, batch: Mapping[str, Any], mini_batch_size: Optional[int] = None) -> list[dict]:
        """One shard per DP replica (``packing.split_for_data_parallel``)."""
        return packing.split_for_data_parallel(batch, self.dp, mini_batch_size=mini_batch_size)

    def _rank_shards(self, shards: Sequence[dict]) -> list[dict]:
        return [shards[lay["dp_rank"]] for lay in self.layout]

    def _per_replica(self, results: Sequence[Any]) -> list[Any]:
        return [results[r] for r in self.representatives]

    def compute_log_probs(self, batch: Mapping[str, Any], with_entropy: bool = False,
                          timeout: Optional[float] = None) -> dict[str, Any]:
        """``{"logprobs": [tensor per sequence], "entropy": [...] (if asked), "padding_fraction": float}``
        in the order of ``batch["input_ids"]``; token-aligned as the worker defines them."""
        shards = self.split(batch)
        results = self.workers.dispatch("compute_log_probs", self._rank_shards(shards), with_entropy=with_entropy,
                                        timeout=self.timeouts.logprob_s if timeout is None else timeout)
        outputs = self._per_replica(results)
        merged: dict[str, Any] = {}
        for key in ("logprobs", "entropy"):
            if key in outputs[0]:
                merged[key] = packing.merge_data_parallel_outputs(shards, [o[key] for o in outputs])
        merged["padding_fraction"] = sum(o["padding_fraction"] for o in outputs) / len(outputs)
        return merged

    def update(self, batch: Mapping[str, Any], timeout: Optional[float] = None) -> dict[str, float]:
        """One PPO update over the batch (``actor.ppo_epochs`` x mini-batches); metrics averaged over DP."""
        shards = self.split(batch, mini_batch_size=self.cfg.actor.mini_batch_size)
        results = self.workers.dispatch("update", self._rank_shards(shards),
                                        timeout=self.timeouts.update_s if timeout is None else timeout)
        return mean_metrics(self._per_replica(results))

    def sft_step(self, batch: Mapping[str, Any], timeout: Optional[float] = None) -> dict[str, float]:
        """One SFT optimizer step over the (global) batch; metrics averaged over DP."""
        shards = self.split(batch)
        results = self.workers.dispatch("sft_step", self._rank_shards(shards),
                                        timeout=self.timeouts.update_s if timeout is None else timeout)
        return mean_metrics(self._per_replica(results))

    # -- checkpoints and weights ---------------------------------------------------------------------

    def save(self, path: str, extra_state: Optional[Mapping[str, Any]] = None, timeout: Optional[float] = None,
             **kwargs: Any) -> str:
        """Collective checkpoint save; returns the checkpoint directory (rank 0's answer)."""
        return self.workers.call_all("save", str(path), dict(extra_state or {}), **kwargs,
                                     timeout=self.timeouts.save_s if timeout is None else timeout)[0]

    def load(self, path: str, timeout: Optional[float] = None) -> dict:
        """Collective checkpoint load; returns the extra state (and ``step``) rank 0 read."""
        return self.workers.call_all("load", str(path),
                                     timeout=self.timeouts.save_s if timeout is None else timeout)[0]

    def sync_weights(self, engines: Any, *, verify: Optional[bool] = None, timeout: Optional[float] = None,
                     keep_in_flight: bool = False, clear_cache: bool = False,
                     version: Optional[int] = None) -> dict:
        """Send the current weights into ``engines`` (a RolloutGroup, actor handles or EngineRefs); the report.

        ``keep_in_flight``: the engines pause their requests at a step boundary instead of needing to be idle,
        and resume them on the new weights (no prefix-cache reset: the paused requests hold their blocks);
        with ``clear_cache`` the pause also drops the prefix cache and the paused requests' KV, which the new
        weights recompute (no KV of the old weights outlives the sync);
        ``version``: the engines' policy version after the sync (None: one more than before). See
        docs/weight_sync.md.

        ``verify`` (default: ``rollout.verify_sync``, see `verifies_sync`) checksums a sample of the tensors on
        both sides. Raises `WeightSyncError` (one line naming the engine) when an engine dies or fails, or a check
        fails; the engines then hold a partial update and refuse to generate until a sync completes.
        """
        r = self.cfg.rollout
        timeout = self.timeouts.sync_s if timeout is None else timeout
        refs = ws.engine_refs(engines)
        start_kwargs, finish_kwargs = ws.in_flight_kwargs(keep_in_flight, version, clear_cache)
        if self._sync is None or [e.target for e in self._sync.engines] != [e.target for e in refs]:
            self._open_sync(refs, timeout, keep_in_flight)
        verify = verifies_sync(r.verify_sync, self._syncs_done) if verify is None else verify
        sync_id = ws.next_sync_id()
        start = time.perf_counter()
        args = (sync_id, int(r.sync_bucket_mb * 2**20), VERIFY_FRACTION if verify else 0.0)
        try:
            ws.call_engines(refs, "start_weight_update", timeout=timeout, kwargs=start_kwargs)
            senders = self._call_senders("send_weights", *args, timeout=timeout)
            engine_reports = ws.call_engines(refs, "finish_weight_update", timeout=timeout, kwargs=finish_kwargs)
            if not keep_in_flight:
                ws.call_engines(refs, "reset_prefix_cache", timeout=timeout)
        except Exception:
            # The transfer group may hold a dead engine or a half-sent bucket: the next sync forms a new one
            # (the ranks leave this one when they reserve the next: ActorSync.reserve).
            self._sync = None
            raise
        moved = [ws.payload_bytes(x) for x in ([args] * self.world_size + senders + engine_reports)]
        report = ws.merge_reports(senders, engine_reports, sync_id, time.perf_counter() - start,
                                  driver_bytes=sum(p for p, _ in moved))
        report["driver_weight_bytes"] = sum(t for _, t in moved)
        self._check_complete(report, engine_reports)
        self._syncs_done += 1
        report["verify"] = bool(verify)   # whether this sync ran the checksum checks
        logger.info("weight sync %d (%s): %d tensors in %d buckets (%.1f MB) to %d engines in %.2f s; %d verified "
                    "after load", sync_id, self._sync.transport, report["tensors"], report["buckets"],
                    report["bytes"] / 2**20, len(refs), report["seconds"], len(report["verified_after_load"]))
        return report

    def _open_sync(self, refs: list, timeout: float, keep_in_flight: bool = False) -> None:
        """Form the transfer groups: the senders' endpoints, the engines' rank offsets, both sides joining."""
        self.close_sync()
        infos = ws.call_engines(refs, "weight_transfer_info", timeout=timeout)
        # The transport was chosen once, when the run started (the engines were built with it too); a group
        # given none sends over the transport the engines were started for.
        transport = self.transport or infos[0].get("transport")
        for ref, info in zip(refs, infos):
            if info.get("transport") != transport:
                raise ws.WeightSyncError(f"weight sync: engine {ref.index} was started for the "
                                         f"{info.get('transport')!r} weight transport, the actor sends over "
                                         f"{transport!r}; start the engines with weight_transfer={transport!r}")
        offsets, world = ws.transfer_ranks([info["world_size"] for info in infos])
        # One sender per pipeline stage, and with expert parallelism one per EP rank of each stage.
        endpoints: list = [None] * (self.pp * self.cfg.actor.expert_parallel)
        for reserved in self.workers.call_all("reserve_weight_sync", transport, timeout=timeout):
            if reserved is not None:
                endpoints[reserved[0]] = tuple(reserved[1])
        session = ws.SyncSession(transport, refs, [i["world_size"] for i in infos], offsets, world, endpoints)
        init_kwargs = {"keep_in_flight": True} if keep_in_flight else {}  # may join while requests run
        joining = [e.call("init_weight_transfer_engine", info, **init_kwargs)
                   for e, info in zip(refs, session.init_infos(timeout))]
        opening = self.workers.submit_all("open_weight_sync", refs, world, timeout, timeout=timeout)
        ws.wait_engines(joining, refs, "init_weight_transfer_engine", timeout)
        self._sender_result(opening)
        self._sync = session
        logger.info("weight sync open: %s, %d engine(s) of %s worker(s), group of %d, sender endpoints %s", transport,
                    len(refs), session.world_sizes, world, endpoints)

    def _call_senders(self, method: str, *args: Any, timeout: float) -> list:
        return self._sender_result(self.workers.submit_all(method, *args, timeout=timeout))

    @staticmethod
    def _sender_result(pending: Any) -> list:
        """A sender's WeightSyncError (e.g. an engine died mid-sync) surfaces as itself, in one line."""
        try:
            return pending.result()
        except WorkerGroupError as exc:
            cause = getattr(exc.__cause__, "cause", None)
            if isinstance(cause, WeightSyncError):
                raise WeightSyncError(str(cause).splitlines()[0]) from exc
            raise

    def _check_complete(self, report: dict, engine_reports: Sequence[dict]) -> None:
        """Every HF tensor of the model was sent once, and every engine loaded all of them."""
        model_cfg = resolved_model(self.cfg)
        expected = sum(len(rule.hf_outputs) for rule in bind_table(model_cfg))
        expected += len(TIED_HEAD_ALIASES) if model_cfg.tie_word_embeddings else 0
        if report["tensors"] != expected:
            raise WeightSyncError(f"weight sync {report['sync_id']}: the actor sent {report['tensors']} tensors, the "
                                  f"model has {expected}; the engines hold a partial update")
        for info in engine_reports:
            if info["loaded"] != expected or info["duplicates"]:
                raise WeightSyncError(f"weight sync {report['sync_id']}: engine {info['engine_index']} loaded "
                                      f"{info['loaded']} distinct tensors ({info['duplicates']} twice) of the "
                                      f"{expected} sent")

    def close_sync(self) -> None:
        """Leave the transfer group (the engines keep theirs until the next open replaces it)."""
        if self._sync is not None:
            self._sync = None
            try:
                self.workers.call_all("close_weight_sync", timeout=60)
            except Exception as exc:  # a broken group: shutdown kills it anyway
                logger.debug("closing the weight sync: %s", exc)

    # -- colocated memory ----------------------------------------------------------------------------

    def offload_state(self, timeout: Optional[float] = None) -> dict[str, float]:
        """Every rank frees its grad buffers and moves its optimizer state to the host (the weights stay)."""
        return self._state_move("offload", timeout)

    def onload_state(self, timeout: Optional[float] = None) -> dict[str, float]:
        """Every rank brings its optimizer state back and reallocates its grad buffers (zeroed)."""
        return self._state_move("onload", timeout)

    def _state_move(self, direction: str, timeout: Optional[float]) -> dict[str, float]:
        results = self.workers.call_all(f"{direction}_state",
                                        timeout=self.timeouts.update_s if timeout is None else timeout)
        out: dict[str, float] = {}
        for r in results:  # seconds: the slowest rank; bytes: the largest rank
            for key, value in r.items():
                out[key] = max(out.get(key, 0.0), float(value))
        return out

    def shutdown(self) -> None:
        """The workers' own ``shutdown`` (process groups), then kill the actors and free their bundles."""
        self.workers.shutdown(timeout=60.0)

    def __enter__(self) -> "ActorGroup":
        return self

    def __exit__(self, *exc: Any) -> None:
        if exc[0] is None:
            self.shutdown()
        else:
            self.workers.shutdown(graceful=False)
