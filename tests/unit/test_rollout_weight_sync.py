"""Weight-sync protocol (buckets, packing, rank offsets, init infos, transport choice) and the gloo sender ->
receiver path end to end with scripted engines: the real sender, gloo transport and receiver checks, no vLLM."""

import asyncio
import threading

import pytest
import torch

from megatron_arpo.weight_sync import protocol as ws
from megatron_arpo.rollout.group import RolloutGroup
from support.scripted import CharCodec, ScriptedEngine, ScriptedStep
from megatron_arpo.rollout.engine import SegmentRequest
from megatron_arpo.weight_sync.senders.local import LocalSync, push_weights

CODEC = CharCodec()


def weights(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [(f"model.layers.{i}.mlp.down_proj.weight", torch.randn(64, 32, generator=g)) for i in range(6)] + [
        ("model.norm.weight", torch.randn(32, generator=g))]


def engine(index=0, cls=ScriptedEngine):
    return cls(lambda ctx, req: ScriptedStep(CODEC.encode("abc<EOS>")), engine_index=index, block_size=4)


@pytest.fixture
def loop():
    """The engines' event loop, in its own thread: the sender in the test thread blocks on them."""
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield loop
    loop.call_soon_threadsafe(loop.stop)
    thread.join(5)


def on(loop, coro):
    return asyncio.run_coroutine_threadsafe(coro, loop).result(60)


# ------------------------------------------------------------------------------------------ buckets
def test_buckets_keep_order_and_respect_the_size():
    named = weights()
    buckets = list(ws.bucket_named_tensors(named, 64 * 32 * 4 * 2))  # two big tensors per bucket
    assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
    assert [len(b) for b in buckets] == [2, 2, 2, 1]  # a full bucket is not overfilled, even by 128 bytes
    assert [len(b) for b in ws.bucket_named_tensors(named, 1)] == [1] * 7  # a tensor larger than a bucket goes alone
    with pytest.raises(ValueError, match="sync_bucket_mb"):
        list(ws.bucket_named_tensors(named, 0))


def test_buckets_never_split_a_decoder_layer():
    """vLLM reloads fused q/k/v and gate/up correctly only when all parts arrive in one call."""
    parts = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "mlp.gate_proj.weight", "mlp.up_proj.weight")
    named = [("model.embed_tokens.weight", torch.zeros(8, 4))]
    named += [(f"model.layers.{i}.{p}", torch.zeros(4, 4)) for i in range(3) for p in parts]
    named += [("model.norm.weight", torch.zeros(4))]
    layer_bytes = 5 * 16 * 4
    for bucket_bytes in (1, 64, layer_bytes - 4, layer_bytes, layer_bytes + 64, 10 * layer_bytes):
        buckets = list(ws.bucket_named_tensors(named, bucket_bytes))
        assert [n for b in buckets for n, _ in b] == [n for n, _ in named]
        homes = {}
        for index, bucket in enumerate(buckets):
            for name, _ in bucket:
                if ".layers." in name:
                    homes.setdefault(name.split(".")[2], set()).add(index)
        assert all(len(where) == 1 for where in homes.values()), (bucket_bytes, homes)


def test_a_packed_bucket_round_trips_and_refuses_a_wrong_size():
    named = [("a", torch.arange(6, dtype=torch.float32).view(2, 3)), ("b", torch.tensor([1, 2], dtype=torch.int64)),
             ("c", torch.ones(3, dtype=torch.bfloat16))]
    layout = ws.BucketLayout.of(named)
    flat = layout.pack(named)
    assert flat.dtype == torch.uint8 and flat.numel() == layout.nbytes == 24 + 16 + 6
    for (name, view), (_, original) in zip(layout.views(flat), named):
        assert view.dtype == original.dtype and torch.equal(view, original)
    assert layout.update_fields() == {"names": ["a", "b", "c"], "dtype_names": ["float32", "int64", "bfloat16"],
                                      "shapes": [[2, 3], [2], [3]]}
    with pytest.raises(ws.WeightSyncError, match="does not match its layout"):
        layout.views(flat[:-1])


def test_packed_chunks_cut_where_vllms_packer_cuts():
    """The NCCL sender broadcasts slices of its packed bucket; vLLM's consumer must cut the stream alike."""
    from vllm.distributed.weight_transfer.packed_tensor import pack_tensors

    g = torch.Generator().manual_seed(1)
    for buffer in (1, 100, 700, 4096, 10**6):
        named = [(f"t{i}", torch.zeros(int(torch.randint(1, 300, (1,), generator=g)), dtype=torch.float32))
                 for i in range(20)]
        it, vllm_chunks, pos = iter(named), [], 0
        while (chunk := pack_tensors(it, lambda item: item[1], buffer)) is not None:
            vllm_chunks.append((pos, pos + chunk.packed_tensor.numel()))
            pos += chunk.packed_tensor.numel()
        assert ws.packed_chunks(ws.BucketLayout.of(named).sizes, buffer) == vllm_chunks, buffer


# ---------------------------------------------------------------------------------- transfer group
def test_rank_offsets_follow_vllms_worker_ranks():
    from types import SimpleNamespace

    from megatron_arpo.weight_sync.receivers import worker_rank

    offsets, world = ws.transfer_ranks([2, 1, 4])
    assert (offsets, world) == ([1, 3, 4], 8)
    # every worker of every engine gets its own rank, the sender is 0
    ranks = [offset + worker_rank(SimpleNamespace(data_parallel_index=0, world_size=size, rank=w))
             for offset, size in zip(offsets, [2, 1, 4]) for w in range(size)]
    assert sorted(ranks) == list(range(1, world))
    # vLLM's own formula for a data-parallel engine: dp index x engine world + worker rank
    assert worker_rank(SimpleNamespace(data_parallel_index=1, world_size=4, rank=3)) == 7
    with pytest.raises(ValueError, match=">= 1"):
        ws.transfer_ranks([2, 0])


def test_init_infos_parse_as_the_receivers_expect():
    from vllm.distributed.weight_transfer.ipc_engine import IPCWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo

    from megatron_arpo.weight_sync.receivers import GlooInitInfo, StagedNCCLInitInfo

    endpoints = [("10.0.0.1", 4000), ("10.0.0.2", 4001)]  # one per sender (stage, or stage and EP rank)
    nccl = ws.receiver_init_info("nccl", endpoints, rank_offset=3, world_size=9, timeout_s=60)
    staged = StagedNCCLInitInfo(**nccl)
    senders = [NCCLWeightTransferInitInfo(**sender) for sender in staged.senders]
    assert [(s.master_address, s.master_port, s.rank_offset, s.world_size) for s in senders] == [
        ("10.0.0.1", 4000, 3, 9), ("10.0.0.2", 4001, 3, 9)]
    assert all(s.packed and s.packed_buffer_size_bytes == ws.NCCL_PACKED_BUFFER_BYTES for s in senders)
    gloo = GlooInitInfo(**ws.receiver_init_info("gloo", endpoints[:1], 1, 2, timeout_s=30))
    assert gloo.timeout_s == 30 and gloo.senders[0]["rank_offset"] == 1
    assert IPCWeightTransferInitInfo(**ws.receiver_init_info("ipc", [], 1, 2, 30)).packed
    with pytest.raises(ValueError, match="every sender .* needs an endpoint"):
        ws.receiver_init_info("nccl", [endpoints[0], None], 1, 5, 60)


def test_transport_follows_the_placement():
    assert ws.choose_transport("auto", on_gpu=False, placement="colocated") == "gloo"
    assert ws.choose_transport("auto", on_gpu=True, placement="colocated") == "ipc"
    assert ws.choose_transport("auto", on_gpu=True, placement="separate") == "nccl"
    assert ws.choose_transport("gloo", on_gpu=True, placement="separate") == "gloo"
    with pytest.raises(ValueError, match="gpus_per_node is 0; set rollout.sync_transport: gloo"):
        ws.choose_transport("nccl", on_gpu=False, placement="separate")
    with pytest.raises(ValueError, match="needs trainer.placement: colocated"):
        ws.choose_transport("ipc", on_gpu=True, placement="separate")
    with pytest.raises(ValueError, match="allowed: auto, gloo, nccl, ipc"):
        ws.choose_transport("object_store", on_gpu=False, placement="colocated")


def test_checksum_sees_a_single_bit():
    t = torch.zeros(4)
    u = t.clone()
    u.view(torch.int32)[2] = 1  # smallest positive denormal: the float sum barely moves, the hash does
    assert ws.tensor_checksum(t)["sha256"] != ws.tensor_checksum(u)["sha256"]


# --------------------------------------------------------------------- sender -> gloo -> receivers
def test_sync_reaches_every_engine_resets_caches_and_verifies(loop):
    engines = [engine(0), engine(1)]
    request = SegmentRequest("r", CODEC.encode("a prompt of some length"), max_tokens=8,
                             stop_token_ids=[CODEC.eos_token_id])
    for e in engines:
        on(loop, e.generate(request))
        assert on(loop, e.generate(request)).num_cached_tokens > 0
    with LocalSync(RolloutGroup(engines), loop=loop) as sync:
        report = sync.push(weights(), bucket_bytes=20000, verify_fraction=0.5)
        again = sync.push(weights(1), bucket_bytes=20000)  # the group formed once serves every sync
    assert [on(loop, e.generate(request)).num_cached_tokens for e in engines] == [0, 0]  # caches dropped
    assert report["tensors"] == 7 and report["buckets"] == 3 and report["bytes"] == 6 * 64 * 32 * 4 + 32 * 4
    assert report["sampled"] and report["sampled"][0] == "model.layers.0.mlp.down_proj.weight"
    assert report["verified_after_load"] == sorted(report["sampled"])
    assert [r["loaded"] for r in report["engines"]] == [7, 7] and again["sampled"] == []
    for e in engines:
        for name, tensor in weights(1):
            assert torch.equal(e.weights[name], tensor)


class HalvingEngine(ScriptedEngine):
    """Loads every tensor scaled by 0.5: an engine whose load path is wrong."""

    def _store(self, name, tensor):
        super()._store(name, tensor * 0.5)


def test_verify_sync_stops_on_a_wrong_load_and_names_the_engine(loop):
    with pytest.raises(ws.WeightSyncError, match=r"^weight sync: engine 1: verify_sync: model\.\S+ differs "
                                                 r"between the received tensor and the engine parameter \(load\)"):
        push_weights([engine(0), engine(1, HalvingEngine)], weights(), verify_fraction=1.0, loop=loop)
    # Without verification the wrong load goes unnoticed (why the option exists).
    push_weights([engine(0, HalvingEngine)], weights(), verify_fraction=0.0, loop=loop)


def test_verify_sync_stops_on_a_corrupted_transfer(loop, monkeypatch):
    import megatron_arpo.weight_sync.senders.base as sender_mod

    real = sender_mod.tensor_checksum

    def lying(tensor):  # the sender's sum of what it meant to send; the bytes on the wire differ
        out = real(tensor)
        out["sha256"] = "0" * 64
        return out

    monkeypatch.setattr(sender_mod, "tensor_checksum", lying)
    with pytest.raises(ws.WeightSyncError, match=r"^weight sync: engine 0: verify_sync: model\.\S+ differs "
                                                 r"between the actor and the engine \(transport\)"):
        push_weights([engine(0)], weights(), verify_fraction=1.0, loop=loop)


class FailingEngine(ScriptedEngine):
    async def update_weights(self, update_info):
        if update_info["bucket"] == 1:
            raise RuntimeError("worker 0 ran out of memory")
        return await super().update_weights(update_info)


def test_an_engine_failing_mid_sync_fails_it_naming_the_engine(loop):
    with pytest.raises(ws.WeightSyncError, match=r"^weight sync: engine 1 failed during bucket 1 of sender 0 "
                                                 r"\(stage 0, sync \d+\) \(RuntimeError: worker 0 ran out of memory\)$"):
        push_weights([engine(0), engine(1, FailingEngine)], weights(), bucket_bytes=20000, timeout_s=30, loop=loop)


# ------------------------------------------------------------------------------- reusable buffers
def test_buffer_pool_reuses_only_buffers_nothing_else_holds():
    pool = ws.BufferPool(2)
    first = pool.take(100)
    first_ptr = first.data_ptr()
    del first
    again = pool.take(80)  # nothing refers to the first buffer any more: handed out again
    assert again.data_ptr() == first_ptr and again.numel() == 80
    kept = again[8:16].view(torch.int32)  # a consumer keeps a view past the load (vLLM's layerwise reload)
    kept.fill_(7)
    del again
    other = pool.take(80)
    assert other.data_ptr() != first_ptr  # the held buffer is not handed out
    other.fill_(0)
    assert kept.tolist() == [7, 7]
    assert pool.stats == {"reused": 1, "grown": 0, "fresh": 2}
    del kept, other
    bigger = pool.take(500)  # both free now, neither fits: the smaller one is replaced by a larger one
    assert bigger.numel() == 500 and pool.stats["grown"] == 1 and pool.nbytes == 600
    third, fourth = pool.take(10), pool.take(10)  # every buffer held: the oldest leaves the pool
    assert pool.stats["fresh"] == 3 and len({bigger.data_ptr(), third.data_ptr(), fourth.data_ptr()}) == 3
    pool.clear()
    assert pool.nbytes == 0


def test_a_full_pool_waits_for_the_buffer_in_flight_rather_than_growing_the_other():
    in_flight = {}
    pool = ws.BufferPool(2, wait=in_flight.clear)  # the sender's wait: the bucket in flight is done
    in_flight["bucket 0"] = pool.take(100)
    pool.take(50)  # bucket 1, already sent and dropped
    # Bucket 2 (100 bytes) does not fit the free buffer; the one in flight would: wait for it.
    assert pool.take(100).numel() == 100 and not in_flight
    assert pool.stats == {"reused": 1, "grown": 0, "fresh": 2} and pool.nbytes == 150
    assert ws.BufferPool(2).take(100).numel() == 100  # no wait given: grows or allocates instead


class ViewKeepingEngine(ScriptedEngine):
    """Keeps the received tensors themselves (views of the receive buffer), as a loader that defers its copy."""

    def _store(self, name, tensor):
        self.weights[name] = tensor


def test_await_release_waits_for_gloos_reference_to_a_bucket(tmp_path):
    """A completed gloo work still holds its tensors until it is dropped (its worker thread drops it a
    moment after ``wait()`` returns): the pool would see the bucket as in use and allocate a fresh one."""
    import torch.distributed as dist

    pg = dist.ProcessGroupGloo(dist.FileStore(str(tmp_path / "store"), 1), 0, 1)
    pool = ws.BufferPool(count=1)
    flat = pool.take(1000)
    users = flat._use_count()
    work = pg.broadcast(flat, 0)
    work.wait()
    assert flat._use_count() > users  # the work's reference
    assert not ws.await_release(flat, users, timeout_s=0.05)  # still held: times out, says so
    work_holder = [work]
    del work
    threading.Timer(0.1, work_holder.clear).start()  # as gloo's worker thread, later
    assert ws.await_release(flat, users, timeout_s=10.0) and flat._use_count() == users
    del flat
    pool.take(1000)
    assert pool.stats == {"reused": 1, "grown": 0, "fresh": 1}


def test_a_receive_buffer_a_load_still_holds_is_never_overwritten(loop):
    # Five buckets through two receive buffers: reusing a buffer the loader still holds would overwrite
    # the first buckets' tensors with later ones.
    e = engine(0, ViewKeepingEngine)
    push_weights([e], weights(), bucket_bytes=20000, loop=loop)
    for name, tensor in weights():
        assert torch.equal(e.weights[name], tensor), name
    assert e._receiver.buffers.stats["reused"] == 0


def test_receive_buffers_are_reused_across_buckets_and_syncs_and_loads_copy_in_place(loop):
    e = engine(0)
    with LocalSync([e], loop=loop) as sync:
        sync.push(weights(), bucket_bytes=20000)
        params = {name: t.data_ptr() for name, t in e.weights.items()}
        sync.push(weights(1), bucket_bytes=20000)
    stats = e._receiver.buffers.stats
    assert stats["fresh"] + stats["grown"] <= 2 and sum(stats.values()) == 6  # 3 buckets per sync, 2 syncs
    assert {name: t.data_ptr() for name, t in e.weights.items()} == params  # copied into, as model params
    for name, tensor in weights(1):
        assert torch.equal(e.weights[name], tensor)


def test_a_broken_gloo_transfer_names_the_engine_whose_call_fails_a_moment_later(monkeypatch):
    """gloo may see the peer's connection close before Ray reports the engine's death: the sender waits for the
    engine's call to fail and names that engine instead of passing on gloo's bare transport error."""
    import concurrent.futures
    import threading

    from megatron_arpo.weight_sync.senders import gloo

    class BrokenWork:
        def is_completed(self):
            return True

        def wait(self):
            raise RuntimeError("[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:38631")

    sender = object.__new__(gloo.GlooSender)
    sender.engines, sender.timeout_s = [ws.EngineRef(0, object()), ws.EngineRef(1, object())], 30.0
    healthy, dying = concurrent.futures.Future(), concurrent.futures.Future()
    threading.Timer(0.3, lambda: dying.set_exception(RuntimeError("ActorDiedError: the actor died"))).start()
    with pytest.raises(ws.WeightSyncError, match=r"^weight sync: engine 1 failed during bucket 0 of sender 0 "
                                                 r"\(stage 0, sync 3\) \(RuntimeError: ActorDiedError"):
        sender._wait_sent([healthy, dying], BrokenWork(), "bucket 0 of sender 0 (stage 0, sync 3)")
    monkeypatch.setattr(gloo, "BROKEN_TRANSFER_GRACE_S", 0.2)  # no engine call fails: the transport is named
    with pytest.raises(ws.WeightSyncError, match=r"the gloo transfer broke during bucket 0 .* no engine reported a "
                                                 r"failure within 0 s \(\[gloo.*Connection closed by peer"):
        sender._wait_sent([concurrent.futures.Future()] * 2, BrokenWork(), "bucket 0 of sender 0 (stage 0, sync 3)")
