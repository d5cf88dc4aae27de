"""The NCCL weight sender (separate GPU pools): rank 0 of vLLM's trainer<->worker NCCL group.

The group is vLLM's (``nccl_common.trainer_init``); the packed bucket is broadcast in the chunks vLLM's
packed consumer expects (`packed_chunks`).
"""

from __future__ import annotations

import logging
import socket
from typing import Optional, Sequence

from megatron_arpo.weight_sync.protocol import NCCL_PACKED_BUFFER_BYTES, EngineRef, packed_chunks, wait_engines
from megatron_arpo.weight_sync.senders.base import StageSender, reserve_endpoint

logger = logging.getLogger(__name__)


class NcclSender(StageSender):
    transport = "nccl"

    def __init__(self, engines: Sequence[EngineRef], stage: int = 0, timeout_s: float = 900.0,
                 endpoint: Optional[tuple[tuple[str, int], socket.socket]] = None,
                 packed_buffer_bytes: int = NCCL_PACKED_BUFFER_BYTES, sender: Optional[int] = None):
        super().__init__(engines, stage, timeout_s, sender=sender)
        self.endpoint, self._socket = endpoint if endpoint is not None else reserve_endpoint()
        self.packed_buffer_bytes = packed_buffer_bytes
        self._comm = None

    def open(self, world_size: int) -> None:
        # deferred: pulls in vllm, vllm.distributed.weight_transfer.nccl_common (heavy; this module imports without it)
        from vllm.distributed.weight_transfer.nccl_common import trainer_init

        host, port = self.endpoint
        self._socket.close()  # vLLM's rendezvous binds the port itself (StatelessProcessGroup.create)
        self._socket = None
        self._comm = trainer_init({"master_address": host, "master_port": port, "world_size": world_size}, rank=0)

    def _transfer(self, flat, layout, info, what):
        # deferred: pulls in torch (heavy; this module imports without it)
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
