"""The gloo weight sender (CPU): rank 0 of a stateless gloo group with every worker of every engine.

One broadcast of the packed bucket per bucket, not waited for until the next bucket (or the end) is
sent. Its endpoint (`reserve_endpoint`) keeps the listening socket until the group forms, so no other
process can take the port in between.
"""

from __future__ import annotations

import datetime
import logging
import socket
import threading
import time
from typing import Any, Optional, Sequence

from megatron_arpo.weight_sync.protocol import EngineRef, WeightSyncError, await_release, wait_engines
from megatron_arpo.weight_sync.senders.base import StageSender, reserve_endpoint

logger = logging.getLogger(__name__)

# After gloo reports a broken connection, how long the engines' calls get to show which engine failed.
BROKEN_TRANSFER_GRACE_S = 10.0


class GlooSender(StageSender):
    transport = "gloo"

    def __init__(self, engines: Sequence[EngineRef], stage: int = 0, timeout_s: float = 900.0,
                 endpoint: Optional[tuple[tuple[str, int], socket.socket]] = None,
                 sender: Optional[int] = None):
        # vLLM imported here, before any engine is asked to join: importing it in open() while an in-process
        # engine's thread imports it too (the receiver) could deadlock on vLLM's import cycles.
        from vllm.distributed.utils import stateless_init_torch_distributed_process_group  # noqa: F401

        super().__init__(engines, stage, timeout_s, sender=sender)
        self.endpoint, self._socket = endpoint if endpoint is not None else reserve_endpoint()
        self._pg = None

    def open(self, world_size: int) -> None:
        # deferred: pulls in vllm, vllm.distributed.utils (heavy; this module imports without it)
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
        users = flat._use_count()
        self._in_flight = [futures, what, self._pg.broadcast(flat, 0), flat, users]

    def _collect(self) -> None:
        if self._in_flight:
            futures, what, work, flat, users = self._in_flight
            self._wait_sent(futures, work, what)  # the bytes are out; the engines may still be loading them
            self._in_flight = []
            del work
            await_release(flat, users)  # gloo's worker thread lets go of the bucket just after the wait
            del flat
            wait_engines(futures, self.engines, what, self.timeout_s)

    def _wait_sent(self, futures, work, what) -> None:
        # A dead engine would leave the broadcast waiting forever: watch the engines' calls meanwhile.
        deadline = time.monotonic() + self.timeout_s
        while not work.is_completed():
            if _any_failed(futures):
                wait_engines(futures, self.engines, what, self.timeout_s)  # raises naming the engine
            if time.monotonic() > deadline:
                wait_engines(futures, self.engines, what, 0.0)  # raises: names the engines that did not answer
            time.sleep(0.001)
        try:
            work.wait()  # a transport error surfaces here
        except RuntimeError as exc:
            self._name_the_engine(futures, what, exc)

    def _name_the_engine(self, futures, what, exc: BaseException) -> None:
        """The connection broke (an engine died or failed mid-bucket): raise naming the engine once its call
        fails, which Ray may report a moment after gloo saw the peer go."""
        deadline = time.monotonic() + BROKEN_TRANSFER_GRACE_S
        while time.monotonic() < deadline and not _any_failed(futures):
            time.sleep(0.05)
        if _any_failed(futures):
            wait_engines(futures, self.engines, what, 0.0)  # raises naming the engine
        raise WeightSyncError(f"weight sync: the gloo transfer broke during {what} and no engine reported a failure "
                              f"within {BROKEN_TRANSFER_GRACE_S:.0f} s ({str(exc).splitlines()[0]})") from exc

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


def _any_failed(futures: Sequence[Any]) -> bool:
    """Whether an engine's call has failed already."""
    return any(f.done() and f.exception() is not None for f in futures)


def _destroy_gloo_group(pg: Any) -> None:
    # deferred: pulls in vllm, vllm.distributed.utils (heavy; this module imports without it)
    from vllm.distributed.utils import stateless_destroy_torch_distributed_process_group

    try:
        stateless_destroy_torch_distributed_process_group(pg)
    except Exception as exc:  # the engines may be gone already
        logger.debug("closing the gloo weight group: %s", exc)
