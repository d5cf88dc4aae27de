"""Deterministic branch allocation (rollout/ledger.py): the tree is a function of the seed, the prompts and the
policy, never of tool or engine latencies; the AEPO switch and the consecutive-branch penalty.

Scenarios with hand-derived expectations (the scripted policy of docs/design/arpo_reference.md §11.7: with r results in the
context a segment searches for r < R and answers after; top-k tables [.9, .1], [.5, .5], [1.0] give the
entropies H_R0 = 1.4180, H_R1 = 3.0236, 0 at |V| = 98; U values come from scripted per-trajectory streams):

- **S1'**: S1's setting (n = 4, N = 2, beam 2, τ .5, β .2) with the default ``after_result`` timing, so each
  decision uses the probe after its result (ΔH = H_R1 - H_R0 = +1.6056 after result 1, 0 - H_R0 = -1.4180
  after result 2). The last slot is contested by p/0 at its second result, rank (2, 0), and by p/1 and its
  child at (2, 1) and (2, 2); it goes to p/0 whichever reaches its result first.
- **S3**: two roots contest the only free slot in the same round (n = 3, N = 2, reference timing, both draws
  would branch): rank (1, 0) takes it, p/1 draws nothing, whichever tool result comes back first.
"""

from __future__ import annotations

import hashlib

import pytest

from megatron_arpo.rollout.scheduler import RolloutPrompt
from support.scripted import ScriptedStep
from megatron_arpo.rollout.trajectory import tree_digest
from scheduler_helpers import (CODEC, H_R0, H_R1, PROMPT, RESULT, ScriptedRng, check_masks, make_scheduler,
                               reference_script, result_end, run, table, traj_of)

SLOW = 0.25


def latency_for(slow: dict):
    """Tool latency by query prefix: ``{"q0.1@p/0": SLOW}`` slows p/0's second search (and nothing else)."""
    return lambda q: next((v for k, v in slow.items() if q == k), 0.0)


def draws(rng):
    return sorted(rng.used)


# ------------------------------------------------------------------------------------------------ S1'
S1P_LATENCIES = {
    "all fast": {},
    "p/0's second search slow (its rivals reach round 2 first)": {"q0.1@p/0": SLOW},
    "p/1's first search slow (p/0 reaches round 2 before p/1's round-1 decision)": {"q0.0@p/1": SLOW},
}


@pytest.mark.parametrize("scheduler", ["async", "barrier"])
@pytest.mark.parametrize("latency", list(S1P_LATENCIES), ids=["fast", "p0-slow", "p1-slow"])
def test_s1_prime_after_result_tree_and_contested_slot(scheduler, latency):
    # U streams: a stream the canonical order never reaches holds a branching value, so a scheduler that gave
    # the slot to whichever decision arrived first would build another tree.
    rng = ScriptedRng({"p/0": [0.9, 0.1], "p/1": [0.7, 0.0], "p/1/b1.0": [0.0], "p/0/b2.0": [0.0]})
    sched, _ = make_scheduler(reference_script(per_trajectory_queries=True),
                              tool_latency=latency_for(S1P_LATENCIES[latency]), rng=rng, n=4, initial_rollouts=2,
                              beam_size=2, branch_threshold=0.5, entropy_weight=0.2, branch_timing="after_result",
                              scheduler=scheduler, response_length=1000)
    (group,) = run(sched, [RolloutPrompt("p", PROMPT)]).groups
    by_id = {t.traj_id: t for t in group}
    # (1,0): s = 0.9 - 0.2*1.6056 = 0.579 > .5, no. (1,1): s = 0.7 - 0.321 = 0.379, branch -> index 2.
    # (2,0): s = 0.1 + 0.2*1.4180 = 0.384, branch -> index 3 (the last slot). (2,1), (2,2): no slot, no draw.
    assert [t.traj_id for t in group] == ["p/0", "p/1", "p/1/b1.0", "p/0/b2.0"]
    assert draws(rng) == [("p/0", 0.1), ("p/0", 0.9), ("p/1", 0.7)]
    root0, root1 = by_id["p/0"], by_id["p/1"]
    assert [(d.u, d.branched) for d in root0.decisions] == [(0.9, False), (0.1, True)]
    assert [(d.u, d.branched, d.child_id) for d in root1.decisions] == [(0.7, True, "p/1/b1.0")]
    d1, d2 = root0.decisions
    assert (d1.h_now, d1.h0) == (pytest.approx(H_R1), pytest.approx(H_R0))
    assert d1.score == pytest.approx(0.9 - 0.2 * (H_R1 - H_R0))
    assert d2.h_now == 0.0 and d2.score == pytest.approx(0.1 + 0.2 * H_R0)
    assert all(d.timing == "after_result" for d in root0.decisions + root1.decisions)
    assert by_id["p/1/b1.0"].decisions == [] and by_id["p/0/b2.0"].decisions == []
    child1, child0 = by_id["p/1/b1.0"], by_id["p/0/b2.0"]
    assert (child1.parent_id, child1.branch_offset) == ("p/1", result_end(root1, 0))
    assert (child0.parent_id, child0.branch_offset) == ("p/0", result_end(root0, 1))
    for traj in group:
        assert traj.finish_reason == "eos" and len(traj.tool_calls) == 2
        check_masks(traj)


# ------------------------------------------------------------------------------------------------ S3
@pytest.mark.parametrize("scheduler", ["async", "barrier"])
@pytest.mark.parametrize("slow", ["p/0", "p/1"])
def test_s3_contested_slot_goes_to_the_lower_index_in_the_round(scheduler, slow):
    rng = ScriptedRng({"p/0": [0.1], "p/1": [0.1]})
    sched, _ = make_scheduler(reference_script(rounds_with_search=1, per_trajectory_queries=True),
                              tool_latency=latency_for({f"q0.0@{slow}": SLOW}), rng=rng, n=3, initial_rollouts=2,
                              beam_size=2, branch_timing="reference", scheduler=scheduler)
    result = run(sched, [RolloutPrompt("p", PROMPT)])
    (group,) = result.groups
    assert [t.traj_id for t in group] == ["p/0", "p/1", "p/0/b1.0"]
    assert rng.used == [("p/0", 0.1)]  # reference timing, first decision: dH = 0, s = U = 0.1 <= .5
    assert group[1].decisions == [] and result.stats["fills"] == 0


# ------------------------------------------------------------------------------------------------ hashes
def _unit(*parts) -> float:
    return int.from_bytes(hashlib.sha256("/".join(map(str, parts)).encode()).digest()[:8], "little") / 2 ** 64


def seeded_policy(context, request):
    """Searches 1-3 times (from the first request's seed, written into the context), varied entropies."""
    r = context.count(RESULT)
    text = CODEC.decode(context)
    planned = int(text.split("plan ", 1)[1][0]) if "plan " in text else 1 + request.seed % 3
    probs = [(0.9, 0.1), (0.5, 0.5), (0.4, 0.3, 0.3), (0.97, 0.03)][request.seed % 4]
    if r < planned:
        body = f"<think>plan {planned} r{r} {'abc'[request.seed % 3] * (5 + request.seed % 17)}</think>"
        return ScriptedStep(CODEC.encode(f"{body}<search>{r}.{request.seed % 1000}</search>"), table(probs))
    return ScriptedStep(CODEC.encode(f"<think>{'z' * (request.seed % 23)}</think><answer>\\boxed{{{request.seed % 5}}}"
                                     f"</answer><EOS>"), table(probs))


def rollout_digest(salt, *, seed=0, log=None, **options):
    """One rollout of 3 prompts; tool and engine latencies are a hash of (salt, query / request id)."""
    sched, _ = make_scheduler(seeded_policy, tool_latency=lambda q: 0.02 * _unit(salt, "tool", q),
                              engine_latency=lambda req: 0.01 * _unit(salt, "engine", req.request_id), log=log,
                              seed=seed, n=6, beam_size=3, call_limit=3, response_length=300, entropy_weight=0.3,
                              **options)
    result = run(sched, [RolloutPrompt(f"p{i}", CODEC.encode(f"Q{i}")) for i in range(3)])
    return tree_digest(result.trajectories()), result


CONFIGS = {
    "arpo-after_result": dict(variant="arpo", branch_timing="after_result", initial_rollouts=2),
    "arpo-reference": dict(variant="arpo", branch_timing="reference", initial_rollouts=2),
    "aepo-after_result": dict(variant="aepo", branch_timing="after_result", initial_rollouts=2),
    # Dynamic initial count with initial_rollouts == n (the switch of issue 15).
    "aepo-dynamic-reference": dict(variant="aepo", branch_timing="reference", initial_rollouts=6,
                                   dynamic_initial_rollouts=True, initial_entropy_tokens=12),
}


@pytest.mark.parametrize("scheduler", ["async", "barrier"])
@pytest.mark.parametrize("config", list(CONFIGS))
def test_same_seed_same_tree_whatever_the_latencies(scheduler, config):
    logs = ([], [])
    digest_a, result_a = rollout_digest("A", log=logs[0], scheduler=scheduler, **CONFIGS[config])
    digest_b, result_b = rollout_digest("B", log=logs[1], scheduler=scheduler, **CONFIGS[config])
    tool_order = [[q for kind, q in log if kind == "tool_finish"] for log in logs]
    assert tool_order[0] != tool_order[1], "the latencies did not change the completion order; vacuous"
    assert digest_a == digest_b
    # Not a trivial tree: branches were drawn and the budget was contested (decisions found no slot).
    assert result_a.stats["branches"] >= 3 and result_a.stats["draws"] > result_a.stats["branches"]
    for group in result_a.groups:
        assert len(group) == 6
        for traj in group:
            check_masks(traj)
    # The seed does change the tree.
    assert rollout_digest("A", seed=1, scheduler=scheduler, **CONFIGS[config])[0] != digest_a


def test_async_and_barrier_build_the_same_tree():
    digests = {s: rollout_digest("A", scheduler=s, **CONFIGS["arpo-after_result"])[0] for s in ("async", "barrier")}
    assert digests["async"] == digests["barrier"]


def test_digest_ignores_timing_fields_only():
    digest, result = rollout_digest("A", **CONFIGS["arpo-reference"])
    trajs = result.trajectories()
    trajs[0].tool_calls[0].latency_s += 1.0
    trajs[0].segments[0].num_cached_tokens += 16
    assert tree_digest(trajs) == digest
    trajs[0].response_logprobs[0] += 1e-6
    assert tree_digest(trajs) != digest


# ------------------------------------------------------------------------------------------------ AEPO
def test_aepo_dynamic_count_branches_when_initial_rollouts_equals_n():
    # Pre-monitoring gives m = 4 of n = 8 (see test_aepo_dynamic_initial_rollouts_from_premonitoring); the 4 free
    # slots go to branches, not to fresh samples. AEPO at tau = 0: every draw branches (s >= 0).
    sched, _ = make_scheduler(reference_script(), n=8, initial_rollouts=8, variant="aepo",
                              dynamic_initial_rollouts=True, entropy_weight=0.0, branch_threshold=0.0)
    result = run(sched, [RolloutPrompt("p", PROMPT)])
    (group,) = result.groups
    assert result.prompt_info[0]["initial_rollouts"] == 4
    assert [t.origin for t in group] == ["initial"] * 4 + ["branch"] * 4
    assert result.stats["draws"] == 4 and result.stats["fills"] == 0
    assert [t.parent_id for t in group[4:]] == ["p/0", "p/1", "p/2", "p/3"]


@pytest.mark.parametrize("timing", ["reference", "after_result"])
def test_aepo_threshold_is_a_lower_bound_on_the_score(timing):
    # AEPO at tau = 0.3 (beta = 0): branch iff U >= 0.3. ARPO's rule (U <= 0.3) would branch p/1, not p/0.
    rng = ScriptedRng({"p/0": [0.35], "p/1": [0.25]})
    sched, _ = make_scheduler(reference_script(rounds_with_search=1), rng=rng, n=4, initial_rollouts=2,
                              variant="aepo", branch_threshold=0.3, entropy_weight=0.0, branch_timing=timing)
    group = run(sched, [RolloutPrompt("p", PROMPT)]).groups[0]
    assert [(t.traj_id, t.origin) for t in group] == [("p/0", "initial"), ("p/1", "initial"),
                                                      ("p/0/b1.0", "branch"), ("p/f0", "fill")]
    assert [d.score for d in group[0].decisions] == [0.35] and [d.branched for d in group[1].decisions] == [False]


PENALTY_STREAMS = {
    "p/0": [0.5, 0.52, 0.52],           # c = 0: 0.5 >= .5 branch; c = 1: 0.494 no (reset); c = 0: 0.52 branch
    "p/0/b1.0": [0.56, 0.54],           # c = 1: 0.532 branch; c = 2: 0.486 no
    "p/0/b1.0/b2.0": [0.9],             # c = 2: 0.81 branch (the last slot)
    "p/0/b3.0": [0.0], "p/0/b1.0/b2.0/b3.0": [0.0],
}


@pytest.mark.parametrize("scheduler", ["async", "barrier"])
@pytest.mark.parametrize("timing", ["reference", "after_result"])
def test_aepo_consecutive_branch_penalty_changes_the_tree(scheduler, timing):
    """beta = 0, tau = .5, penalty .05: s = U * (1 - 0.05 c), c = consecutive branches on the PATH.

    Every value is chosen where the penalty decides: without it p/0 would branch at its 2nd result and the
    tree would differ; without the reset p/0 would not branch at its 3rd; with the reference's per-prompt
    counter (c = rounds in which the prompt got a new trajectory: 1, 2 at rounds 2, 3) p/0's 3rd decision
    would see c = 2 and not branch.
    """
    rng = ScriptedRng({k: list(v) for k, v in PENALTY_STREAMS.items()})
    sched, _ = make_scheduler(reference_script(rounds_with_search=3, dists=((0.9, 0.1), (0.5, 0.5))), rng=rng,
                              n=5, initial_rollouts=1, variant="aepo", entropy_weight=0.0, branch_threshold=0.5,
                              consecutive_branch_penalty=0.05, call_limit=5, branch_timing=timing,
                              scheduler=scheduler)
    group = run(sched, [RolloutPrompt("p", PROMPT)]).groups[0]
    by_id = {t.traj_id: t for t in group}
    assert [t.traj_id for t in group] == ["p/0", "p/0/b1.0", "p/0/b1.0/b2.0", "p/0/b3.0", "p/0/b1.0/b2.0/b3.0"]
    expected = {
        "p/0": [(0.5, 0, True), (0.52, 1, False), (0.52, 0, True)],
        "p/0/b1.0": [(0.56, 1, True), (0.54, 2, False)],
        "p/0/b1.0/b2.0": [(0.9, 2, True)],
    }
    for traj_id, rows in expected.items():
        got = [(d.u, d.consecutive, d.branched) for d in by_id[traj_id].decisions]
        assert got == rows, traj_id
        for d, (u, c, _) in zip(by_id[traj_id].decisions, rows):
            assert d.score == pytest.approx(u * (1 - 0.05 * c))
    assert by_id["p/0/b3.0"].decisions == [] and by_id["p/0/b1.0/b2.0/b3.0"].decisions == []
