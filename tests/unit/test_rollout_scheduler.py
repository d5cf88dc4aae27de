"""ARPO scheduler bookkeeping with the scripted engine (docs/design/arpo_reference.md §11.7 S1, S2, S4-S7) and records."""

from __future__ import annotations

import asyncio

import pytest

from megatron_arpo.algo.branching import aepo_initial_rollouts
from megatron_arpo.rollout.protocol import TagProtocol
from megatron_arpo.rollout.scheduler import RolloutPrompt
from support.scripted import CharCodec, ScriptedStep
from scheduler_helpers import (CODEC, H_R0, H_R1, PROMPT, RESULT, Counter, ScriptedRng, check_masks, gen_ids,
                               make_scheduler, reference_script, result_end, run, table, text_of)

def test_reference_script_entropies_match_reference_table():
    sched, _ = make_scheduler(reference_script(), n=1, initial_rollouts=1, beam_size=1, entropy_metrics=True)
    (traj,) = run(sched, [RolloutPrompt("q0", PROMPT)]).groups[0]
    assert [s.entropy for s in traj.segments] == pytest.approx([1.4180, 3.0236, 0.0], abs=1e-4)
    assert [s.finish for s in traj.segments] == ["tool:search", "tool:search", "eos"]
    assert traj.finish_reason == "eos" and traj.response_ids[-1] == CODEC.eos_token_id


def test_s1_reference_timing_lineage_and_draws():
    rng = ScriptedRng({"q0/0": [0.1, 0.3], "q0/1": [0.9]})
    # The second-round search is slower; the order of the decisions is canonical anyway (rank (1, 1) before (2, 0)).
    sched, _ = make_scheduler(reference_script(), tool_latency=lambda q: 0.2 if q.endswith(".1") else 0.0,
                              rng=rng, n=4, initial_rollouts=2, beam_size=2, branch_threshold=0.5,
                              entropy_weight=0.2, branch_timing="reference", call_limit=5, response_length=1000)
    result = run(sched, [RolloutPrompt("q0", PROMPT)])
    (group,) = result.groups
    out0, out1, out2, out3 = group
    assert [t.traj_id for t in group] == ["q0/0", "q0/1", "q0/0/b1.0", "q0/0/b2.0"]
    assert [u for _, u in rng.used] == [0.1, 0.9, 0.3]
    assert result.stats["draws"] == 3 and result.stats["branches"] == 2

    d1, d2 = out0.decisions
    assert (d1.u, d1.branched, d1.child_id) == (0.1, True, "q0/0/b1.0")
    assert d1.h_now == pytest.approx(H_R0) and d1.h0 == pytest.approx(H_R0) and d1.score == pytest.approx(0.1)
    assert (d2.u, d2.branched, d2.child_id) == (0.3, True, "q0/0/b2.0")
    assert d2.h_now == pytest.approx(H_R1) and d2.score == 0.0  # clip(0.3 - 0.2 * 1.6056) = 0
    assert [(d.u, d.branched) for d in out1.decisions] == [(0.9, False)]
    assert out2.decisions == [] and out3.decisions == []  # no slot left when they reached a result

    # Lineage: out2 = g1-g5-g8 (copy after result 1), out3 = g1-g3-g9 (copy after result 2).
    g0, g1, g2, g3 = (gen_ids(t) for t in group)
    assert len(set(g0 + g1)) == 6
    assert g2[0] == g0[0] and not set(g2[1:]) & set(g0 + g1)
    assert g3[:2] == g0[:2] and g3[2] not in g0 + g1 + g2
    assert (out2.parent_id, out2.branch_offset) == ("q0/0", result_end(out0, 0))
    assert (out3.parent_id, out3.branch_offset) == ("q0/0", result_end(out0, 1))
    assert out2.response_ids[:out2.branch_offset] == out0.response_ids[:out2.branch_offset]
    assert out3.response_ids[:out3.branch_offset] == out0.response_ids[:out3.branch_offset]
    assert [s.owner for s in out2.segments] == ["q0/0", "q0/0/b1.0", "q0/0/b1.0"]
    assert [s.owner for s in out3.segments] == ["q0/0", "q0/0", "q0/0/b2.0"]
    assert out2.baseline_entropy == pytest.approx(H_R0)  # inherited path baseline
    for traj in group:
        assert traj.finish_reason == "eos" and len(traj.tool_calls) == 2
        check_masks(traj)


def test_s2_no_tool_use_fills_all_missing_at_once():
    log = []

    def script(context, request):
        return ScriptedStep(CODEC.encode("<think>plain</think><answer>\\boxed{1}</answer><EOS>"), table((0.5, 0.5)))

    sched, _ = make_scheduler(script, engine_latency=0.01, log=log, n=4, initial_rollouts=2)
    result = run(sched, [RolloutPrompt("p", PROMPT)])
    (group,) = result.groups
    assert [t.origin for t in group] == ["initial", "initial", "fill", "fill"]
    assert result.stats["draws"] == 0 and result.stats["fills"] == 2 and result.prompt_info[0]["fills"] == 2
    # Both fills are in flight together (the reference starts one per round: batch sizes [2, 1, 1]).
    fill_starts = [i for i, (kind, rid) in enumerate(log) if kind == "gen_start" and "/f" in rid]
    fill_finishes = [i for i, (kind, rid) in enumerate(log) if kind == "gen_finish" and "/f" in rid]
    assert len(fill_starts) == 2 and max(fill_starts) < min(fill_finishes)
    for traj in group:
        assert traj.tool_calls == [] and traj.loss_mask == [1] * len(traj.response_ids)


def test_s4_call_limit_appends_eos_and_counts_hits():
    sched, _ = make_scheduler(reference_script(rounds_with_search=99), n=2, initial_rollouts=2, call_limit=2)
    result = run(sched, [RolloutPrompt("p", PROMPT)])
    assert result.stats["call_limit_hits"] == 2 and result.stats["tool_calls"] == 4
    for traj in result.groups[0]:
        assert len(traj.tool_calls) == 2 and len(traj.segments) == 3
        assert traj.call_limit_hit and traj.finish_reason == "call_limit"
        assert traj.response_ids[-2:] == [CODEC.token_id("</search>"), CODEC.eos_token_id]
        assert traj.loss_mask[-1] == 1
        check_masks(traj)


def test_s5_empty_query_gets_error_result_and_trajectory_continues():
    def script(context, request):
        if context.count(RESULT) == 0:
            return ScriptedStep(CODEC.encode("<think>hmm</think><search></search>"), table((0.5, 0.5)))
        return ScriptedStep(CODEC.encode("<answer>\\boxed{2}</answer><EOS>"), table((0.5, 0.5)))

    sched, _ = make_scheduler(script, n=1, initial_rollouts=1)
    (traj,) = run(sched, [RolloutPrompt("p", PROMPT)]).groups[0]
    (call,) = traj.tool_calls
    assert call.query == "" and call.error == "empty query" and call.result_text.startswith("Error")
    assert traj.finish_reason == "eos" and len(traj.segments) == 2
    check_masks(traj)


def test_query_comes_from_the_segment_never_from_the_prompt():
    # A closing tag without an opening one: the reference would pick up "leak" from the prompt (Q5).
    def script(context, request):
        if context.count(RESULT) == 0:
            return ScriptedStep(CODEC.encode("abc</search>"), table((0.5, 0.5)))
        return ScriptedStep(CODEC.encode("<search>two</search>"), table((0.5, 0.5)))

    sched, _ = make_scheduler(script, n=1, initial_rollouts=1, call_limit=2)
    (traj,) = run(sched, [RolloutPrompt("p", CODEC.encode("<search>leak"))]).groups[0]
    assert [c.query for c in traj.tool_calls] == ["", "two"]
    assert traj.finish_reason == "call_limit"


def test_s6_response_budget_is_never_exceeded():
    first = CODEC.encode(f"<think>g1:{'x' * 20}</think><search>q0.0</search>")
    block = CODEC.encode(" <result>\ndoc[q0.0]\n</result>")
    limit = len(first) + 5
    sched, (engine,) = make_scheduler(reference_script(), n=1, initial_rollouts=1, response_length=limit)
    (traj,) = run(sched, [RolloutPrompt("p", PROMPT)]).groups[0]
    assert len(engine.requests) == 1 and engine.requests[0].max_tokens == limit
    assert len(traj.response_ids) == limit and sum(traj.loss_mask) == len(first)
    assert traj.response_ids[len(first):] == block[:5] and traj.tool_calls[0].num_result_tokens == 5
    assert traj.finish_reason == "length"


@pytest.mark.parametrize("timing", ["after_result", "reference"])
def test_every_request_asks_for_at_most_the_remaining_budget(timing):
    limit = 90
    sched, (engine,) = make_scheduler(reference_script(rounds_with_search=99), n=4, initial_rollouts=2,
                                      response_length=limit, call_limit=9, branch_timing=timing,
                                      entropy_weight=5.0)
    result = run(sched, [RolloutPrompt("p", PROMPT)])
    for req in engine.requests:
        remaining = limit - (len(req.prompt_token_ids) - len(PROMPT))
        assert req.max_tokens in (remaining, min(20, remaining)), req
    for traj in result.groups[0]:
        assert len(traj.response_ids) == limit and traj.finish_reason == "length"
        check_masks(traj)


def test_s7_baseline_is_reset_for_every_rollout_call():
    dists = {"first": (0.5, 0.5)}

    def script(context, request):
        r = context.count(RESULT)
        probs = dists["first"] if r == 0 else (0.5, 0.5)
        text = f"<think>{'y' * 20}</think><search>q</search>" if r < 1 else "<answer>\\boxed{1}</answer><EOS>"
        return ScriptedStep(CODEC.encode(text), table(probs))

    sched, _ = make_scheduler(script, n=3, initial_rollouts=2, branch_timing="reference")
    first = run(sched, [RolloutPrompt("p", PROMPT)])
    dists["first"] = (0.9, 0.1)
    second = run(sched, [RolloutPrompt("p", PROMPT)])
    for traj in first.groups[0][:2]:
        assert traj.baseline_entropy == pytest.approx(H_R1)
    for traj in second.groups[0][:2]:
        assert traj.baseline_entropy == pytest.approx(H_R0)   # not the 3.0236 of call 1 (reference Q1)
        assert all(d.h0 == pytest.approx(H_R0) for d in traj.decisions)
    assert any(t.decisions for t in second.groups[0])


def test_after_result_probe_decides_on_tokens_after_the_result_and_forks_there():
    sched, (engine,) = make_scheduler(reference_script(rounds_with_search=1), n=2, initial_rollouts=1,
                                      entropy_weight=10.0, branch_timing="after_result")
    parent, child = run(sched, [RolloutPrompt("p", PROMPT)]).groups[0]
    (decision,) = parent.decisions
    assert decision.timing == "after_result" and decision.branched and decision.child_id == child.traj_id
    # h_now is the entropy of the tokens generated after the result (round 1: [.5, .5]), not the
    # segment that ended with the call (round 0: [.9, .1]), which is the baseline.
    assert decision.h_now == pytest.approx(H_R1) and decision.h0 == pytest.approx(H_R0)
    assert parent.segments[1].num_requests == 2
    probe = [r for r in engine.requests if r.request_id.endswith(f"{parent.traj_id}:s1.0")]
    assert probe[0].max_tokens == 20
    boundary = result_end(parent, 0)
    assert child.branch_offset == decision.at_offset == boundary
    assert child.response_ids[:boundary] == parent.response_ids[:boundary]
    assert gen_ids(child)[1] not in gen_ids(parent)
    # The copy's first request found its parent's blocks in the (simulated) prefix cache.
    assert child.segments[1].num_cached_tokens >= 16
    for traj in (parent, child):
        check_masks(traj)


def test_grpo_when_initial_rollouts_equals_n():
    sched, (engine,) = make_scheduler(reference_script(), n=4, initial_rollouts=4, entropy_weight=10.0)
    result = run(sched, [RolloutPrompt("p", PROMPT)])
    assert [t.origin for t in result.groups[0]] == ["initial"] * 4
    assert result.stats["draws"] == 0 and all(not t.decisions for t in result.groups[0])
    assert all(r.max_tokens > 20 for r in engine.requests)  # no probes


def test_validation_mode_is_greedy_single_and_unbranched():
    sched, (engine,) = make_scheduler(reference_script(), n=4, initial_rollouts=2, entropy_weight=10.0)
    result = asyncio.run(sched.run([RolloutPrompt("a", PROMPT), RolloutPrompt("b", PROMPT)],
                                   options=sched.options.for_validation()))
    assert [len(g) for g in result.groups] == [1, 1]
    assert all(r.temperature == 0.0 for r in engine.requests) and result.stats["draws"] == 0


@pytest.mark.parametrize("scheduler", ["async", "barrier"])
@pytest.mark.parametrize("timing,variant", [("after_result", "arpo"), ("reference", "arpo"),
                                            ("after_result", "aepo")])
def test_exactly_n_per_prompt_with_valid_lineage(scheduler, timing, variant):
    counter = Counter()

    def script(context, request):
        r = context.count(RESULT)
        g = counter.next()
        if r < 3 and g % 3:
            text = f"<think>g{g}:{'z' * (g % 7)}</think><search>q{g}</search>"
        else:
            text = f"<think>g{g}:</think><answer>\\boxed{{{g}}}</answer><EOS>"
        return ScriptedStep(CODEC.encode(text), table([(0.9, 0.1), (0.5, 0.5), (0.4, 0.3, 0.3)][g % 3]))

    sched, _ = make_scheduler(script, tool_latency=lambda q: (int(q[1:]) % 4) * 0.005, n=5, initial_rollouts=2,
                              beam_size=3, call_limit=2, response_length=200, branch_timing=timing,
                              variant=variant, scheduler=scheduler, entropy_weight=0.5)
    prompts = [RolloutPrompt(f"p{i}", CODEC.encode(f"Q{i}")) for i in range(3)]
    result = run(sched, prompts)
    assert [len(g) for g in result.groups] == [5, 5, 5]
    for index, group in enumerate(result.groups):
        by_id = {t.traj_id: t for t in group}
        assert len(by_id) == 5 and [t.index for t in group] == list(range(5))
        for traj in group:
            assert traj.prompt_index == index and len(traj.response_ids) <= 200
            check_masks(traj)
            if traj.origin == "branch":
                parent = by_id[traj.parent_id]
                assert traj.response_ids[:traj.branch_offset] == parent.response_ids[:traj.branch_offset]
                assert traj.branch_offset in [result_end(parent, k) for k in range(len(parent.tool_calls))]
    if scheduler == "barrier":
        assert result.stats["barrier_rounds"] >= 3


def _ab_script(context, request):
    """Trajectory /0 asks a fast query, /1 a slow one; both answer after their result."""
    if context.count(RESULT) == 0:
        query = "fast" if ":p/0:" in request.request_id else "slow"
        return ScriptedStep(CODEC.encode(f"<search>{query}</search>"), table((0.5, 0.5)))
    return ScriptedStep(CODEC.encode("<answer>\\boxed{1}</answer><EOS>"), table((0.5, 0.5)))


def test_async_scheduler_has_no_round_barrier():
    log = []
    sched, _ = make_scheduler(_ab_script, tool_latency=lambda q: 0.3 if q == "slow" else 0.0, log=log,
                              n=2, initial_rollouts=2)
    run(sched, [RolloutPrompt("p", PROMPT)])
    # The fast trajectory's next segment is done before its slow sibling's tool result is back.
    assert log.index(("gen_finish", "0:p/0:s1.0")) < log.index(("tool_finish", "slow"))


def test_barrier_scheduler_waits_for_the_slowest_tool():
    log = []
    sched, _ = make_scheduler(_ab_script, tool_latency=lambda q: 0.3 if q == "slow" else 0.0, log=log,
                              n=2, initial_rollouts=2, scheduler="barrier")
    run(sched, [RolloutPrompt("p", PROMPT)])
    assert log.index(("gen_start", "0:p/0:s1.0")) > log.index(("tool_finish", "slow"))


def test_aepo_dynamic_initial_rollouts_from_premonitoring():
    sched, _ = make_scheduler(reference_script(), n=8, initial_rollouts=2, variant="aepo",
                              dynamic_initial_rollouts=True, entropy_weight=0.0)
    result = run(sched, [RolloutPrompt("p", PROMPT)])
    info = result.prompt_info[0]["premonitor"]
    assert info["h_root"] == pytest.approx(H_R0)
    assert info["h_tool"] == pytest.approx([H_R0, H_R1, 0.0])
    m = aepo_initial_rollouts(8, H_R0 - (H_R0 + H_R1) / 3)
    assert info["initial_rollouts"] == m == result.prompt_info[0]["initial_rollouts"] == 4
    group = result.groups[0]
    assert len(group) == 8 and sum(t.origin == "initial" for t in group) == m
    assert all(t.origin != "premonitor" for t in group) and result.stats["premonitor_tool_calls"] == 2


def test_sticky_routing_keeps_a_prompt_on_one_engine():
    sched, engines = make_scheduler(reference_script(), n=4, initial_rollouts=2, num_engines=2, entropy_weight=10.0)
    result = run(sched, [RolloutPrompt(f"p{i}", CODEC.encode(f"Q{i}")) for i in range(4)])
    assert [g[0].engine_index for g in result.groups] == [0, 1, 0, 1]
    for group in result.groups:
        assert all(t.engine_index == group[0].engine_index for t in group)
    for engine in engines:
        served = {r.request_id.split(":")[1].split("/")[0] for r in engine.requests}
        expected = {g[0].prompt_id for g in result.groups if g[0].engine_index == engine.engine_index}
        assert served == expected and len(expected) == 2


# ------------------------------------------------------------------------------------------ records
def test_records_round_trip_and_replay_into_flat_tensors(tmp_path):
    from megatron_arpo.rollout.trajectory import load_records, records_to_batch, save_records

    sched, _ = make_scheduler(reference_script(), n=3, initial_rollouts=2, entropy_weight=10.0)
    result = run(sched, [RolloutPrompt("a", PROMPT), RolloutPrompt("b", CODEC.encode("Q1"))])
    trajs = result.trajectories()
    for i, t in enumerate(trajs):
        t.reward = float(i)
    path = save_records(tmp_path / "rollout.jsonl", trajs)
    loaded = load_records(path)
    assert loaded == trajs
    batch = records_to_batch(loaded, require_rewards=True)
    lengths = [len(t.prompt_token_ids) + len(t.response_ids) for t in trajs]
    assert batch["cu_seqlens"].tolist() == [sum(lengths[:i]) for i in range(len(lengths) + 1)]
    assert batch["group_ids"].tolist() == [0, 0, 0, 1, 1, 1]
    assert batch["rewards"].tolist() == [float(i) for i in range(6)]
    for i, t in enumerate(trajs):
        lo, hi = batch["cu_seqlens"][i].item(), batch["cu_seqlens"][i + 1].item()
        assert batch["input_ids"][lo:hi].tolist() == t.prompt_token_ids + t.response_ids
        mask = batch["loss_mask"][lo:hi].tolist()
        assert mask == [0.0] * len(t.prompt_token_ids) + [float(m) for m in t.loss_mask]
        assert batch["position_ids"][lo:hi].tolist() == list(range(hi - lo))
    # Tool-result tokens are excluded from the loss in the replayed batch.
    assert 0 < batch["loss_mask"].sum().item() < sum(len(t.response_ids) for t in trajs)


def test_load_records_names_the_bad_line(tmp_path):
    from megatron_arpo.rollout.trajectory import load_records

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt_id": "x"}\n')
    with pytest.raises(ValueError, match=r"bad\.jsonl:1"):
        load_records(bad)


def test_protocol_finds_calls_on_text_and_splices_results_once():
    protocol = TagProtocol(CODEC, ["search", "python"])
    assert protocol.stop_strings == ["</search>", "</python>"] and protocol.stop_token_ids == [CODEC.eos_token_id]
    assert CODEC.decode(protocol.encode_result("x")) == " <result>\nx\n</result>"
    seg = CODEC.encode("<search>old</search> then <search> new q </search>")
    call = protocol.find_call(seg)  # the FIRST closing tag ends the segment; its own opening tag gives the query
    assert (call.tag, call.query, call.num_tokens) == ("search", "old", len(CODEC.encode("<search>old</search>")))
    assert protocol.find_call(CODEC.encode("no call")) is None
    assert protocol.find_call(CODEC.encode("stray</python> more")).query == ""
    # The closing tag that ENDS first wins (the engine's rule), whatever the order of the tags.
    assert protocol.find_call(CODEC.encode("<python>a<search>b</search></python>")).tag == "search"


def test_tags_are_multi_token_text_for_a_codec_without_tag_tokens():
    codec = CharCodec(special_tokens=("<EOS>",))  # every tag is plain characters, one token each
    protocol = TagProtocol(codec, ["search"])
    seg = codec.encode("<search>q1</search>tail")
    call = protocol.find_call(seg)
    assert (call.query, call.num_tokens, call.trailing_text) == ("q1", len("<search>q1</search>"), "")


def test_a_failing_trajectory_fails_the_call_without_hanging():
    def script(context, request):
        if context.count(RESULT) >= 1:
            raise KeyError("script failure after the first result")
        return ScriptedStep(CODEC.encode("<search>a</search>"), table((0.5, 0.5)))

    sched, _ = make_scheduler(script, n=4, initial_rollouts=2)
    with pytest.raises(KeyError, match="script failure"):
        run(sched, [RolloutPrompt("a", PROMPT), RolloutPrompt("b", PROMPT)])
    with pytest.raises(ValueError, match="unique"):
        run(sched, [RolloutPrompt("a", PROMPT), RolloutPrompt("a", PROMPT)])


def test_rewards_from_the_shared_reward_function():
    from megatron_arpo.rewards import get_reward_fn
    from megatron_arpo.rollout.trajectory import score_trajectories

    sched, _ = make_scheduler(reference_script(), n=2, initial_rollouts=2)
    result = run(sched, [RolloutPrompt("right", PROMPT), RolloutPrompt("wrong", CODEC.encode("Q1"))])
    rewards = score_trajectories(result.trajectories(), get_reward_fn("deep_research"), CODEC,
                                 {"right": "x", "wrong": "y"})
    # Two searches with results, the boxed answer x: F1 = 1.0 (no multi-tool bonus: one tool kind used).
    assert rewards == [1.0, 1.0, 0.0, 0.0]
    assert [t.reward for t in result.trajectories()] == rewards


def test_protocol_ends_on_every_listed_eos():
    protocol = TagProtocol(CODEC, ["search"], eos_token_ids=[CODEC.eos_token_id, 12345])
    assert protocol.is_end(12345) and protocol.is_end(protocol.eos_token_id)
    assert protocol.eos_token_id == CODEC.eos_token_id  # the first listed: appended at the call limit
    assert protocol.stop_token_ids == sorted({CODEC.eos_token_id, 12345})
