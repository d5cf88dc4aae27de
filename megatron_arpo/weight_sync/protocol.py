"""Weight sync protocol: what both halves agree on, and the driver's coordination of one sync.

The actor sends, the engine receives, the driver coordinates. No weight byte passes through the driver:

- **sender half** (``megatron_arpo.weight_sync.senders``, run inside the actor ranks): each pipeline
  stage's sender gathers its TP shards one bucket at a time, maps them through the conversion tables
  into one packed buffer, sends it and frees it;
- **receiver half** (``megatron_arpo.weight_sync.receivers``, run inside the vLLM workers): vLLM
  weight-transfer engines that receive a bucket and load it in place;
- **driver** (this module, `ActorGroup.sync_weights`): opens the transfer once (`open_session`), then per
  sync ``start_weight_update`` on every engine, the actor ranks stream their buckets (each sender calls
  the engines' ``update_weights`` itself, with the bucket's metadata), ``finish_weight_update`` (the
  engines check the load) and ``reset_prefix_cache``. The driver handles metadata only: endpoints,
  rank offsets and reports.

One protocol — vLLM 0.32's four weight-transfer phases (``init_weight_transfer_engine``,
``start_weight_update``, ``update_weights``, ``finish_weight_update``) — and three transports, each a
vLLM ``WeightTransferEngine`` registered under its own backend name (`BACKENDS`):

- ``nccl`` (separate GPU pools): vLLM's NCCL engine, one broadcast group per pipeline stage;
- ``ipc`` (colocated GPUs): vLLM's IPC engine, a packed CUDA-IPC buffer per actor GPU;
- ``gloo`` (CPU, every test): ours, the NCCL engine's structure over stateless gloo groups.

A bucket travels packed: one flat ``uint8`` buffer holding its tensors back to back (`BucketLayout`),
the layout vLLM's packed consumers unpack. Buckets never split a decoder layer (`layer_key`): on the
vLLM CPU backend a fused module (q/k/v -> ``qkv_proj``, gate/up -> ``gate_up_proj``) reloads correctly
only when all of its parts arrive in one reload call, and vLLM's layerwise reload holds a partly loaded
layer's tensors until the rest arrives, so whole layers also bound the engine's buffering.

``verify_sync``: a deterministic sample of names per sync (`sample_names`) is checksummed by the sender
(`tensor_checksum`: float64 sum and SHA-256 of the bytes); the sums ride the bucket's update info. Each
engine worker checks the tensors it received (transport intact) and, after ``finish_weight_update``, its
own parameters that map 1:1 to an HF tensor (load intact). A mismatch raises `WeightSyncError`, which
stops training. An engine that dies mid-sync, or fails, fails the sync with one line naming it
(`wait_engines`); an engine whose update did not finish refuses to generate (half a model is never used
silently).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import itertools
import logging
import math
import pickle
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

logger = logging.getLogger(__name__)

__all__ = [
    "BACKENDS", "choose_transport", "TRANSPORTS", "BucketLayout", "EngineRef", "SyncSession", "WeightSyncError", "bucket_named_tensors",
    "engine_refs", "layer_key", "packed_chunks", "receiver_init_info", "sample_names", "tensor_checksum",
    "transfer_ranks", "wait_engines",
]

TRANSPORTS = ("gloo", "nccl", "ipc")
# vLLM weight-transfer backend names (megatron_arpo.weight_sync.vllm_plugin registers them in every vLLM process).
BACKENDS = {"gloo": "arpo_gloo", "nccl": "arpo_nccl", "ipc": "arpo_ipc"}
# vLLM's packed NCCL consumer cuts a transfer into chunks of about this many bytes (its default); the sender
# cuts the same chunks out of its packed bucket (`packed_chunks`).
NCCL_PACKED_BUFFER_BYTES = 1024 * 1024 * 1024
_SYNC_IDS = itertools.count()


class WeightSyncError(RuntimeError):
    """The engines' weights do not match what the actor sent, or an engine failed mid-sync; training must stop."""


def next_sync_id() -> int:
    return next(_SYNC_IDS)


def tensor_checksum(tensor: Any) -> dict[str, Any]:
    """float64 sum and SHA-256 of the raw bytes of a tensor (moved to the host, made contiguous)."""
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch

    t = tensor.detach().to("cpu").contiguous()
    raw = t.view(torch.uint8) if t.dtype != torch.bool else t.to(torch.uint8)
    return {
        "sum": float(t.to(torch.float64).sum().item()),
        "sha256": hashlib.sha256(raw.numpy().tobytes()).hexdigest(),
        "shape": list(t.shape),
        "dtype": str(t.dtype).replace("torch.", ""),
    }


def compare_checksums(where: str, name: str, got: Mapping[str, Any], want: Mapping[str, Any]) -> None:
    if got["sha256"] != want["sha256"] or list(got["shape"]) != list(want["shape"]):
        raise WeightSyncError(
            f"verify_sync: {name} differs {where}: sum {got['sum']!r} vs {want['sum']!r}, shape {got['shape']} vs "
            f"{want['shape']}, dtype {got['dtype']} vs {want['dtype']}; the engine would generate with wrong "
            "weights, so training stops. Check the export mapping and the transport.")


# ------------------------------------------------------------------------------------------ buckets
_LAYER_RE = re.compile(r"^(.*?\.layers\.\d+)\.")


def layer_key(name: str) -> str:
    """``model.layers.3`` for every tensor of decoder layer 3; the name itself otherwise."""
    match = _LAYER_RE.match(name)
    return match.group(1) if match else name


def pack_in_order(items: Sequence[tuple[object, int]], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``(unit key, nbytes)`` items grouped in order into buckets of about ``bucket_bytes``:
    consecutive items with the same key always share a bucket, and a unit larger than a bucket goes alone."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes={bucket_bytes} must be >= 1 (rollout.sync_bucket_mb)")
    units: list[tuple[object, list[int], int]] = []
    for index, (key, nbytes) in enumerate(items):
        if units and units[-1][0] == key:
            units[-1] = (key, units[-1][1] + [index], units[-1][2] + nbytes)
        else:
            units.append((key, [index], nbytes))
    buckets: list[list[int]] = []
    size = 0
    for _, indices, nbytes in units:
        if buckets and size + nbytes <= bucket_bytes:
            buckets[-1].extend(indices)
            size += nbytes
        else:
            buckets.append(list(indices))
            size = nbytes
    return buckets


def plan_buckets(items: Sequence[tuple[str, int]], bucket_bytes: int) -> list[list[int]]:
    """Indices of ``(name, nbytes)`` items grouped in order into buckets of about ``bucket_bytes``.

    A bucket closes only between decoder layers (see the module docstring): the items of one layer
    (consecutive, by `layer_key`) always go together, and a layer larger than a bucket goes alone.
    """
    return pack_in_order([(layer_key(name), nbytes) for name, nbytes in items], bucket_bytes)


def bucket_named_tensors(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int) -> Iterator[list[tuple[str, Any]]]:
    """`plan_buckets` over materialised tensors (senders that already hold them: tests, benchmarks)."""
    named = list(named_tensors)
    for indices in plan_buckets([(n, t.numel() * t.element_size()) for n, t in named], bucket_bytes):
        yield [named[i] for i in indices]


@dataclass(frozen=True)
class BucketLayout:
    """Names, shapes, dtypes and byte sizes of the tensors packed back to back in one flat ``uint8`` buffer."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]
    dtype_names: tuple[str, ...]

    @property
    def sizes(self) -> list[int]:
        # deferred: pulls in torch (heavy; this module imports without it)
        import torch

        return [math.prod(shape) * getattr(torch, dt).itemsize for shape, dt in zip(self.shapes, self.dtype_names)]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    @classmethod
    def of(cls, named: Sequence[tuple[str, Any]]) -> "BucketLayout":
        return cls(tuple(n for n, _ in named), tuple(tuple(t.shape) for _, t in named),
                   tuple(str(t.dtype).replace("torch.", "") for _, t in named))

    def views(self, flat: Any) -> list[tuple[str, Any]]:
        """The named tensors as views of ``flat`` (no copy)."""
        # deferred: pulls in torch (heavy; this module imports without it)
        import torch

        if flat.numel() != self.nbytes:
            raise WeightSyncError(f"a packed bucket of {flat.numel()} bytes does not match its layout of {self.nbytes} "
                                  f"bytes ({len(self.names)} tensors, first {self.names[:1]})")
        out, pos = [], 0
        for name, shape, dt, size in zip(self.names, self.shapes, self.dtype_names, self.sizes):
            out.append((name, flat[pos:pos + size].view(getattr(torch, dt)).view(shape)))
            pos += size
        return out

    def pack(self, named: Sequence[tuple[str, Any]], device: Any = None) -> Any:
        """Copy ``named`` (in layout order) into a new flat buffer."""
        # deferred: pulls in torch (heavy; this module imports without it)
        import torch

        flat = torch.empty(self.nbytes, dtype=torch.uint8, device=device)
        for (name, view), (_, tensor) in zip(self.views(flat), named):
            view.copy_(tensor)
        return flat

    def update_fields(self) -> dict[str, Any]:
        """The metadata fields vLLM's update infos carry (``names``, ``dtype_names``, ``shapes``)."""
        return {"names": list(self.names), "dtype_names": list(self.dtype_names),
                "shapes": [list(s) for s in self.shapes]}


def storage_users(tensor: Any) -> Optional[int]:
    """How many tensors (views included) refer to ``tensor``'s storage; None where torch cannot tell."""
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch

    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None:
        return None
    return use_count(tensor.untyped_storage()._cdata)


def await_release(tensor: Any, users: int, timeout_s: float = 1.0) -> bool:
    """Wait until at most ``users`` references hold ``tensor`` itself (not its storage); False on timeout.

    A gloo ``Work.wait()`` returns when the work completes, but the process group's worker thread drops
    its reference to the work's tensors a moment later. A pooled buffer handed to the next bucket in
    that moment looks in use and a fresh one is allocated (seen under load, 2 in 2000 broadcasts).
    """
    use_count = getattr(tensor, "_use_count", None)
    if use_count is None:
        return True
    deadline = time.monotonic() + timeout_s
    while use_count() > users:
        if time.monotonic() > deadline:
            return False
        time.sleep(0)
    return True


WAIT_ABOVE_GROWTH = 1.25  # BufferPool: a bucket this much larger than the free buffer waits instead of growing it


class BufferPool:
    """A few reusable flat ``uint8`` buffers for packed buckets, handed out as ``buffer[:nbytes]``.

    On the host a fresh ``torch.empty`` per bucket costs a page fault per 4 KiB page on first touch: a
    gloo broadcast into a fresh buffer measured 1.9 GB/s here, into a reused one 4.4 GB/s (and copies
    into warm memory run at 16 GB/s against 2.7 GB/s for a clone). vLLM's own packed NCCL consumer
    allocates per chunk, which on a GPU the caching allocator turns into reuse; on the host nothing
    does, so the gloo receiver and the senders keep their buckets' buffers here.

    A buffer is handed out again only when nothing but the pool refers to its storage (`storage_users`
    back at the count it had when idle): a consumer that keeps a view of a bucket past its load —
    vLLM's layerwise reload holds a layer's tensors until the layer is complete — keeps that buffer
    out of the pool, and the next bucket gets another one. At most ``count`` buffers are kept; a buffer
    grows (is replaced by a larger one) only when a bucket does not fit any free one. ``wait`` (a sender's
    "let the bucket in flight finish") is called first when the pool is full, a buffer in use would fit
    and the bucket is more than `WAIT_ABOVE_GROWTH` times the free buffer: a much larger bucket (an
    embedding after the layers) waits for the one in flight instead of growing the other buffer, so a
    sender keeps the largest bucket plus one other rather than twice the largest, while a bucket only
    slightly larger than the free buffer grows it (waiting there would stall every such bucket). When every kept
    buffer is in use, the oldest is dropped from the pool (its holder frees it when it lets go).
    ``stats`` counts reused, grown and fresh hand-outs.
    """

    def __init__(self, count: int = 2, device: Any = None, wait: Optional[Callable[[], None]] = None):
        if count < 1:
            raise ValueError(f"BufferPool(count={count}) needs at least one buffer")
        self.count = count
        self.device = device
        self.wait = wait
        self._buffers: list[tuple[Any, Optional[int]]] = []  # (buffer, storage users when idle)
        self.stats = {"reused": 0, "grown": 0, "fresh": 0}

    @property
    def nbytes(self) -> int:
        """Bytes the pool keeps allocated."""
        return sum(buf.numel() for buf, _ in self._buffers)

    def _idle(self, entry: tuple[Any, Optional[int]]) -> bool:
        buf, idle = entry
        return idle is not None and storage_users(buf) == idle

    def _free(self, device: Any, nbytes: int) -> tuple[list[int], list[int]]:
        """Indices of the idle buffers on ``device``, and of those among them holding ``nbytes``."""
        free = [k for k, entry in enumerate(self._buffers) if entry[0].device == device and self._idle(entry)]
        return free, [k for k in free if self._buffers[k][0].numel() >= nbytes]

    def take(self, nbytes: int, device: Any = None) -> Any:
        """A ``uint8`` tensor of ``nbytes`` bytes on ``device`` (default: the pool's) that nothing else
        uses; its content is undefined."""
        # deferred: pulls in torch (heavy; this module imports without it)
        import torch

        device = torch.device(device if device is not None else self.device or "cpu")
        free, fitting = self._free(device, nbytes)
        largest_free = max((self._buffers[k][0].numel() for k in free), default=0)
        if (not fitting and self.wait is not None and len(self._buffers) >= self.count
                and nbytes > WAIT_ABOVE_GROWTH * largest_free
                and any(buf.numel() >= nbytes and buf.device == device for buf, _ in self._buffers)):
            self.wait()
            free, fitting = self._free(device, nbytes)
        if fitting:
            k = min(fitting, key=lambda k: self._buffers[k][0].numel())
            self.stats["reused"] += 1
            return self._buffers[k][0][:nbytes]
        if free:
            del self._buffers[min(free, key=lambda k: self._buffers[k][0].numel())]  # too small: grow it
            self.stats["grown"] += 1
        else:
            if len(self._buffers) >= self.count:
                del self._buffers[0]  # every buffer is held elsewhere: let the oldest go with its holder
            self.stats["fresh"] += 1
        buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._buffers.append((buf, storage_users(buf)))
        return buf[:nbytes]

    def clear(self) -> None:
        """Drop every buffer (memory still in use elsewhere is freed when its holder lets go)."""
        self._buffers = []


def packed_chunks(sizes: Sequence[int], buffer_bytes: int) -> list[tuple[int, int]]:
    """Byte ranges ``[start, stop)`` of the chunks vLLM's packed NCCL consumer cuts a transfer into.

    vLLM 0.32 (``packed_tensor.pack_tensors`` / ``packed_nccl_broadcast_consumer``) adds tensors to a
    chunk until its size *exceeds* ``buffer_bytes`` (the crossing tensor included), then starts the next.
    The sender broadcasts exactly these slices of its packed bucket, so both sides split the stream alike.
    """
    chunks, start, size = [], 0, 0
    for nbytes in sizes:
        size += nbytes
        if size > buffer_bytes:
            chunks.append((start, start + size))
            start, size = start + size, 0
    if size:
        chunks.append((start, start + size))
    return chunks


def in_sample(name: str, sync_id: int, fraction: float) -> bool:
    digest = hashlib.sha256(f"{sync_id}/{name}".encode()).digest()
    return int.from_bytes(digest[:4], "little") < fraction * 2 ** 32


def sample_names(names: Sequence[str], sync_id: int, fraction: float, always_first: bool = False) -> list[str]:
    """The deterministic verify sample of one bucket (the first name too when ``always_first``)."""
    return [n for k, n in enumerate(names) if (always_first and k == 0) or in_sample(n, sync_id, fraction)]


def choose_transport(requested: str, on_gpu: bool, placement: str) -> str:
    """``rollout.sync_transport`` for a placement: ``auto`` = gloo on CPU; on GPU ipc when the actor and the
    engines share GPUs (``trainer.placement: colocated``), nccl when they have their own."""
    if requested == "auto":
        return "gloo" if not on_gpu else ("ipc" if placement == "colocated" else "nccl")
    if requested not in TRANSPORTS:
        raise ValueError(f"rollout.sync_transport={requested!r}; allowed: auto, {', '.join(TRANSPORTS)}")
    if requested in ("nccl", "ipc") and not on_gpu:
        raise ValueError(f"rollout.sync_transport={requested!r} needs GPUs, and launcher.gpus_per_node is 0; "
                         "set rollout.sync_transport: gloo (or auto)")
    if requested == "ipc" and placement != "colocated":
        raise ValueError("rollout.sync_transport='ipc' shares GPU memory between processes on one GPU, so it needs "
                         f"trainer.placement: colocated (it is {placement!r}); use nccl (or auto) for separate pools")
    return requested


# ----------------------------------------------------------------------------------- transfer group
def transfer_ranks(engine_world_sizes: Sequence[int], num_senders: int = 1) -> tuple[list[int], int]:
    """Rank offsets of each engine's workers in one sender -> all engines group, and the group size.

    The sender is rank 0 (vLLM's convention); engine ``e``'s worker ``w`` is rank ``offset[e] + w``,
    vLLM computing ``w`` itself (data-parallel index x engine world + worker rank; our engines are
    separate vLLM instances, data-parallel index 0).
    """
    if any(w < 1 for w in engine_world_sizes):
        raise ValueError(f"engine world sizes must be >= 1, got {list(engine_world_sizes)}")
    offsets, rank = [], num_senders
    for size in engine_world_sizes:
        offsets.append(rank)
        rank += size
    return offsets, rank


def receiver_init_info(transport: str, endpoints: Sequence[Optional[tuple[str, int]]], rank_offset: int,
                       world_size: int, timeout_s: float, packed_buffer_bytes: int = NCCL_PACKED_BUFFER_BYTES
                       ) -> dict[str, Any]:
    """``init_info`` for one engine's ``init_weight_transfer_engine``: one endpoint per sender (a pipeline
    stage's, or with expert parallelism each EP rank's of each stage), in sender-index order."""
    if transport == "ipc":
        return {"packed": True}
    if transport not in ("gloo", "nccl"):
        raise ValueError(f"unknown weight transport {transport!r}; allowed: {TRANSPORTS}")
    if not endpoints or any(e is None for e in endpoints):
        raise ValueError(f"{transport}: every sender (one per pipeline stage and expert-parallel rank) needs an "
                         f"endpoint, got {list(endpoints)}")
    senders = [{"master_address": host, "master_port": int(port), "rank_offset": rank_offset,
                "world_size": world_size} for host, port in endpoints]
    if transport == "nccl":
        for sender in senders:
            sender.update(packed=True, packed_buffer_size_bytes=packed_buffer_bytes)
        return {"senders": senders}
    return {"senders": senders, "timeout_s": float(timeout_s)}


# -------------------------------------------------------------------------------- engines, as seen by
@dataclass
class EngineRef:
    """One engine as the driver and the senders call it: a Ray actor handle of `VllmEngine`, or an
    in-process engine object whose coroutines run on ``loop`` (a loop running in another thread)."""

    index: int
    target: Any
    loop: Any = field(default=None, repr=False)

    def call(self, method: str, *args: Any, **kwargs: Any) -> concurrent.futures.Future:
        fn = getattr(self.target, method)
        if hasattr(fn, "remote"):
            return fn.remote(*args, **kwargs).future()
        if self.loop is None:
            raise ValueError(f"engine {self.index} is an in-process object: give EngineRef the event loop it runs on")
        # deferred: pulls in asyncio, which this module's importers need not load
        import asyncio

        return asyncio.run_coroutine_threadsafe(fn(*args, **kwargs), self.loop)

    def __getstate__(self) -> dict:
        if self.loop is not None:
            raise TypeError(f"engine {self.index} lives in this process; it cannot be sent to another one")
        return dict(self.__dict__)


def engine_refs(engines: Any, loop: Any = None) -> list[EngineRef]:
    """EngineRefs of a `RolloutGroup`, a list of actor handles / engine objects, or EngineRefs."""
    targets = getattr(engines, "engines", engines)
    out = []
    for index, engine in enumerate(targets):
        if isinstance(engine, EngineRef):
            out.append(engine)
            continue
        engine = getattr(engine, "target", engine)  # a RolloutGroup's EngineHandle
        out.append(EngineRef(index, engine, loop))
    return out


def _is_actor_death(exc: BaseException) -> bool:
    try:
        from ray.exceptions import RayActorError
    except ImportError:  # in-process engines only
        return False
    return isinstance(exc, RayActorError)


def _first_line(exc: BaseException) -> str:
    cause = getattr(exc, "cause", None) or exc
    text = str(cause).strip()
    return f"{type(cause).__name__}: {text.splitlines()[0] if text else ''}".strip()


def wait_engines(futures: Sequence[concurrent.futures.Future], engines: Sequence[EngineRef], what: str,
                 timeout: float, also_done: Callable[[], bool] = lambda: True, poll_s: float = 0.05) -> list[Any]:
    """Results of one call per engine; the first failure raises `WeightSyncError` naming that engine.

    ``also_done`` is a local transfer still in flight (the sender's broadcast): the wait ends when it is
    done and every engine answered, or at the first engine failure (a dead engine would otherwise leave
    the broadcast waiting for it).
    """
    deadline = time.monotonic() + timeout
    pending = set(futures)
    while True:
        done = {f for f in pending if f.done()}
        for fut in done:
            exc = fut.exception()
            if exc is not None:
                engine = engines[list(futures).index(fut)]
                kind = "died" if _is_actor_death(exc) else "failed"
                error = WeightSyncError(f"weight sync: engine {engine.index} {kind} during {what} ({_first_line(exc)})")
                cause = getattr(exc, "cause", None) or exc
                if isinstance(cause, WeightSyncError):  # a failed check: its own words, naming the engine
                    error = WeightSyncError(f"weight sync: engine {engine.index}: {str(cause).strip().splitlines()[0]}")
                raise error from exc
        pending -= done
        if not pending and also_done():
            return [f.result() for f in futures]
        if time.monotonic() > deadline:
            slow = sorted(engines[list(futures).index(f)].index for f in pending)
            raise WeightSyncError(f"weight sync: {what} did not finish within {timeout:.0f} s (trainer.timeouts.sync_s)"
                                  + (f"; engines {slow} did not answer" if slow else "; the local transfer hangs"))
        if pending:
            concurrent.futures.wait(pending, timeout=poll_s, return_when=concurrent.futures.FIRST_COMPLETED)
        else:
            time.sleep(poll_s / 10)


def in_flight_kwargs(keep_in_flight: bool, version: Optional[int], clear_cache: bool = False) -> tuple[dict, dict]:
    """The engines' ``start_weight_update`` and ``finish_weight_update`` keywords of one sync: empty for the
    default sync (an idle engine, the version counted up by one), so an engine that predates weights in
    flight still takes it. ``clear_cache`` (with ``keep_in_flight`` only): the pause drops the prefix cache and
    the kept requests' KV. Plain data only: the engine core may sit in a subprocess (msgpack)."""
    if version is not None and (isinstance(version, bool) or not isinstance(version, int) or version < 0):
        raise ValueError(f"weight sync: version={version!r}; give the policy version as an int >= 0, or None to "
                         "count up by one")
    if clear_cache and not keep_in_flight:
        raise ValueError("weight sync: clear_cache applies to keep_in_flight=True only (a default sync resets the "
                         "prefix cache after the load)")
    start = {"keep_in_flight": True} if keep_in_flight else {}
    if clear_cache:
        start["clear_cache"] = True
    finish = {"version": int(version)} if version is not None else {}
    return start, finish


def call_engines(engines: Sequence[EngineRef], method: str, *args: Any, timeout: float,
                 what: Optional[str] = None, per_engine: Optional[Sequence[Sequence[Any]]] = None,
                 kwargs: Optional[Mapping[str, Any]] = None) -> list[Any]:
    """``method`` on every engine at once (``per_engine[e]`` as engine ``e``'s arguments when given;
    ``kwargs``, plain data, to every engine)."""
    futures = [e.call(method, *(per_engine[i] if per_engine is not None else args), **dict(kwargs or {}))
               for i, e in enumerate(engines)]
    return wait_engines(futures, engines, what or method, timeout)


# ------------------------------------------------------------------------------------------- driver
@dataclass
class SyncSession:
    """An open transfer between one actor group and a fixed set of engines (set up once, used per sync)."""

    transport: str
    engines: list[EngineRef]
    world_sizes: list[int]
    rank_offsets: list[int]
    world_size: int
    endpoints: list[Optional[tuple[str, int]]]
    tied_embeddings: bool = False

    def init_infos(self, timeout_s: float) -> list[dict]:
        return [receiver_init_info(self.transport, self.endpoints, offset, self.world_size, timeout_s)
                for offset in self.rank_offsets]


def payload_bytes(obj: Any) -> tuple[int, int]:
    """``(pickled bytes, tensor bytes)`` of an object the driver sends or receives (for the report)."""
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch

    def tensors(o: Any) -> int:
        if isinstance(o, torch.Tensor):
            return o.numel() * o.element_size()
        if isinstance(o, Mapping):
            return sum(tensors(k) + tensors(v) for k, v in o.items())
        if isinstance(o, (list, tuple, set)):
            return sum(tensors(v) for v in o)
        return 0

    return len(pickle.dumps(obj)), tensors(obj)


def merge_reports(sender_reports: Sequence[Mapping[str, Any]], engine_reports: Sequence[Mapping[str, Any]],
                  sync_id: int, seconds: float, driver_bytes: int) -> dict[str, Any]:
    """One sync's report from the senders' (one per pipeline stage and EP rank) and the engines' answers."""
    senders = [r for r in sender_reports if r]
    verified = sorted(set.intersection(*(set(r.get("verified", [])) for r in engine_reports))) if engine_reports else []
    return {"sync_id": sync_id, "seconds": seconds,
            "senders": len(senders),
            "tensors": sum(r["tensors"] for r in senders), "buckets": sum(r["buckets"] for r in senders),
            "bytes": sum(r["bytes"] for r in senders),
            "send_s": max((r["seconds"] for r in senders), default=0.0),
            "sampled": sorted(n for r in senders for n in r.get("sampled", [])),
            "verified_after_load": verified,
            "peak_buffer_bytes": max((r.get("peak_buffer_bytes", 0) for r in senders), default=0),
            "max_bucket_bytes": max((r.get("max_bucket_bytes", 0) for r in senders), default=0),
            # what one sending rank keeps between syncs (its bucket buffers), and how they were handed out
            "send_buffer_bytes": max((r.get("send_buffer_bytes", 0) for r in senders), default=0),
            "send_buffers": {k: sum(r.get(f"send_buffers_{k}", 0) for r in senders)
                             for k in ("reused", "grown", "fresh")},
            "driver_bytes": driver_bytes}
