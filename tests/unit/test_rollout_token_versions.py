"""Every response token records the policy version that sampled it (issue 26, step 3): the engine's report
(``SegmentOutput.token_versions``) where it gives one, else the version its weights hold; tool tokens are
NOT_SAMPLED, and a branch inherits its prefix's versions."""

from __future__ import annotations

import pytest

from megatron_arpo.algo.off_policy import token_lags
from megatron_arpo.rollout.scheduler import RolloutPrompt
from megatron_arpo.rollout.trajectory import NOT_SAMPLED, Trajectory
from scheduler_helpers import CODEC, RESULT, Counter, ScriptedStep, make_scheduler, run, table


def _branchy_script():
    counter = Counter()

    def script(context, request):
        r = context.count(RESULT)
        g = counter.next()
        if r < 2:
            return ScriptedStep(CODEC.encode(f"<think>g{g}:zz</think><search>q{g}</search>"), table((0.5, 0.5)))
        return ScriptedStep(CODEC.encode(f"<think>g{g}:</think><answer>\\boxed{{{g}}}</answer><EOS>"), table((0.5, 0.5)))

    return script


def _run(engine_versions=None, version=0):
    sched, engines = make_scheduler(_branchy_script(), n=4, initial_rollouts=2, beam_size=2, call_limit=3,
                                    response_length=300, branch_threshold=1.0, entropy_weight=0.0)
    sched.group.set_version(version)
    for engine in engines:
        engine.version = version  # the scripted engine labels its tokens itself, as VllmEngine does
    if engine_versions is not None:
        for engine in engines:
            original = engine.generate

            async def generate(request, original=original):
                out = await original(request)
                out.token_versions = engine_versions(len(out.token_ids))
                return out

            engine.generate = generate
    return run(sched, [RolloutPrompt("p0", CODEC.encode("Q0"))]).groups[0]


def _check_versions(traj: Trajectory, sampled) -> None:
    traj.check()
    assert len(traj.token_versions) == len(traj.response_ids)
    for pos, (mask, v) in enumerate(zip(traj.loss_mask, traj.token_versions)):
        if mask == 0:
            assert v == NOT_SAMPLED, (traj.traj_id, pos)
        else:
            assert sampled(v), (traj.traj_id, pos, v)


def test_sampled_tokens_carry_the_engines_version_and_tool_tokens_none():
    group = _run(version=3)
    assert any(t.origin == "branch" for t in group), "the test needs a branch"
    for t in group:
        _check_versions(t, lambda v: v == 3)
        assert t.oldest_version() == 3


def test_an_engine_report_wins_and_a_branch_inherits_its_prefix():
    # an engine reporting a weight update mid-request: the first 3 tokens of each output at 5, the rest at 6
    group = _run(engine_versions=lambda n: [5] * min(n, 3) + [6] * max(n - 3, 0), version=9)
    by_id = {t.traj_id: t for t in group}
    branches = [t for t in group if t.origin == "branch"]
    assert branches
    for t in group:
        _check_versions(t, lambda v: v in (5, 6))
        assert t.oldest_version() == 5
    for t in branches:
        parent = by_id[t.parent_id]
        assert t.token_versions[:t.branch_offset] == parent.token_versions[:t.branch_offset]
    assert token_lags([5, NOT_SAMPLED, 6], current=7) == [2, 0, 1]


def test_records_round_trip_and_older_records_load_unversioned():
    t = Trajectory(prompt_id="p", prompt_index=0, traj_id="t", index=0, origin="initial", parent_id=None,
                   branch_offset=None, prompt_token_ids=[1])
    t.append([4, 5], [-0.1, -0.2], 1, versions=[2, 3])
    t.append([6], [0.0], 0)
    assert t.token_versions == [2, 3, NOT_SAMPLED] and t.oldest_version() == 2
    assert Trajectory.from_dict(t.to_dict()).token_versions == [2, 3, NOT_SAMPLED]
    old = t.to_dict()
    del old["token_versions"]
    legacy = Trajectory.from_dict(old)
    legacy.check()
    assert legacy.token_versions == [] and legacy.oldest_version() is None
    child = t.fork("c", 1, 2)
    assert child.token_versions == [2, 3]
    t.truncate(1)
    assert t.token_versions == [2]
    with pytest.raises(ValueError, match="2 tokens but 1 token versions"):
        t.append([1, 2], [0.0, 0.0], 1, versions=[1])
    t.token_versions.append(4)
    with pytest.raises(ValueError, match="1 tokens, 2 token versions"):
        t.check()
