"""benchmarks/off_policy.py: its slow retriever speaks HttpRetrieverBackend's format, and its per-run and
summary arithmetic (tokens/s over the steps' wall time, idle shares, min/median/max, ratios vs sync)."""

import asyncio
import json

import pytest

from megatron_arpo.tools.search import HttpRetrieverBackend, LocalBM25Backend
from support.scripts import load_script


@pytest.fixture(scope="module")
def bench():
    return load_script("benchmarks/off_policy.py", "off_policy_benchmark")


def test_latency_retriever_answers_like_the_local_bm25(bench, tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    docs = [{"id": "1", "title": "Kelford", "contents": "Kelford has a population of 4120."},
            {"id": "2", "title": "Ostrel", "contents": "Ostrel lies in Norvania, by the river."}]
    corpus.write_text("".join(json.dumps(d) + "\n" for d in docs))

    async def search(url):
        backend = HttpRetrieverBackend(url)
        try:
            return await backend.search("Kelford population", 2)
        finally:
            await backend.close()

    with bench.LatencyRetriever(corpus, latency_s=0.0) as server:
        got = asyncio.run(search(server.url))
        requests = server.requests
    want = LocalBM25Backend(str(corpus)).search_sync("Kelford population", 2)
    assert [(p.title, p.text, p.doc_id) for p in got] == [(p.title, p.text, p.doc_id) for p in want]
    assert got[0].title == "Kelford" and got[0].score == pytest.approx(want[0].score)
    assert requests == 1


def _row(step_s, rollout_s, tokens, **extra):
    return {"time/step_s": step_s, "time/rollout_s": rollout_s, "time/update_s": 1.0, "actor/tokens": tokens,
            "tools/search/calls_per_traj": 0.5, "tools/python/calls_per_traj": 0.25, **extra}


def test_run_record_sync_idle_shares_come_from_the_phase_timers(bench):
    rec = bench.run_record([_row(10.0, 8.0, 1000), _row(30.0, 24.0, 3000)], "sync")
    assert rec["tokens_per_s"] == pytest.approx(4000 / 40)
    assert rec["steps_per_hour"] == pytest.approx(3600 * 2 / 40)
    assert rec["engine_idle"] == pytest.approx(8 / 40) and rec["actor_idle"] == pytest.approx(32 / 40)
    assert rec["calls_per_traj"] == {"python": 0.25, "search": 0.5}


def test_run_record_off_policy_idle_shares_come_from_its_metrics(bench):
    off = {"offpolicy/engine_idle_s": 1.0, "offpolicy/actor_idle_s": 3.0, "offpolicy/dropped_stale": 1}
    rec = bench.run_record([_row(10.0, 3.0, 1000, **off), _row(10.0, 3.0, 1000, **off)], "k1")
    assert rec["engine_idle"] == pytest.approx(0.1) and rec["actor_idle"] == pytest.approx(0.3)
    assert rec["dropped_stale"] == 2


def test_summary_min_median_max_and_ratio_against_sync(bench):
    def rec(mode, tps):
        return {"latency_s": 3.0, "mode": mode, "tokens_per_s": tps, "steps_per_hour": tps,
                "engine_idle": 0.1, "actor_idle": 0.2}

    records = [rec("sync", 10.0), rec("k1", 18.0), rec("sync", 14.0), rec("k1", 16.0), rec("sync", 12.0),
               rec("k1", 30.0)]
    summary = bench.summarize(records)[3.0]
    assert summary["sync"]["tokens_per_s"] == {"min": 10.0, "median": 12.0, "max": 14.0}
    assert summary["k1"]["tokens_per_s"] == {"min": 16.0, "median": 18.0, "max": 30.0}
    assert summary["k1"]["ratio_vs_sync"] == pytest.approx(1.5) and summary["sync"]["ratio_vs_sync"] == 1.0
    assert summary["k1"]["repeats"] == 3
