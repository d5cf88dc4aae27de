"""What every weight sender shares: the stage sender's bucket loop and the endpoint it listens on.

A sender runs where the weights are: inside an actor rank (``megatron_arpo.actor.sync_sender`` hands it
its part of a pipeline stage's packed buckets: the stage's, or with expert parallelism its EP rank's) or
in one test or benchmark process (``senders.local``), never in the driver. Each sender has its own
transfer group with the engines, numbered by its ``sender`` index (the engines join one group per
sender). Per bucket it calls every engine's ``update_weights`` with the bucket's metadata (names, dtypes,
shapes, sender index and stage, the verify sample's checksums); its transport's subclass moves the
bytes.

A bucket is freed as soon as its bytes left (the transfer and the engines' loads of bucket k overlap the
packing of k+1; both are waited for before the next bucket goes out, so a sender holds about two
buckets). An engine that dies or fails while a bucket is in flight fails the send with one line naming
it (`wait_engines`).
"""

from __future__ import annotations

import abc
import socket
import time
from typing import Any, Optional, Sequence

from megatron_arpo.weight_sync.protocol import BucketLayout, EngineRef, sample_names, tensor_checksum, wait_engines

__all__ = ["StageSender", "node_ip", "reserve_endpoint"]


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

    def __init__(self, engines: Sequence[EngineRef], stage: int = 0, timeout_s: float = 900.0, *,
                 sender: Optional[int] = None):
        self.engines = list(engines)
        self.stage = stage
        self.sender = stage if sender is None else sender  # this sender's transfer group on the engines
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
        info = {**layout.update_fields(), "sender": self.sender, "stage": self.stage, "sync_id": self.sync_id,
                "bucket": index, "expected": expected}
        what = f"bucket {index} of sender {self.sender} (stage {self.stage}, sync {self.sync_id})"
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

    def flush(self) -> None:
        """Wait for the bucket in flight, the engines' loads included; raise its failure. A sender that
        shares the engines with others flushes before the next sender's bucket goes out (the engines take
        one sender at a time)."""
        self._collect()
        self._raise_settled()

    def _raise_settled(self) -> None:
        failure, self._failure = getattr(self, "_failure", None), None
        if failure is not None:
            raise failure

    def end(self) -> dict:
        """Wait for the last bucket's loads; this stage's report."""
        self.flush()
        return {**self.stats, "stage": self.stage, "sender": self.sender, "seconds": time.perf_counter() - self._start}

    def close(self) -> None:
        """Leave the transfer group."""
