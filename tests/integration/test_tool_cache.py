"""ToolCache with real SQLite: two processes at once, in-flight de-duplication, export/import, what a key
covers (search settings, corpus content), empty answers, damaged files."""

import asyncio
import json
import multiprocessing as mp
import os
import sqlite3

import pytest

from megatron_arpo.tools.base import Tool, ToolExecutor, ToolResult
from megatron_arpo.tools.cache import ToolCache
from megatron_arpo.tools.search import NO_RESULTS, LocalBM25Backend, Passage, SearchTool, normalize_query

pytestmark = pytest.mark.timeout(120)

NUM_KEYS = 300
SHARED_KEYS = 50


def _writer(path, worker, barrier, errors):
    """Each worker writes its own keys plus a shared block, and reads back the other worker's keys."""
    try:
        cache = ToolCache(path, busy_timeout_s=30)
        barrier.wait()
        other = 1 - worker
        seen_other = 0
        for i in range(NUM_KEYS):
            cache.put("search", f"w{worker}-{i}", ToolResult(text=f"value {worker} {i}"))
            if i < SHARED_KEYS:
                cache.put("search", f"shared-{i}", ToolResult(text=f"shared {i}"))
            hit = cache.get("search", f"w{other}-{i}")
            if hit is not None:
                assert hit.text == f"value {other} {i}"
                seen_other += 1
        cache.close()
        errors.put(("ok", worker, seen_other))
    except BaseException as exc:  # reported to the parent; the test fails on anything but "ok"
        errors.put(("error", worker, repr(exc)))


def test_two_processes_share_one_cache(tmp_path):
    path = str(tmp_path / "cache.sqlite")
    ctx = mp.get_context("fork")
    barrier = ctx.Barrier(2)
    results = ctx.Queue()
    workers = [ctx.Process(target=_writer, args=(path, w, barrier, results)) for w in (0, 1)]
    for proc in workers:
        proc.start()
    outcomes = [results.get(timeout=100) for _ in workers]
    for proc in workers:
        proc.join(timeout=30)
        assert proc.exitcode == 0
    assert all(outcome[0] == "ok" for outcome in outcomes), outcomes
    cache = ToolCache(path)
    assert len(cache) == 2 * NUM_KEYS + SHARED_KEYS
    for worker in (0, 1):
        for i in range(NUM_KEYS):
            assert cache.get("search", f"w{worker}-{i}").text == f"value {worker} {i}"
    assert cache.get("search", "shared-7").text == "shared 7"
    assert cache.get("python", "w0-1") is None  # the tool is part of the key


class CountingTool(Tool):
    tag = "search"
    cacheable = True

    def __init__(self):
        self.calls = 0
        self.release = None

    def cache_key(self, query):
        return normalize_query(query)

    async def execute(self, query):
        self.calls += 1
        await self.release.wait()
        return ToolResult(text=f"answer to {query}")


def test_identical_inflight_calls_share_one_execution(tmp_path):
    tool = CountingTool()
    cache = ToolCache(str(tmp_path / "c.sqlite"))
    executor = ToolExecutor([tool], cache=cache)

    async def siblings():
        tool.release = asyncio.Event()
        tasks = [asyncio.ensure_future(executor.execute("search", "capital of Veloria")) for _ in range(5)]
        # the search key drops double quotes: this sibling asks the same normalised query
        tasks.append(asyncio.ensure_future(executor.execute("search", '"capital of Veloria"')))
        await asyncio.sleep(0.05)
        tasks[0].cancel()  # the first caller goes away; the others must still get the answer
        tool.release.set()
        return await asyncio.gather(*tasks[1:])

    results = asyncio.run(siblings())
    assert tool.calls == 1
    assert all(r.text == "answer to capital of Veloria" for r in results)
    assert sum(r.cached for r in results) == 5
    stats = cache.stats()
    assert stats["misses"] == 1 and stats["inflight_hits"] == 5
    assert cache.get("search", "capital of Veloria").text == "answer to capital of Veloria"


def test_export_import_round_trip(tmp_path):
    source = ToolCache(str(tmp_path / "live.sqlite"))
    for i in range(20):
        source.put("search", f"q{i}", ToolResult(text=f"r{i}", truncated=i % 2 == 0))
    source.put("search", "bad", ToolResult(text="Error", error="timeout"))  # never stored
    snapshot = str(tmp_path / "ckpt" / "tool_cache.sqlite")
    assert source.export(snapshot) == snapshot
    assert sorted(os.listdir(tmp_path / "ckpt")) == ["tool_cache.sqlite"]  # no temp file left
    with sqlite3.connect(snapshot) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone()[0] == "ok"

    target = ToolCache(str(tmp_path / "resumed.sqlite"))
    target.put("search", "q0", ToolResult(text="stale"))
    target.put("search", "only-here", ToolResult(text="kept"))
    assert target.import_(snapshot) == 20
    assert len(target) == 21
    for i in range(20):
        entry = target.get("search", f"q{i}")
        assert entry.text == f"r{i}" and entry.truncated == (i % 2 == 0) and entry.cached
    assert target.get("search", "only-here").text == "kept"
    assert target.get("search", "bad") is None
    with pytest.raises(FileNotFoundError, match="export one"):
        target.import_(str(tmp_path / "missing.sqlite"))


# ------------------------------------------------------------------------------------ what a key covers
DOCS = [
    {"id": "a", "title": "Zorblat", "contents": "Zorblat is a purple fruit that grows only on Mount Quell."},
    {"id": "b", "title": "Zorblat trees", "contents": "Zorblat trees need the cold air of Mount Quell."},
    {"id": "c", "title": "Harbour of Pelm", "contents": "The harbour of Pelm handles fishing boats and ferries."},
]


def _write_corpus(path, docs):
    path.write_text("".join(json.dumps(doc) + "\n" for doc in docs))
    return str(path)


def _search(cache_path, corpus, query, **kwargs):
    executor = ToolExecutor([SearchTool(LocalBM25Backend(corpus), **kwargs)], cache=ToolCache(str(cache_path)))

    async def call():
        try:
            return await executor.execute("search", query)
        finally:
            await executor.close()

    return asyncio.run(call())


def test_search_cache_key_covers_topk_result_chars_and_corpus(tmp_path):
    cache = tmp_path / "cache.sqlite"
    corpus = _write_corpus(tmp_path / "corpus.jsonl", DOCS)
    one = _search(cache, corpus, "Zorblat", topk=1)
    assert not one.cached and len(one.text.splitlines()) == 1
    assert _search(cache, corpus, "Zorblat", topk=1).cached
    two = _search(cache, corpus, "Zorblat", topk=2)  # another topk: not the stale one-passage answer
    assert not two.cached and len(two.text.splitlines()) == 2
    short = _search(cache, corpus, "Zorblat", topk=1, result_chars=10)
    assert not short.cached and len(short.text) < len(one.text)
    # the same content under another path is the same corpus; changed content is another one
    copy = _write_corpus(tmp_path / "copy.jsonl", DOCS)
    assert _search(cache, copy, "Zorblat", topk=1).cached
    changed = _write_corpus(tmp_path / "corpus.jsonl", [dict(DOCS[0], contents="Zorblat is now a blue fruit.")])
    fresh = _search(cache, changed, "Zorblat", topk=1)
    assert not fresh.cached and "blue fruit" in fresh.text


class FlakyRetriever:
    """Answers nothing the first time (a retriever hiccup), then the passage."""

    def __init__(self):
        self.calls = 0

    def identity(self):
        return {"kind": "test"}

    async def search(self, query, topk):
        self.calls += 1
        return [] if self.calls == 1 else [Passage("T", "the passage")]


def test_empty_answers_are_not_cached(tmp_path):
    backend = FlakyRetriever()
    cache = ToolCache(str(tmp_path / "c.sqlite"))
    executor = ToolExecutor([SearchTool(backend)], cache=cache)

    async def calls():
        return [await executor.execute("search", "q") for _ in range(3)]

    first, second, third = asyncio.run(calls())
    assert first.text == NO_RESULTS and not first.cached
    assert second.text == "Page 1: T: the passage" and not second.cached
    assert third.cached and backend.calls == 2
    assert len(cache) == 1


# ------------------------------------------------------------------------------------ damaged files
def _filled(path, entries=2000):
    cache = ToolCache(str(path))
    for i in range(entries):
        cache.put("search", f"k{i}", ToolResult(text=f"value {i} " + "x" * 200))
    cache.close()
    with sqlite3.connect(path) as conn:
        conn.execute("PRAGMA wal_checkpoint(TRUNCATE)")


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_cache_is_set_aside_and_the_run_goes_on(tmp_path, caplog, damage):
    path = tmp_path / "tool_cache.sqlite"
    if damage == "garbage":
        path.write_bytes(b"this is not a database\n" * 100)
    else:
        _filled(path)
        with open(path, "r+b") as handle:
            handle.truncate(os.path.getsize(path) // 2)
    before = path.read_bytes()
    with caplog.at_level("WARNING", logger="megatron_arpo.tools.cache"):
        cache = ToolCache(str(path))
    aside = [p for p in os.listdir(tmp_path)
             if p.startswith("tool_cache.sqlite.corrupt-") and not p.endswith(("-wal", "-shm"))]
    assert len(aside) == 1 and (tmp_path / aside[0]).read_bytes() == before
    assert str(path) in caplog.text and aside[0] in caplog.text
    cache.put("search", "q", ToolResult(text="fresh"))
    assert cache.get("search", "q").text == "fresh" and len(cache) == 1


def test_a_corrupt_snapshot_is_skipped_on_resume_with_its_name(tmp_path, caplog):
    live = ToolCache(str(tmp_path / "live.sqlite"))
    live.put("search", "kept", ToolResult(text="kept"))
    snapshot = tmp_path / "step-3" / "tool_cache.sqlite"
    snapshot.parent.mkdir()
    snapshot.write_bytes(b"\0garbage" * 512)
    with caplog.at_level("WARNING", logger="megatron_arpo.tools.cache"):
        assert live.import_(str(snapshot)) == 0
    assert str(snapshot) in caplog.text
    assert live.get("search", "kept").text == "kept"


def test_entries_whose_keys_ignored_the_settings_are_dropped(tmp_path, caplog):
    path = tmp_path / "old.sqlite"
    with sqlite3.connect(path) as conn:  # the schema before keys carried the tool settings (version 0)
        conn.execute("CREATE TABLE tool_cache (tool TEXT NOT NULL, key TEXT NOT NULL, text TEXT NOT NULL, "
                     "truncated INTEGER NOT NULL DEFAULT 0, created REAL NOT NULL, PRIMARY KEY (tool, key))")
        conn.execute("INSERT INTO tool_cache VALUES ('search', 'capital of Veloria', 'stale', 0, 0)")
    with caplog.at_level("WARNING", logger="megatron_arpo.tools.cache"):
        cache = ToolCache(str(path))
    assert len(cache) == 0 and "dropped 1 entries" in caplog.text
    cache.close()
    assert len(ToolCache(str(path))) == 0  # now version 2: opened again, nothing more to drop


def test_a_failing_database_is_a_miss_not_a_crash(tmp_path, caplog):
    cache = ToolCache(str(tmp_path / "c.sqlite"))
    cache.put("search", "q", ToolResult(text="a"))
    cache._conn.close()  # every later statement fails
    with caplog.at_level("WARNING", logger="megatron_arpo.tools.cache"):
        assert cache.get("search", "q") is None
        cache.put("search", "q2", ToolResult(text="b"))
    assert cache.stats()["errors"] == 2 and "treated as a miss" in caplog.text
