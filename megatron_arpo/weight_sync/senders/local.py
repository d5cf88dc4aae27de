"""This process as the only weight sender (tests, benchmarks): `LocalSync` and `push_weights`, over gloo."""

from __future__ import annotations

from typing import Any, Optional, Sequence

from megatron_arpo.weight_sync.protocol import (BucketLayout, bucket_named_tensors, call_engines, engine_refs,
                                               in_flight_kwargs, next_sync_id, receiver_init_info, transfer_ranks,
                                               wait_engines)
from megatron_arpo.weight_sync.senders.gloo import GlooSender


class LocalSync:
    """This process as the only sender (tests, benchmarks): the driver's and the sender's steps in one.

    ``with LocalSync(engines) as sync: sync.push(named_tensors)`` — the transfer group is formed once;
    each ``push`` is one full sync (start, buckets, finish, prefix-cache reset); ``start``, ``send`` and
    ``finish`` are its three parts, for a caller that acts while the engines are paused. Gloo only: a single
    process that holds all tensors on the host.
    """

    def __init__(self, engines: Any, *, timeout_s: float = 600.0, loop: Any = None, keep_in_flight: bool = False):
        self.engines = engine_refs(engines, loop)
        self.timeout_s = timeout_s
        worlds = [info["world_size"] for info in call_engines(self.engines, "weight_transfer_info", timeout=timeout_s)]
        offsets, world = transfer_ranks(worlds)
        self.sender = GlooSender(self.engines, 0, timeout_s)
        init_kwargs = {"keep_in_flight": True} if keep_in_flight else {}  # may join while requests run
        futures = [e.call("init_weight_transfer_engine",
                          receiver_init_info("gloo", [self.sender.endpoint], offset, world, timeout_s), **init_kwargs)
                   for e, offset in zip(self.engines, offsets)]
        self.sender.open(world)
        wait_engines(futures, self.engines, "init_weight_transfer_engine", timeout_s)

    def push(self, named_tensors: Sequence[tuple[str, Any]], *, bucket_bytes: int = 512 * 2**20,
             verify_fraction: float = 0.0, keep_in_flight: bool = False, version: Optional[int] = None) -> dict:
        """One sync: `start`, `send`, `finish`. ``keep_in_flight``: the engines pause with their requests
        kept and resume on the new weights (no prefix-cache reset: the paused requests hold their blocks);
        ``version``: the engines' policy version after it (None: one more)."""
        in_flight_kwargs(keep_in_flight, version)  # a bad version is refused before the engines pause
        self.start(keep_in_flight=keep_in_flight)
        self.send(named_tensors, bucket_bytes=bucket_bytes, verify_fraction=verify_fraction)
        return self.finish(version=version)

    def start(self, *, keep_in_flight: bool = False, clear_cache: bool = False) -> None:
        """``clear_cache`` (with ``keep_in_flight``): the paused requests drop their KV blocks and are
        recomputed on the new weights when the engines resume."""
        self._sync_id = next_sync_id()
        self._keep = keep_in_flight
        call_engines(self.engines, "start_weight_update", timeout=self.timeout_s,
                     kwargs=in_flight_kwargs(keep_in_flight, None, clear_cache)[0])
        self.sender.begin(self._sync_id)

    def send(self, named_tensors: Sequence[tuple[str, Any]], *, bucket_bytes: int = 512 * 2**20,
             verify_fraction: float = 0.0) -> None:
        for bucket in bucket_named_tensors(named_tensors, bucket_bytes):
            layout = BucketLayout.of(bucket)
            flat = layout.pack([(n, t.detach().cpu()) for n, t in bucket])
            self.sender.send(flat, layout.views(flat), verify_fraction)
            del flat

    def finish(self, *, version: Optional[int] = None) -> dict:
        report = self.sender.end()
        engine_reports = call_engines(self.engines, "finish_weight_update", timeout=self.timeout_s,
                                      kwargs=in_flight_kwargs(self._keep, version)[1])
        if not self._keep:
            call_engines(self.engines, "reset_prefix_cache", timeout=self.timeout_s)
        report.update(sync_id=self._sync_id, engines=engine_reports,
                      verified_after_load=sorted(set.intersection(*(set(r["verified"]) for r in engine_reports))))
        return report

    def close(self) -> None:
        self.sender.close()

    def __enter__(self) -> "LocalSync":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


def push_weights(engines: Any, named_tensors: Sequence[tuple[str, Any]], *, bucket_bytes: int = 512 * 2**20,
                 verify_fraction: float = 0.0, timeout_s: float = 600.0, loop: Any = None,
                 keep_in_flight: bool = False, version: Optional[int] = None) -> dict:
    """One sync of ``named_tensors`` from this process (`LocalSync`, formed and closed for this call)."""
    with LocalSync(engines, timeout_s=timeout_s, loop=loop, keep_in_flight=keep_in_flight) as sync:
        return sync.push(named_tensors, bucket_bytes=bucket_bytes, verify_fraction=verify_fraction,
                         keep_in_flight=keep_in_flight, version=version)
