"""The IPC weight sync's send path (``ActorSync._send_ipc``) on fake CUDA: ordering and buffer reuse.

Every rank of a TP=2 x DP=2 tiny-qwen3 actor runs three syncs over ``ipc`` in one child process, one rank
after the other (``python test_ipc_sync.py OUT.json``); a consumer stands in for vLLM's IPC engine: on
rank 0, the shipper, it records each bucket's read (the earliest moment a real engine worker may read
every rank's buffer) and the buffer handles it was given. Each rank's trace (the harness's: collectives
with their groups, stream synchronizes; plus the bucket hand-offs) is replayed with vector clocks, the
n-th collective of a group joining its members, to order events across ranks. Asserted:

- every rank's bucket k is packed (its stream synchronized after the bucket was handed to the sender)
  before any engine reads bucket k; and the read is over before any rank packs bucket k+1 over it;
- each rank exports the same IPC buffer in every sync (one persistent buffer, not one per sync).
"""

from __future__ import annotations

import concurrent.futures
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.slow

WORLD, TP = 4, 2
NUM_SYNCS = 3
BUCKET_BYTES = 1 << 16  # several buckets per sync for tiny-qwen3


@pytest.fixture(scope="module")
def traces(tmp_path_factory) -> dict:
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    out = tmp_path_factory.mktemp("ipc") / "out.json"
    hf_dir = str(tiny_checkpoint("tiny-qwen3"))
    proc = subprocess.run([sys.executable, __file__, str(out), hf_dir, str(out.parent)], capture_output=True,
                          text=True, timeout=900)
    assert out.exists(), f"the IPC child died (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(out.read_text())
    if "unavailable" in result:
        pytest.skip(f"fake CUDA harness unavailable: {result['unavailable']}")
    assert "error" not in result, result["error"]
    return {int(rank): [tuple(_tuples(e)) for e in events] for rank, events in result["traces"].items()}


def _tuples(event):
    return [tuple(x) if isinstance(x, list) else x for x in event]


def vector_clocks(traces: dict[int, list[tuple]]) -> dict[int, list[tuple[tuple, tuple]]]:
    """``{rank: [(event, clock)]}``: each event with its vector clock; a collective joins its group's clocks."""
    ranks = sorted(traces)
    clock = {r: [0] * len(ranks) for r in ranks}
    pos = {r: 0 for r in ranks}
    seen: dict[tuple, int] = {}        # (rank, group) -> collectives of that group the rank has passed
    waiting: dict[tuple, set] = {}     # (group, n) -> ranks blocked at it
    stamped: dict[int, list] = {r: [] for r in ranks}

    def stamp(r, event):
        clock[r][r] += 1
        stamped[r].append((event, tuple(clock[r])))
        pos[r] += 1

    while any(pos[r] < len(traces[r]) for r in ranks):
        progress = False
        for r in ranks:
            while pos[r] < len(traces[r]):
                event = traces[r][pos[r]]
                if event[0] != "collective":
                    stamp(r, event)
                    progress = True
                    continue
                group = tuple(event[2])
                key = (group, seen.get((r, group), 0))
                blocked = waiting.setdefault(key, set())
                blocked.add(r)
                if blocked != set(group):
                    break  # the other members have not reached it yet
                joined = [max(clock[m][i] for m in group) for i in range(len(ranks))]
                for m in group:
                    clock[m] = list(joined)
                    stamp(m, traces[m][pos[m]])
                    seen[(m, group)] = seen.get((m, group), 0) + 1
                del waiting[key]
                progress = True
        stuck = {r: traces[r][pos[r]] for r in ranks if pos[r] < len(traces[r])}
        assert progress or not stuck, f"the ranks' collectives do not match: each rank waits at {stuck}"
    return stamped


def before(a: tuple, rank_a: int, b: tuple) -> bool:
    """Event with clock ``a`` on ``rank_a`` happens before the event with clock ``b``."""
    return a[rank_a] <= b[rank_a]


def test_every_rank_packed_bucket_k_before_any_engine_reads_it(traces):
    stamped = vector_clocks(traces)
    reads = {(e[1], e[2]): c for e, c in stamped[0] if e[0] == "read"}
    assert len({s for s, _ in reads}) == NUM_SYNCS and len(reads) > NUM_SYNCS  # several buckets per sync
    for rank, events in stamped.items():
        handed = [(i, e) for i, (e, _) in enumerate(events) if e[0] == "handed"]
        assert [(e[1], e[2]) for _, e in handed] == sorted(reads), rank  # every rank packs every bucket
        for i, (_, sync_id, bucket) in handed:
            packed = next((c for e, c in events[i + 1:] if e[0] == "sync"), None)  # the stream drained
            assert packed is not None, f"rank {rank} never synchronized its stream after bucket {bucket}"
            read = reads[sync_id, bucket]
            assert before(packed, rank, read), (f"sync {sync_id}: an engine reads bucket {bucket} before rank "
                                                f"{rank} finished packing it")


def test_no_rank_packs_the_next_bucket_before_the_engines_read_this_one(traces):
    stamped = vector_clocks(traces)
    reads = {(e[1], e[2]): c for e, c in stamped[0] if e[0] == "read"}
    for rank, events in stamped.items():
        for event, clock in events:
            if event[0] == "returned":  # the sender let go of the bucket: the buffer is packed again next
                assert before(reads[event[1], event[2]], 0, clock), (rank, event)


def test_no_host_tensor_reaches_an_nccl_collective_during_the_syncs(traces):
    assert [e for events in traces.values() for e in events if e[0] == "violation"] == []


def test_each_rank_exports_one_persistent_buffer_in_every_sync(traces):
    for rank, events in traces.items():
        shared = [e for e in events if e[0] == "shared"]
        assert [e[1] for e in shared] == list(range(1, NUM_SYNCS + 1)), rank
        assert len({e[2] for e in shared}) == 1, f"rank {rank} exported a new IPC buffer per sync: {shared}"
    handles = {e[3] for e in traces[0] if e[0] == "read"}  # what the engines were given
    assert len(handles) == 1, handles


def test_the_trace_analysis_tells_a_ship_before_the_barrier_from_one_after_it():
    """The replay itself, on hand-written traces of the two orders (no fake CUDA needed)."""
    world = tuple(range(WORLD))

    def trace(rank: int, barrier_before_ship: bool) -> list[tuple]:
        events = [("collective", "all_gather_object", world)]
        for k in range(3):
            events += [("collective", "all_gather", (0, 1) if rank < 2 else (2, 3)),  # the bucket's TP gathers
                       ("handed", 1, k), ("sync", "stream")]
            events += [("collective", "barrier", world)] if barrier_before_ship else []
            events += [("read", 1, k, "fake-ipc:1")] if rank == 0 else []
            events += [("collective", "barrier", world), ("returned", 1, k)]
        return events

    def packed_before_read(traces) -> bool:
        stamped = vector_clocks(traces)
        reads = {(e[1], e[2]): c for e, c in stamped[0] if e[0] == "read"}
        for rank, events in stamped.items():
            for i, (event, _) in enumerate(events):
                if event[0] == "handed":
                    packed = next(c for e, c in events[i + 1:] if e[0] == "sync")
                    if not before(packed, rank, reads[event[1], event[2]]):
                        return False
        return True

    assert not packed_before_read({r: trace(r, False) for r in range(WORLD)})  # the old IpcSender's order
    assert packed_before_read({r: trace(r, True) for r in range(WORLD)})


# ----------------------------------------------------------------------------------------------- child
class _Remote:
    """An engine method as ``EngineRef.call`` drives an actor's: ``.remote(...).future()``."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        try:
            fut.set_result(self.fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 (handed to the sender, as a failed engine call would be)
            fut.set_exception(exc)
        return SimpleNamespace(future=lambda: fut)


class IpcConsumer:
    """vLLM's IPC engine in the sender's eyes: told per bucket to read every GPU's buffer (by handle)."""

    def __init__(self, session):
        self.session = session
        self.update_weights = _Remote(self._read)

    def _read(self, info: dict) -> int:
        handles = sorted({args[7].decode() for args in info["ipc_handles"].values()})
        self.session.note("read", info["sync_id"], info["bucket"], ",".join(handles))
        return len(info["names"])


def run_rank(rank: int, hf_dir: str, work: Path) -> list:
    from megatron_arpo.actor.worker import MegatronActorWorker
    from megatron_arpo.fake_cuda.harness import fake_cuda
    from megatron_arpo.weight_sync.protocol import EngineRef
    from scenario import experiment_config

    spec = {"model": "tiny-qwen3", "tp": TP, "pp": 1, "dp": WORLD // TP, "sequence_parallel": False,
            "hf_dir": hf_dir, "work_dir": str(work)}
    keep = []  # every exported buffer stays alive, so a new allocation cannot take a freed one's identity
    with fake_cuda(WORLD, rank, check=False) as session:  # violations are reported, not raised mid-run
        worker = MegatronActorWorker(experiment_config(spec), rank, WORLD)
        worker.init_model()
        sync = worker._sync_state()
        sync.reserve("ipc")
        sync.open([EngineRef(0, IpcConsumer(session))], world_size=0, timeout_s=60)
        sender = sync.sender
        share, send = sender.share, sender.send
        state = {}

        def shared(buffer):
            keep.append(buffer)
            session.note("shared", state["sync"], f"fake-ipc:{buffer.untyped_storage()._cdata}")
            return share(buffer)

        def handed(flat, named, verify_fraction=0.0):
            bucket = sender.stats["buckets"]
            session.note("handed", state["sync"], bucket)
            send(flat, named, verify_fraction)
            session.note("returned", state["sync"], bucket)

        sender.share, sender.send = shared, handed
        session.trace.clear()  # from here on: the syncs only
        for sync_id in range(1, NUM_SYNCS + 1):
            state["sync"] = sync_id
            worker.send_weights(sync_id, BUCKET_BYTES)
        trace = [list(e) for e in session.trace]
        worker.shutdown()
    keep.clear()
    return trace + [["violation", str(v)] for v in session.violations]


def main(argv: list[str]) -> int:
    from megatron_arpo.fake_cuda.harness import FakeCudaUnavailable, load_guard

    out, hf_dir, work = Path(argv[0]), argv[1], Path(argv[2])
    try:
        load_guard()
    except FakeCudaUnavailable as exc:
        out.write_text(json.dumps({"unavailable": str(exc)}))
        return 0
    import traceback

    traces = {}
    try:
        for rank in range(WORLD):
            traces[rank] = run_rank(rank, hf_dir, work / f"rank{rank}")
    except BaseException:
        out.write_text(json.dumps({"error": traceback.format_exc()}))
        return 1
    out.write_text(json.dumps({"traces": traces}))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
