"""This process as the only weight sender (tests, benchmarks): `LocalSync` and `push_weights`, over gloo."""

from __future__ import annotations

from typing import Any, Sequence

from megatron_arpo.weight_sync.protocol import (BucketLayout, bucket_named_tensors, call_engines, engine_refs,
                                               next_sync_id, receiver_init_info, transfer_ranks, wait_engines)
from megatron_arpo.weight_sync.senders.gloo import GlooSender


class LocalSync:
    """This process as the only sender (tests, benchmarks): the driver's and the sender's steps in one.

    ``with LocalSync(engines) as sync: sync.push(named_tensors)`` — the transfer group is formed once;
    each ``push`` is one full sync (start, buckets, finish, prefix-cache reset). Gloo only: a single
    process that holds all tensors on the host.
    """

    def __init__(self, engines: Any, *, timeout_s: float = 600.0, loop: Any = None):
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
