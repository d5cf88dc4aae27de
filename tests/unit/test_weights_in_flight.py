"""Weights in flight on `VllmEngine`: the pause/resume state machine of ``start_weight_update(keep_in_flight=True)``
and ``finish_weight_update(version)``, per-token versions, and the sync keywords, without an engine process.

The engine runs on vLLM's real client classes with the core's socket replaced (`support.core_client`): every
call into the core is msgpack-encoded as over the real socket. The real core's pause is exercised by
tests/integration/test_rollout_vllm.py (``test_weights_in_flight_...``).
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

pytest.importorskip("vllm")
from megatron_arpo.rollout.engine import SegmentRequest, expand_token_versions  # noqa: E402
from megatron_arpo.weight_sync.protocol import in_flight_kwargs  # noqa: E402
from support.core_client import EncodingCoreClient, bare_engine  # noqa: E402


@pytest.fixture
def engine(monkeypatch):
    monkeypatch.delenv("VLLM_ALLOW_INSECURE_SERIALIZATION", raising=False)
    core = EncodingCoreClient()
    eng = bare_engine(core)
    yield eng, core
    eng._thread.shutdown(wait=True)


def utility_calls(core):
    return [(name, args) for name, args in core.calls if name != "collective_rpc"]


def request(rid="r"):
    return SegmentRequest(rid, [1, 2, 3], max_tokens=4)


def test_a_paused_update_pauses_the_core_keeps_requests_waiting_and_resumes_with_the_version(engine):
    eng, core = engine

    async def scenario():
        await eng.start_weight_update(keep_in_flight=True)
        waiting = asyncio.ensure_future(eng.generate(request("late")))
        await asyncio.sleep(0.05)
        queued = (waiting.done(), [rid.split(":", 1)[1] for rid, _ in eng._to_add], eng._stats["steps"])
        waiting.cancel()   # this core answers no steps: the request leaves before the resume
        await asyncio.gather(waiting, return_exceptions=True)
        report = await eng.finish_weight_update(version=7)
        return queued, report, await eng.policy_version(), eng._paused

    queued, report, version, paused = asyncio.run(scenario())
    assert queued == (False, ["late"], 0)   # not refused, not stepped: it waits for the resume
    assert report["loaded"] == 2 and version == 7 and paused is False
    # plain data over the socket, in vLLM's order: pause ("keep", KV kept), label, resume
    assert utility_calls(core) == [("pause_scheduler", ("keep", False)), ("set_weight_version", ("7",)),
                                   ("resume_scheduler", ())]
    methods = [args[0] for name, args in core.calls if name == "collective_rpc"]
    assert methods == ["start_weight_update", "finish_weight_update", "arpo_sync_report"]


def test_clear_cache_reaches_the_core_and_needs_keep_in_flight(engine):
    eng, core = engine
    with pytest.raises(ValueError, match="clear_cache applies to keep_in_flight=True only"):
        asyncio.run(eng.start_weight_update(clear_cache=True))
    asyncio.run(eng.start_weight_update(keep_in_flight=True, clear_cache=True))
    assert utility_calls(core)[0] == ("pause_scheduler", ("keep", True))


def test_the_default_update_stays_idle_only_and_never_pauses(engine):
    eng, core = engine

    async def scenario():
        await eng.start_weight_update()
        with pytest.raises(RuntimeError, match="partial weight update"):
            await eng.generate(request())
        await eng.finish_weight_update()
        await eng.start_weight_update()
        await eng.finish_weight_update()
        return await eng.policy_version()

    assert asyncio.run(scenario()) == 2   # no version given: one more per update
    assert utility_calls(core) == [("set_weight_version", ("1",)), ("set_weight_version", ("2",))]
    eng._futures["0:busy"] = None   # a request in flight
    with pytest.raises(RuntimeError, match="requests in flight; finish the rollout"):
        asyncio.run(eng.start_weight_update())


def test_a_paused_engine_takes_buckets_and_a_retry_but_refuses_to_sleep(engine):
    eng, core = engine

    async def scenario():
        await eng.start_weight_update(keep_in_flight=True)
        eng._futures["0:kept"] = None   # a kept request does not block the update
        await eng.init_weight_transfer_engine({"master_address": "x"}, keep_in_flight=True)
        with pytest.raises(RuntimeError, match="paused for a weight update in flight"):
            await eng.sleep(1)
        await eng.start_weight_update(keep_in_flight=True)   # a failed update's retry: still paused, no new pause
        eng._futures.clear()

    asyncio.run(scenario())
    assert [name for name, _ in utility_calls(core)].count("pause_scheduler") == 1 and eng._paused


def test_token_versions_follow_vllms_weight_version_spans():
    span = lambda v, s, e: SimpleNamespace(version=v, start=s, end=e)  # noqa: E731 (vLLM's WeightVersionSpan)
    assert expand_token_versions([span("3", 0, 2), span("4", 2, 5)], 5, fallback=9) == [3, 3, 4, 4, 4]
    assert expand_token_versions(None, 3, fallback=9) == [9, 9, 9]   # no label reported
    assert expand_token_versions([span("3", 0, 2)], 3, fallback=9) == [9, 9, 9]   # spans short of the tokens
    assert expand_token_versions([span("3", 1, 3)], 3, fallback=9) == [9, 9, 9]   # a gap


def test_the_sync_keywords_are_empty_by_default_and_refuse_a_bad_version():
    assert in_flight_kwargs(False, None) == ({}, {})
    assert in_flight_kwargs(True, 4) == ({"keep_in_flight": True}, {"version": 4})
    for bad in (-1, 1.5, True, "3"):
        with pytest.raises(ValueError, match="give the policy version as an int >= 0"):
            in_flight_kwargs(True, bad)
