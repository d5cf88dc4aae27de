"""The actor side of the weight sync: one sender per transport, built by `make_sender`.

- ``base``: `StageSender` (the bucket loop every transport shares), the endpoint a sender listens on;
- ``gloo`` (CPU), ``nccl`` (separate GPU pools), ``ipc`` (colocated GPUs): one transport each;
- ``local``: `LocalSync`/`push_weights`, this process as the only sender (tests, benchmarks).

The transport is chosen once, when the run starts (``megatron_arpo.weight_sync.protocol.choose_transport``
from ``megatron_arpo.trainer.runtime``); the actor ranks get it with ``reserve_weight_sync``. The modules
import vLLM and CUDA only inside the methods that need them.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from megatron_arpo.weight_sync.protocol import EngineRef
from megatron_arpo.weight_sync.senders.base import StageSender
from megatron_arpo.weight_sync.senders.gloo import GlooSender
from megatron_arpo.weight_sync.senders.ipc import IpcSender
from megatron_arpo.weight_sync.senders.nccl import NcclSender

__all__ = ["make_sender"]


def make_sender(transport: str, engines: Sequence[EngineRef], stage: int = 0, timeout_s: float = 900.0,
                endpoint: Any = None, group: Any = None, sender: Optional[int] = None) -> StageSender:
    """``sender``: this sender's index among the transfer groups the engines joined (default: ``stage``)."""
    if transport == "gloo":
        return GlooSender(engines, stage, timeout_s, endpoint, sender=sender)
    if transport == "nccl":
        return NcclSender(engines, stage, timeout_s, endpoint, sender=sender)
    if transport == "ipc":
        return IpcSender(engines, timeout_s, group)
    raise ValueError(f"unknown weight transport {transport!r}; allowed: gloo, nccl, ipc")
