"""The IPC scenario of ``tools/gpu_smoke.py``: the actor's IPC weight sync into a second process.

The actor rank sends through its own code (``worker.send_weights`` -> ``ActorSync._send_ipc`` -> ``IpcSender``:
one reusable packed buffer, its CUDA-IPC handle all-gathered, shipped with each bucket). The second process
stands where a vLLM worker runs ``IPCWeightTransferEngine`` in packed mode (vLLM cannot travel to the GPU
machine): it rebuilds the buffer from the handle of its own device (``rebuild_cuda_tensor`` with its device
index), keeps that mapping for the whole sync and drops it at ``finish_weight_update`` (vLLM's one-slot
importer), unpacks the names/shapes/dtypes/sizes, clones every tensor and checks the sender's checksums.

Dry run (no CUDA): the buffer is moved to host shared memory and the handle names that memory; every other
step (the sender, the engine protocol, the consumer's unpack and checks) is the same. The memory checks
need a CUDA allocator and are reported as not measurable there.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import threading
from types import SimpleNamespace
from typing import Any

import torch
import torch.multiprocessing as mp

from megatron_arpo.weight_sync.protocol import EngineRef, call_engines, tensor_checksum
from megatron_arpo.weight_sync.senders.ipc import IpcSender

HOST_KEY = "host"  # the handle key of the dry run's host shared memory (a GPU's is its UUID)
DEVICE_USED_TOLERANCE = 2 * 2**20  # device memory after the last sync vs after the first (driver-level)


def _device_key() -> str:
    if torch.cuda.is_available():
        return str(torch.cuda.get_device_properties(torch.cuda.current_device()).uuid)
    return HOST_KEY


class _Consumer:
    """What a vLLM worker's packed IPC engine does with each update, minus loading into a model."""

    def __init__(self):
        self.device_index = torch.cuda.current_device() if torch.cuda.is_available() else None
        self.mapping: tuple[tuple, torch.Tensor] | None = None
        self.weights: dict[str, torch.Tensor] = {}
        self.verified = 0

    def _rebuild(self, handles: dict) -> torch.Tensor:
        args = handles.get(_device_key())
        if args is None:
            raise ValueError(f"no IPC handle for this device ({_device_key()}); handles for {list(handles)}")
        key = tuple(args)
        if self.mapping is not None and self.mapping[0] == key:
            return self.mapping[1]  # one mapping per export, reused by every bucket of the sync
        if args[0] == HOST_KEY:
            _, manager, handle, size = args
            storage = torch.UntypedStorage._new_shared_filename_cpu(manager, handle, size)
            packed = torch.empty(0, dtype=torch.uint8).set_(storage, 0, (size,))
        else:
            from torch.multiprocessing.reductions import rebuild_cuda_tensor

            rebuilt = list(args)
            rebuilt[6] = self.device_index  # the receiver's own index for the same physical device
            packed = rebuild_cuda_tensor(*rebuilt)
        self.mapping = (key, packed)
        return packed

    def start_weight_update(self) -> dict:
        return {}

    def update_weights(self, info: dict) -> dict:
        packed = self._rebuild(info["ipc_handles"])
        sizes = info["tensor_sizes"]
        flat = packed[:sum(sizes)]
        pos = 0
        for name, shape, dtype, size in zip(info["names"], info["shapes"], info["dtype_names"], sizes):
            tensor = flat[pos:pos + size].view(getattr(torch, dtype)).view(shape).clone()
            pos += size
            want = info["expected"].get(name)
            if want is not None:
                got = tensor_checksum(tensor)
                if got["sha256"] != want["sha256"]:
                    raise ValueError(f"{name}: bytes differ after the IPC transfer (sum {got['sum']} vs {want['sum']})")
                self.verified += 1
            if name in self.weights:  # loaded into the weights already there, as vLLM's load_weights does
                self.weights[name].copy_(tensor)
            else:
                self.weights[name] = tensor
            del tensor
        return {"tensors": len(info["names"])}

    def finish_weight_update(self) -> dict:
        self.mapping = None  # releases the producer's buffer (one refcount decrement per export)
        verified, self.verified = self.verified, 0
        return {"loaded": len(self.weights), "verified": verified}

    def memory(self) -> dict | None:
        if not torch.cuda.is_available():
            return None
        torch.cuda.synchronize()
        return {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved()}

    def checksums(self) -> dict:
        return {name: tensor_checksum(t)["sha256"] for name, t in self.weights.items()}


def _consumer_main(conn) -> None:
    consumer = _Consumer()
    while True:
        method, args = conn.recv()
        if method == "stop":
            conn.send(("ok", None))
            return
        try:
            conn.send(("ok", getattr(consumer, method)(*args)))
        except Exception as exc:  # reported to the sender, which names this engine
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class ConsumerProcess:
    """The second process, called as the senders call an engine (``EngineRef`` over ``.remote().future()``)."""

    def __init__(self):
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_consumer_main, args=(child,), name="gpu-smoke-ipc-consumer", daemon=True)
        self.proc.start()
        self._lock = threading.Lock()

    def _call(self, method: str, *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()

        def run():
            with self._lock:
                self.conn.send((method, args))
                if not self.conn.poll(600):
                    future.set_exception(TimeoutError(f"the consumer did not answer {method}"))
                    return
                status, value = self.conn.recv()
            if status == "ok":
                future.set_result(value)
            else:
                future.set_exception(RuntimeError(value))

        threading.Thread(target=run, daemon=True).start()
        return future

    def __getattr__(self, method: str):
        if method.startswith("_") or method in ("conn", "proc"):
            raise AttributeError(method)
        return SimpleNamespace(remote=lambda *args: SimpleNamespace(future=lambda: self._call(method, *args)))

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self._call("stop").result(timeout=30)
        self.proc.join(timeout=30)
        if self.proc.is_alive():
            self.proc.kill()


class HostIpcSender(IpcSender):
    """The dry run's stand-in for CUDA IPC: the buffer moves to host shared memory, the handle names it."""

    def share(self, buffer: Any) -> None:
        mp.set_sharing_strategy("file_system")
        buffer.share_memory_()
        manager, handle, size = buffer.untyped_storage()._share_filename_cpu_()
        self._handles = {HOST_KEY: (HOST_KEY, manager, handle, size)}
        self._host_buffer = buffer  # shared memory stays mapped while the consumer reads it


@contextlib.contextmanager
def _host_cuda_calls():
    """The two CUDA calls of the IPC sender that a CPU build of torch cannot answer (dry run only)."""
    saved = torch.cuda.current_stream, torch.cuda.ipc_collect
    torch.cuda.current_stream = lambda *a, **k: SimpleNamespace(synchronize=lambda: None)
    torch.cuda.ipc_collect = lambda: None
    try:
        yield
    finally:
        torch.cuda.current_stream, torch.cuda.ipc_collect = saved


def _device_used() -> int:
    free, total = torch.cuda.mem_get_info()
    return total - free


def run_ipc_syncs(worker, ctx, result, *, num_syncs: int, bucket_bytes: int) -> None:
    """``num_syncs`` syncs of the actor's weights (their sign flipped between syncs, so each carries new bytes)."""
    consumer = ConsumerProcess()
    engines = [EngineRef(0, consumer)]
    on_gpu = ctx.real_gpu
    memory: list[dict] = []
    try:
        worker.reserve_weight_sync("ipc")
        worker.open_weight_sync(engines, 1, 600.0)
        if not on_gpu:
            worker._sync.sender = HostIpcSender(engines, timeout_s=600.0, group=None)
        calls = contextlib.nullcontext() if on_gpu else _host_cuda_calls()
        with calls:
            for sync_id in range(num_syncs):
                call_engines(engines, "start_weight_update", timeout=600)
                report = worker.send_weights(sync_id, bucket_bytes, verify_fraction=1.0)
                (done,) = call_engines(engines, "finish_weight_update", timeout=600)
                (theirs,) = call_engines(engines, "memory", timeout=600)
                mine = None
                if on_gpu:
                    torch.cuda.synchronize()
                    mine = {"allocated": torch.cuda.memory_allocated(), "reserved": torch.cuda.memory_reserved(),
                            "device_used": _device_used()}
                memory.append({"sender": mine, "consumer": theirs})
                if sync_id == 0:
                    result.number("buckets", report["buckets"])
                    result.number("bytes_per_sync", report["bytes"])
                    result.number("first_sync_s", report["seconds"])
                result.check(f"sync {sync_id + 1}: every tensor arrived and its bytes match",
                             done["verified"] == report["tensors"] == done["loaded"],
                             f"{done['verified']} verified, {done['loaded']} loaded, {report['tensors']} sent")
                if sync_id < num_syncs - 1:
                    with torch.no_grad():
                        for param in worker.model.parameters():
                            param.neg_()
        (received,) = call_engines(engines, "checksums", timeout=600)
        exported = {n: tensor_checksum(t)["sha256"] for bucket in worker.iter_weight_buckets() for n, t in bucket}
        aliases = set(received) - set(exported)
        differing = [n for n in exported if received.get(n) != exported[n]]
        result.check("the consumer holds the actor's current weights (HF export checksums)", not differing,
                     ", ".join(differing[:5]) + (f" (aliases {sorted(aliases)})" if aliases else ""))
        worker.close_weight_sync()
    finally:
        consumer.stop()
    result.number("memory_per_sync", memory)
    if not on_gpu:
        result.check(f"memory after {num_syncs} syncs == after 1", None,
                     f"no CUDA allocator on {ctx.device} (host shared memory stood in for CUDA IPC)")
        return
    # Allocated bytes: after the last sync as after the first (a leak grows them). Reserved and device memory
    # grow once at the second sync by design (the next buffer is allocated while the first one's IPC export is
    # still held; the consumer's transient copies), so they are compared from the second sync on.
    first, second, last = memory[0], memory[1], memory[-1]
    for side in ("sender", "consumer"):
        result.check(f"{side} allocated after {num_syncs} syncs == after 1",
                     first[side]["allocated"] == last[side]["allocated"],
                     f"{first[side]['allocated']} -> {last[side]['allocated']}")
        result.check(f"{side} reserved after {num_syncs} syncs == after 2",
                     second[side]["reserved"] == last[side]["reserved"],
                     f"{first[side]['reserved']} -> {second[side]['reserved']} -> {last[side]['reserved']}")
    grew = last["sender"]["device_used"] - second["sender"]["device_used"]
    result.check(f"device memory after {num_syncs} syncs == after 2 (within 2 MiB)", grew <= DEVICE_USED_TOLERANCE,
                 f"grew by {grew} bytes (after sync 1: {first['sender']['device_used']})")

