"""The CUDA-IPC weight sender (colocated GPUs): every actor rank's buffer, shipped by rank 0's handles.

Every actor rank packs the bucket into its one persistent CUDA-IPC buffer (``megatron_arpo.actor.sync_sender``);
the handles of all ranks are all-gathered once per sync, and rank 0 ships them with each bucket (vLLM's
packed IPC protocol). Two barriers over the sender group bracket every bucket: no engine is told to read
bucket k before every rank finished packing it (an engine worker reads the buffer of its own GPU, which
another rank packs), and no rank packs bucket k+1 over k before the engines have cloned it.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

from megatron_arpo.weight_sync.protocol import EngineRef, wait_engines
from megatron_arpo.weight_sync.senders.base import StageSender


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
        # deferred: pulls in torch (heavy; this module imports without it)
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
        # deferred: pulls in torch (heavy; this module imports without it)
        import torch.distributed as dist

        return dist.get_rank(self.group) == 0

    def _transfer(self, flat, layout, info, what):
        # deferred: pulls in torch (heavy; this module imports without it)
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
