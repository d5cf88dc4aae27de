"""The methods every vLLM worker of a rollout engine gains (vLLM's ``worker_extension_cls``).

`EngineWorkerExtension` joins the weight sync's worker methods (`SyncWorkerExtension`) and routing capture
for routing replay (`megatron_arpo.rollout.routing_recorder`). `VllmEngine` calls them by name through
``collective_rpc``, with plain-data arguments: with vLLM's engine core in a subprocess every argument is
msgpack-encoded.
"""

from __future__ import annotations

from typing import Optional

from megatron_arpo.rollout.routing_recorder import RoutingRecorder
from megatron_arpo.weight_sync.receivers import SyncWorkerExtension


class EngineWorkerExtension(SyncWorkerExtension):
    """Weight-sync methods plus routing capture (``arpo_*_routing*`` / ``arpo_*_routed_experts``)."""

    _arpo_routing: Optional[RoutingRecorder] = None

    def arpo_enable_routing_capture(self) -> dict:
        """Bind the routing recorder to this worker's model runner (once); its layout."""
        if self._arpo_routing is None:
            self._arpo_routing = RoutingRecorder(self.model_runner)
        recorder = self._arpo_routing
        return {"layers": recorder.shape[0], "topk": recorder.shape[1], "block_size": recorder.block_size}

    def _routing_recorder(self) -> RoutingRecorder:
        if self._arpo_routing is None:
            raise RuntimeError("routing capture is off in this engine: call arpo_enable_routing_capture first")
        return self._arpo_routing

    def arpo_take_routed_experts(self, request_ids: list[str]) -> Optional[dict]:
        """Finished requests' routing, dropped from the recorder. The first worker returns it; the others hold
        the same rows (every TP rank routes every token) and only forget them."""
        if getattr(self, "rank", 0) != 0:
            self._routing_recorder().drop(list(request_ids))
            return None
        return self._routing_recorder().take(list(request_ids))

    def arpo_drop_routed_experts(self, request_ids: list[str]) -> None:
        """Forget aborted requests' routing."""
        self._routing_recorder().drop(list(request_ids))

    def arpo_routing_stats(self) -> Optional[dict]:
        recorder = self._arpo_routing
        return None if recorder is None else dict(recorder.stats, stored_blocks=len(recorder.blocks),
                                                  open_requests=len(recorder.requests))
