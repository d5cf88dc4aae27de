"""Sender half of the weight sync: moves packed buckets from the process that holds them into the engines.

Runs where the weights are: inside an actor rank (the Megatron side, ``megatron_arpo.actor.sync``, hands
it each pipeline stage's packed buckets), or in a test or benchmark process (`push_weights`). It never
goes through the driver: per bucket the sender calls every engine's ``update_weights`` with the bucket's
metadata (names, dtypes, shapes, stage, the verify sample's checksums) and moves the bytes itself:

- `GlooSender` (CPU): rank 0 of a stateless gloo group with every worker of every engine; one broadcast
  of the packed bucket. Its endpoint (`reserve_endpoint`) keeps the listening socket until the group
  forms, so no other process can take the port in between.
- `NcclSender` (separate GPUs): rank 0 of vLLM's trainer<->worker NCCL group (``nccl_common.trainer_init``);
  the packed bucket is broadcast in the chunks vLLM's packed consumer expects (`packed_chunks`).
- `IpcSender` (colocated GPUs): every actor rank packs the bucket into its one persistent CUDA-IPC buffer
  (`megatron_arpo.actor.sync_sender`); the handles of all ranks are all-gathered once per sync, and rank 0
  ships them with each bucket (vLLM's packed IPC protocol). Two barriers over the sender group bracket
  every bucket: no engine is told to read bucket k before every rank finished packing it (an engine
  worker reads the buffer of its own GPU, which another rank packs), and no rank packs bucket k+1 over
  k before the engines have cloned it.

A bucket is freed as soon as its bytes left (the transfer and the engines' loads of bucket k overlap the
packing of k+1; both are waited for before the next bucket goes out, so a sender holds about two
buckets). An engine that dies or fails while a bucket is in flight fails the send with one line naming
it (`wait_engines`).
"""

from __future__ import annotations

import abc
import logging
import socket
import threading
import time
from typing import Any, Optional, Sequence

from megatron_arpo.weight_sync.protocol import (NCCL_PACKED_BUFFER_BYTES, BucketLayout, EngineRef, call_engines,
                                               engine_refs, next_sync_id, packed_chunks, sample_names,
                                               tensor_checksum, transfer_ranks, wait_engines)

logger = logging.getLogger(__name__)

__all__ = ["GlooSender", "IpcSender", "NcclSender", "StageSender", "make_sender", "node_ip", "push_weights",
           "reserve_endpoint"]


def node_ip() -> str:
    """This node's IP as the engines reach it (Ray's view when in a Ray process)."""
    try:
        import ray

        if ray.is_initialized():
            return ray.util.get_node_ip_address()
    except ImportError:
        pass
    return "127.0.0.1"


def reserve_endpoint(host: Optional[str] = None) -> tuple[tuple[str, int], socket.socket]:
    """A listening socket on a free port of this node: ``((host, port), socket)``."""
    host = host or node_ip()
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, 0))
    sock.listen()
    return (host, sock.getsockname()[1]), sock


class StageSender(abc.ABC):
    """Sends one pipeline stage's buckets to every engine (see the module docstring)."""

    transport = ""

    def __init__(self, engines: Sequence[EngineRef], stage: int = 0, timeout_s: float = 900.0):
        self.engines = list(engines)
        self.stage = stage
        self.timeout_s = timeout_s
        self._in_flight: list = []
        self.stats = {"tensors": 0, "buckets": 0, "bytes": 0, "max_bucket_bytes": 0, "sampled": []}

    def open(self, world_size: int) -> None:
        """Join the transfer group as rank 0 (concurrently with the engines' ``init_weight_transfer_engine``)."""

    def begin(self, sync_id: int) -> None:
        self._failure: Optional[BaseException] = None
        self.sync_id = sync_id
        self.stats = {"tensors": 0, "buckets": 0, "bytes": 0, "max_bucket_bytes": 0, "sampled": []}
        self._start = time.perf_counter()

    def send(self, flat: Any, named: Sequence[tuple[str, Any]], verify_fraction: float = 0.0) -> None:
        """One packed bucket to every engine; returns once its bytes left (the load may still run)."""
        self._collect()  # the previous bucket's answers: an engine that failed stops the sync here
        self._raise_settled()
        layout = BucketLayout.of(named)
        index = self.stats["buckets"]
        expected = {}
        if verify_fraction > 0:
            names = sample_names(layout.names, self.sync_id, verify_fraction, always_first=index == 0)
            expected = {n: tensor_checksum(t) for n, t in named if n in names}
            self.stats["sampled"].extend(names)
        info = {**layout.update_fields(), "stage": self.stage, "sync_id": self.sync_id, "bucket": index,
                "expected": expected}
        what = f"bucket {index} of stage {self.stage} (sync {self.sync_id})"
        self._transfer(flat, layout, info, what)
        self.stats["buckets"] += 1
        self.stats["tensors"] += len(layout.names)
        self.stats["bytes"] += layout.nbytes
        self.stats["max_bucket_bytes"] = max(self.stats["max_bucket_bytes"], layout.nbytes)

    @abc.abstractmethod
    def _transfer(self, flat: Any, layout: BucketLayout, info: dict, what: str) -> None:
        """Start the engines' update calls (``self._in_flight``) and move the bytes."""

    def _collect(self) -> None:
        if self._in_flight:
            futures, what = self._in_flight
            self._in_flight = []
            wait_engines(futures, self.engines, what, self.timeout_s)

    def settle(self) -> None:
        """Wait for the bucket in flight (its buffer is free after); a failure is raised by the next
        `send` or `end` (a bucket packer calls this mid-bucket, where raising would stop its TP gathers)."""
        try:
            self._collect()
        except Exception as exc:
            self._failure = exc

    def _raise_settled(self) -> None:
        failure, self._failure = getattr(self, "_failure", None), None
        if failure is not None:
            raise failure

    def end(self) -> dict:
        """Wait for the last bucket's loads; this stage's report."""
        self._collect()
        self._raise_settled()
        return {**self.stats, "stage": self.stage, "seconds": time.perf_counter() - self._start}

    def close(self) -> None:
        """Leave the transfer group."""


class GlooSender(StageSender):
    transport = "gloo"

    def __init__(self, engines: Sequence[EngineRef], stage: int = 0, timeout_s: float = 900.0,
                 endpoint: Optional[tuple[tuple[str, int], socket.socket]] = None):
        # vLLM imported here, before any engine is asked to join: importing it in open() while an in-process
        # engine's thread imports it too (the receiver) could deadlock on vLLM's import cycles.
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group  # noqa: F401

        super().__init__(engines, stage, timeout_s)
        self.endpoint, self._socket = endpoint if endpoint is not None else reserve_endpoint()
        self._pg = None

    def open(self, world_size: int) -> None:
        import datetime

        from vllm.distributed.utils import stateless_init_torch_distributed_process_group

        host, port = self.endpoint
        sock, self._socket = self._socket, None
        self._pg = stateless_init_torch_distributed_process_group(
            host, port, 0, world_size, "gloo", listen_socket=sock, timeout=datetime.timedelta(seconds=self.timeout_s))

    def _transfer(self, flat, layout, info, what):
        if self._pg is None:
            raise RuntimeError("GlooSender.open() must join the transfer group before the first bucket")
        futures = [e.call("update_weights", info) for e in self.engines]
        # Not waited for here: the next bucket is gathered and packed while this one travels; the next
        # send (or end) waits for it first, so a sender holds this bucket and the one it is packing.
        self._in_flight = [futures, what, self._pg.broadcast(flat, 0), flat]

    def _collect(self) -> None:
        if self._in_flight:
            futures, what, work, _flat = self._in_flight
            self._wait_sent(futures, work, what)  # the bytes are out; the engines may still be loading them
            self._in_flight = []
            wait_engines(futures, self.engines, what, self.timeout_s)

    def _wait_sent(self, futures, work, what) -> None:
        # A dead engine would leave the broadcast waiting forever: watch the engines' calls meanwhile.
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            failed = [f for f in futures if f.done() and f.exception() is not None]
            if failed:
                wait_engines(futures, self.engines, what, self.timeout_s)  # raises naming the engine
            if time.monotonic() > deadline:
                wait_engines(futures, self.engines, what, 0.0)  # raises: names the engines that did not answer
            time.sleep(0.001)
        work.wait()  # a transport error surfaces here

    def close(self) -> None:
        if self._pg is not None:
            pg, self._pg = self._pg, None
            stuck = bool(self._in_flight) and not self._in_flight[2].is_completed()
            self._in_flight = []
            if stuck:
                # A broadcast to an engine that failed or died never completes, and destroying the group
                # waits for it until the group's timeout: let that happen off this thread, so that the
                # next sync (a new group) does not wait for it.
                threading.Thread(target=_destroy_gloo_group, args=(pg,), daemon=True,
                                 name="close-stuck-weight-group").start()
            else:
                _destroy_gloo_group(pg)
        if self._socket is not None:
            self._socket.close()
            self._socket = None


def _destroy_gloo_group(pg: Any) -> None:
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

    try:
        stateless_destroy_torch_distributed_process_group(pg)
    except Exception as exc:  # the engines may be gone already
        logger.debug("closing the gloo weight group: %s", exc)


class NcclSender(StageSender):
    transport = "nccl"

    def __init__(self, engines: Sequence[EngineRef], stage: int = 0, timeout_s: float = 900.0,
                 endpoint: Optional[tuple[tuple[str, int], socket.socket]] = None,
                 packed_buffer_bytes: int = NCCL_PACKED_BUFFER_BYTES):
        super().__init__(engines, stage, timeout_s)
        self.endpoint, self._socket = endpoint if endpoint is not None else reserve_endpoint()
        self.packed_buffer_bytes = packed_buffer_bytes
        self._comm = None

    def open(self, world_size: int) -> None:
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        host, port = self.endpoint
        self._socket.close()  # vLLM's rendezvous binds the port itself (StatelessProcessGroup.create)
        self._socket = None
        self._comm = trainer_init({"master_address": host, "master_port": port, "world_size": world_size}, rank=0)

    def _transfer(self, flat, layout, info, what):
        import torch

        if self._comm is None:
            raise RuntimeError("NcclSender.open() must join the transfer group before the first bucket")
        futures = [e.call("update_weights", info) for e in self.engines]
        stream = torch.cuda.current_stream()
        for start, stop in packed_chunks(layout.sizes, self.packed_buffer_bytes):
            self._comm.broadcast(flat[start:stop], src=0, stream=stream)
        # NCCL only enqueues: the bucket must stay alive until the engines received it.
        wait_engines(futures, self.engines, what, self.timeout_s)
        stream.synchronize()

    def close(self) -> None:
        if self._comm is not None:
            comm, self._comm = self._comm, None
            try:
                comm.destroy()
            except Exception as exc:
                logger.debug("closing the NCCL weight group: %s", exc)


class IpcSender(StageSender):
    """Runs on every actor rank; rank 0 of ``group`` ships. ``buffer`` is this rank's reusable IPC buffer."""

    transport = "ipc"

    def __init__(self, engines: Sequence[EngineRef], timeout_s: float = 900.0, group: Any = None):
        super().__init__(engines, 0, timeout_s)
        self.group = group
        self._handles: Optional[dict] = None

    def share(self, buffer: Any) -> None:
        """Export this rank's buffer and all-gather every rank's handle, once per sync: the engines release
        their mapping at the end of each update (vLLM pairs one export with one import and release)."""
        import torch
        import torch.distributed as dist
        from torch.multiprocessing.reductions import reduce_tensor

        # The previous sync's exports are released by now (the engines finished that update): collect them
        # here rather than at the end of a sync, where the engines still hold the mapping.
        torch.cuda.ipc_collect()
        uuid = str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
        mine = {uuid: reduce_tensor(buffer)[1]}
        gathered = [None] * dist.get_world_size(self.group)
        dist.all_gather_object(gathered, mine, group=self.group)
        self._handles = {k: v for handle in gathered for k, v in handle.items()}

    @property
    def is_shipper(self) -> bool:
        import torch.distributed as dist

        return dist.get_rank(self.group) == 0

    def _transfer(self, flat, layout, info, what):
        import torch
        import torch.distributed as dist

        if self._handles is None:
            raise RuntimeError("IpcSender.share(buffer) must run before the first bucket of a sync")
        torch.cuda.current_stream().synchronize()  # this rank's packed bytes are in its buffer
        # ... and every other rank's in theirs: the engines read all of them once rank 0 ships the bucket.
        dist.barrier(group=self.group)
        if self.is_shipper:
            info = {**info, "ipc_handles": self._handles, "tensor_sizes": layout.sizes}
            futures = [e.call("update_weights", info) for e in self.engines]
            wait_engines(futures, self.engines, what, self.timeout_s)
        # The engines cloned the bucket out of every rank's buffer: only now may the next bucket overwrite it.
        dist.barrier(group=self.group)

    def end(self) -> dict:
        report = super().end()
        self._handles = None
        return report if self.is_shipper else {}


def make_sender(transport: str, engines: Sequence[EngineRef], stage: int = 0, timeout_s: float = 900.0,
                endpoint: Any = None, group: Any = None) -> StageSender:
    if transport == "gloo":
        return GlooSender(engines, stage, timeout_s, endpoint)
    if transport == "nccl":
        return NcclSender(engines, stage, timeout_s, endpoint)
    if transport == "ipc":
        return IpcSender(engines, timeout_s, group)
    raise ValueError(f"unknown weight transport {transport!r}; allowed: gloo, nccl, ipc")


# ---------------------------------------------------------------------------- one-process sender
class LocalSync:
    """This process as the only sender (tests, benchmarks): the driver's and the sender's steps in one.

    ``with LocalSync(engines) as sync: sync.push(named_tensors)`` — the transfer group is formed once;
    each ``push`` is one full sync (start, buckets, finish, prefix-cache reset). Gloo only: a single
    process that holds all tensors on the host.
    """

    def __init__(self, engines: Any, *, timeout_s: float = 600.0, loop: Any = None):
        from megatron_arpo.weight_sync.protocol import receiver_init_info

        self.engines = engine_refs(engines, loop)
        self.timeout_s = timeout_s
        worlds = [info["world_size"] for info in call_engines(self.engines, "weight_transfer_info", timeout=timeout_s)]
        offsets, world = transfer_ranks(worlds)
        self.sender = GlooSender(self.engines, 0, timeout_s)
        futures = [e.call("init_weight_transfer_engine",
                          receiver_init_info("gloo", [self.sender.endpoint], offset, world, timeout_s))
                   for e, offset in zip(self.engines, offsets)]
        self.sender.open(world)
        wait_engines(futures, self.engines, "init_weight_transfer_engine", timeout_s)

    def push(self, named_tensors: Sequence[tuple[str, Any]], *, bucket_bytes: int = 512 * 2**20,
             verify_fraction: float = 0.0) -> dict:
        from megatron_arpo.weight_sync.protocol import bucket_named_tensors

        sync_id = next_sync_id()
        call_engines(self.engines, "start_weight_update", timeout=self.timeout_s)
        self.sender.begin(sync_id)
        for bucket in bucket_named_tensors(named_tensors, bucket_bytes):
            layout = BucketLayout.of(bucket)
            flat = layout.pack([(n, t.detach().cpu()) for n, t in bucket])
            self.sender.send(flat, layout.views(flat), verify_fraction)
            del flat
        report = self.sender.end()
        engine_reports = call_engines(self.engines, "finish_weight_update", timeout=self.timeout_s)
        call_engines(self.engines, "reset_prefix_cache", timeout=self.timeout_s)
        report.update(sync_id=sync_id, engines=engine_reports,
                      verified_after_load=sorted(set.intersection(*(set(r["verified"]) for r in engine_reports))))
        return report

    def close(self) -> None:
        self.sender.close()

    def __enter__(self) -> "LocalSync":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def push_weights(engines: Any, named_tensors: Sequence[tuple[str, Any]], *, bucket_bytes: int = 512 * 2**20,
                 verify_fraction: float = 0.0, timeout_s: float = 600.0, loop: Any = None) -> dict:
    """One sync of ``named_tensors`` from this process (`LocalSync`, formed and closed for this call)."""
    with LocalSync(engines, timeout_s=timeout_s, loop=loop) as sync:
        return sync.push(named_tensors, bucket_bytes=bucket_bytes, verify_fraction=verify_fraction)
