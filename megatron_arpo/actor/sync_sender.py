"""The actor ranks' part of the weight sync: each pipeline stage streams its own layers into the engines.

`ActorSync` lives on every rank of the actor group (``MegatronActorWorker.sync``); the driver
(`megatron_arpo.actor.group.ActorGroup.sync_weights`) calls the same method on every rank:

1. ``reserve(transport)`` (once): with ``gloo``/``nccl``, every sender reserves an endpoint on its node and
   returns it with its index; the driver hands the endpoints to the engines. A pipeline stage has one
   sender, data-parallel replica 0's tensor-parallel rank 0. With expert parallelism it has one per EP
   rank: TP rank 0 of each replica that holds a share of the experts (expert-data-parallel rank 0).
   Sender ``pp_rank x EP + ep_rank`` is rank 0 of the engines' group of that index.
2. ``open(engines, world_size)`` (once, while the engines join): the senders join their group as
   rank 0 (`megatron_arpo.weight_sync.senders`, one module per transport).
3. ``send(sync_id, ...)`` (every sync). ``gloo``/``nccl``: stage after stage (the engines take one sender
   at a time; two senders sending to the same engines at once could deadlock their broadcasts), the
   stage's TP ranks gather each bucket's shards on the sender (``megatron_arpo.actor.hf_live.stage_hf_buckets``:
   mapped through the conversion tables into one packed buffer), which sends it. With expert parallelism
   each EP rank's sender builds and sends its part of each bucket: its own experts, and on EP rank 0
   every other tensor; no expert crosses the EP group. The EP ranks' senders take turns
   bucket by bucket: one sends its part and waits for the engines' loads, then a vote over the stage's
   senders (the EP group of their TP rank 0) hands the turn on and tells every sender whether one failed.
   An engine's layerwise reload buffers a MoE layer until its last EP rank's experts arrived, so it holds
   about one bucket's parts at a time. With gloo (host memory) the sender
   packs into two buffers (`BufferPool`: bucket k travels from one while k+1 is packed into the other;
   a much larger bucket waits for the other one instead of growing the free one, so the two hold about
   the largest bucket and the second largest) that it keeps across syncs, as verl and slime keep their
   bucket buffers: on the host, packing into fresh memory costs a page fault per page, several times
   the copy itself. `close()` frees them. (On a GPU the caching allocator reuses freed buckets already.)
   Other data-parallel replicas have nothing to do. ``ipc``: every rank of every replica materialises
   every bucket in its GPU's IPC buffer (TP gather, then the owning stage broadcasts the packed bucket to
   the other stages, ``megatron_arpo.actor.hf_live.export_hf_buckets``), and global rank 0 ships the handles.
   The IPC buffer (the largest bucket) is allocated at the first sync and kept until `close()`: one per
   rank for the whole run, which ``megatron-arpo plan`` counts (a fresh one per sync left the previous one
   waiting for ``ipc_collect`` while the next was allocated).

With tied embeddings the LM head is sent as well, as ``lm_head.weight`` (a copy of the embedding in the
same bucket): vLLM 0.32 on CPU computes logits from a copy of the LM head prepared at load time, and a
reload of ``model.embed_tokens.weight`` alone leaves it stale (measured: log-probs off by up to 0.5).
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist

from megatron_arpo.actor.hf_live import export_hf_buckets, max_bucket_bytes, stage_hf_buckets
from megatron_arpo.actor.training import collective_device
from megatron_arpo.weight_sync.protocol import BufferPool
from megatron_arpo.weight_sync.senders import make_sender
from megatron_arpo.weight_sync.senders.base import reserve_endpoint

# megatron.core is imported inside the methods that use it: the driver imports this module (ActorGroup reads
# TIED_HEAD_ALIASES) and must not load Megatron.
logger = logging.getLogger(__name__)

# Bucket buffers per stage sender: bucket k travels from one while k+1 is packed into the other.
SEND_BUFFERS = 2

TIED_HEAD_ALIASES = {"model.embed_tokens.weight": ("lm_head.weight",)}


class ActorSync:
    """One rank's weight-sync state (see the module docstring)."""

    def __init__(self, worker: Any):
        self.worker = worker
        self.transport: Optional[str] = None
        self.sender = None
        self._endpoint = None
        self.pool = None  # the stage sender's bucket buffers, kept across syncs (see `_stream_stage`)
        self.ipc_buffer: Optional[torch.Tensor] = None  # this rank's CUDA-IPC buffer, kept across syncs

    @property
    def aliases(self) -> dict:
        return dict(TIED_HEAD_ALIASES) if self.worker.model_cfg.tie_word_embeddings else {}

    @property
    def is_stage_sender(self) -> bool:
        """Whether this rank sends its stage's buckets (with expert parallelism: its EP rank's part of them)."""
        w = self.worker
        if w.parallel.ep == 1:
            return w.dp_rank == 0 and w.tp_rank == 0
        return w.tp_rank == 0 and w.streams_hf_weights

    @property
    def sender_index(self) -> int:
        """This sender's index among the engines' transfer groups: ``pp_rank x EP + ep_rank``."""
        w = self.worker
        return w.pp_rank * w.parallel.ep + _ep_rank(w)

    def reserve(self, transport: str) -> Optional[tuple[int, tuple[str, int]]]:
        """``(sender index, (host, port))`` on the senders of gloo/nccl; None elsewhere."""
        self.close()
        self.transport = transport
        if transport == "ipc" or not self.is_stage_sender:
            return None
        self._endpoint = reserve_endpoint()
        return self.sender_index, self._endpoint[0]

    def open(self, engines: Sequence[Any], world_size: int, timeout_s: float) -> None:
        if self.transport is None:
            raise RuntimeError("ActorSync.reserve(transport) must run before open()")
        if self.transport == "ipc":
            self.sender = make_sender("ipc", engines, timeout_s=timeout_s, group=None)
        elif self.is_stage_sender:
            self.sender = make_sender(self.transport, engines, stage=self.worker.pp_rank, timeout_s=timeout_s,
                                      endpoint=self._endpoint, sender=self.sender_index)
            self._endpoint = None
            self.sender.open(world_size)

    def send(self, sync_id: int, bucket_bytes: int, verify_fraction: float = 0.0) -> dict:
        """Stream this rank's share of one sync; the stage sender's report (``{}`` elsewhere)."""
        if self.transport is None:
            raise RuntimeError("the weight sync was never opened on this rank (ActorGroup.sync_weights opens it)")
        if self.transport == "ipc":
            return self._send_ipc(sync_id, bucket_bytes, verify_fraction)
        return self._send_stages(sync_id, bucket_bytes, verify_fraction)

    def _send_stages(self, sync_id: int, bucket_bytes: int, verify_fraction: float) -> dict:
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core import parallel_state

        w = self.worker
        if not w.streams_hf_weights:
            return {}
        # The ranks of the stream: replica 0's TP x PP grid, and with expert parallelism the replicas that
        # hold the other experts (the EP x TP x PP grid of expert-data-parallel rank 0).
        ranks = parallel_state.get_model_parallel_group() if w.parallel.ep == 1 \
            else parallel_state.get_expert_tensor_model_pipeline_parallel_group()
        report: dict = {}
        failure: Optional[BaseException] = None
        for stage in range(w.pp):
            if stage == w.pp_rank:
                failure, report = self._stream_stage(sync_id, bucket_bytes, verify_fraction)
            # Every rank of the stream learns whether this stage failed (this also orders the stages: the
            # next one starts when this one is done). After a failure no later stage sends or gathers.
            if _any_rank(failure is not None, ranks):
                break
        if failure is not None:
            raise failure
        return report

    def _stream_stage(self, sync_id: int, bucket_bytes: int,
                      verify_fraction: float) -> tuple[Optional[BaseException], dict]:
        """This rank's part of its stage; ``(the sender's failure or None, the sender's report)``.

        A sender that fails (an engine died) keeps taking part in the stage's TP gathers without sending,
        so that its TP peers finish the stage instead of waiting in the next gather forever. With expert
        parallelism the stage's senders take turns per bucket (`_take_turns`); after a failure none sends
        again, and each finishes its gathers.
        """
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core import parallel_state

        w = self.worker
        failure: Optional[BaseException] = None
        pool = None
        if self.sender is not None:
            self.sender.begin(sync_id)
            # Host buckets only (gloo): on a GPU the caching allocator already reuses the memory, and a pool
            # would hold GPU memory through training.
            if self.transport == "gloo":
                self.pool = pool = self.pool or BufferPool(SEND_BUFFERS)
                pool.wait = self.sender.settle
                handed_out = dict(pool.stats)
        ep_group = parallel_state.get_expert_model_parallel_group() if w.parallel.ep > 1 else None
        turns = ep_group if ep_group is not None and self.is_stage_sender else None
        stopped = False  # a sender of this stage failed: no more sending, only the gathers
        for bucket in stage_hf_buckets(w.model, w.model_cfg, bucket_bytes,
                                       tp_group=parallel_state.get_tensor_model_parallel_group(),
                                       pp_rank=w.pp_rank, pp_size=w.pp, dst=0, aliases=self.aliases, pool=pool,
                                       ep_group=ep_group):
            if turns is not None:
                failure, stopped = self._take_turns(bucket, turns, failure, stopped, verify_fraction, sync_id)
            elif bucket is not None and failure is None:
                failure = self._send_bucket(bucket, verify_fraction, sync_id)
            if failure is not None and pool is not None:
                pool.wait = None  # nothing to wait for any more: the stage only finishes its gathers
            del bucket  # handed over: its buffer is free again once the sender let go of it
        report: dict = {}
        if self.sender is not None and failure is None:
            try:
                report = self.sender.end()
                if pool is not None:  # what the sender keeps between syncs, and this sync's hand-outs
                    report.update(send_buffer_bytes=pool.nbytes,
                                  **{f"send_buffers_{k}": v - handed_out[k] for k, v in pool.stats.items()})
            except Exception as exc:
                failure = exc
        return failure, report

    def _send_bucket(self, bucket: tuple, verify_fraction: float, sync_id: int,
                     flush: bool = False) -> Optional[BaseException]:
        """Hand one bucket to the sender (``flush``: and wait for the engines' loads); the failure or None."""
        try:
            self.sender.send(*bucket, verify_fraction=verify_fraction)
            if flush:
                self.sender.flush()
        except Exception as exc:
            logger.warning("weight sync %d: sender %d stops sending (%s); its ranks finish the stage's gathers",
                           sync_id, self.sender.sender, str(exc).splitlines()[0])
            return exc
        return None

    def _take_turns(self, bucket: Optional[tuple], turns: Any, failure: Optional[BaseException], stopped: bool,
                    verify_fraction: float, sync_id: int) -> tuple[Optional[BaseException], bool]:
        """The stage's senders (one per EP rank) send their parts of one bucket in EP-rank order.

        Each sends, waits for the engines' loads (the engines take one sender at a time), and the vote
        that follows hands the turn to the next; the vote also stops every sender after one failed.
        """
        mine = _ep_rank(self.worker)
        for turn in range(dist.get_world_size(group=turns)):
            if turn == mine and bucket is not None and not stopped:
                failure = self._send_bucket(bucket, verify_fraction, sync_id, flush=True)
            stopped = _any_rank(failure is not None, turns) or stopped
        return failure, stopped

    def _send_ipc(self, sync_id: int, bucket_bytes: int, verify_fraction: float) -> dict:
        w = self.worker
        size = max_bucket_bytes(w.model_cfg, w.pp, w.params_dtype, bucket_bytes, self.aliases)
        if self.ipc_buffer is None or self.ipc_buffer.numel() < size:
            self.ipc_buffer = None  # a larger bucket size: the old buffer goes before the new one comes
            self.ipc_buffer = torch.empty(size, dtype=torch.uint8,
                                          device=torch.device("cuda", torch.cuda.current_device()))
            logger.info("weight sync: IPC buffer of %.2f GiB on this rank, kept across syncs", size / 2**30)
        self.sender.share(self.ipc_buffer)
        self.sender.begin(sync_id)
        for flat, named in export_hf_buckets(w.model, w.model_cfg, bucket_bytes, aliases=self.aliases,
                                             buffer=self.ipc_buffer):
            self.sender.send(flat, named, verify_fraction)
        return self.sender.end()

    def close(self) -> None:
        if self.pool is not None:
            self.pool.clear()
            self.pool = None
        if self.ipc_buffer is not None:
            exported = self.ipc_buffer.is_cuda  # the gpu-smoke dry run stands a host buffer in for it
            self.ipc_buffer = None
            if exported:
                torch.cuda.ipc_collect()  # the engines released their mapping at the last update's end
        if self.sender is not None:
            self.sender.close()
            self.sender = None
        if self._endpoint is not None:
            self._endpoint[1].close()
            self._endpoint = None
        self.transport = None


def _ep_rank(worker: Any) -> int:
    """``worker``'s expert-parallel rank (0 without expert parallelism)."""
    if worker.parallel.ep == 1:
        return 0
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import parallel_state

    return parallel_state.get_expert_model_parallel_rank()


def _any_rank(flag: bool, group: Any) -> bool:
    """True on every rank of ``group`` when ``flag`` is true on any of them (one small all-reduce)."""
    if dist.get_world_size(group=group) == 1:
        return flag
    vote = torch.tensor([1 if flag else 0], dtype=torch.int32, device=collective_device())
    dist.all_reduce(vote, op=dist.ReduceOp.MAX, group=group)
    return bool(vote.item())
