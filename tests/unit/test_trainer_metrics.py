"""Per-step metrics of the RL loop (megatron_arpo.trainer.metrics) on hand-built trajectory records."""

from __future__ import annotations

import math

import pytest

from megatron_arpo.rollout.scheduler import RolloutResult
from megatron_arpo.rollout.trajectory import Segment, ToolCall, Trajectory
from megatron_arpo.trainer import metrics


def make_traj(prompt_id, index, *, reward=0.0, origin="initial", parent=None, response=4, tool_calls=(),
              segments=(), call_limit_hit=False, finish="eos", prompt_len=3, logprobs=None, mask=None):
    t = Trajectory(prompt_id=prompt_id, prompt_index=int(prompt_id[1:]), traj_id=f"{prompt_id}/{index}", index=index,
                   origin=origin, parent_id=parent, branch_offset=None, prompt_token_ids=list(range(prompt_len)))
    t.response_ids = list(range(10, 10 + response))
    t.loss_mask = list(mask) if mask is not None else [1] * response
    t.response_logprobs = list(logprobs) if logprobs is not None else [-1.0] * response
    t.tool_calls = list(tool_calls)
    t.segments = list(segments)
    t.call_limit_hit, t.finish_reason, t.reward = call_limit_hit, finish, reward
    return t


def call(tool, owner, *, error=None, result_offset=2, num_result_tokens=2):
    return ToolCall(tool=tool, query="q", result_text="r", latency_s=0.1, cached=False, error=error, truncated=False,
                    call_offset=result_offset, result_offset=result_offset, num_result_tokens=num_result_tokens,
                    owner=owner)


def test_reward_metrics_overall_and_per_source():
    trajs = [make_traj("p0", 0, reward=1.1), make_traj("p0", 1, reward=0.5), make_traj("p1", 0, reward=-1.0),
             make_traj("p1", 1, reward=1.0)]
    out = metrics.reward_metrics(trajs, {"p0": "gaia", "p1": "math"})
    assert out["reward/mean"] == pytest.approx(0.4)
    assert out["reward/accuracy"] == 0.5  # 1.1 (F1 = 1 plus the tool bonus) and 1.0 count; 0.5 does not
    assert out["reward/format_error_frac"] == 0.25
    assert out["reward/gaia/mean"] == pytest.approx(0.8) and out["reward/gaia/accuracy"] == 0.5
    assert out["reward/math/std"] == pytest.approx(math.sqrt(2.0))  # unbiased std of [-1, 1]


def test_validation_metrics_names():
    trajs = [make_traj("p0", 0, reward=1.0), make_traj("p1", 0, reward=0.0)]
    out = metrics.validation_metrics(trajs, {"p0": "a", "p1": "b"})
    assert out["val/reward"] == 0.5 and out["val/a/reward"] == 1.0 and out["val/b/accuracy"] == 0.0
    assert not any(k.endswith("/mean") or k.endswith("/std") for k in out)


def test_rollout_metrics_branches_and_entropy_after_tools():
    seg = lambda owner, i, h: Segment(owner=owner, index=i, start=0, num_tokens=1, entropy=h, finish="eos")  # noqa: E731
    root = make_traj("p0", 0, segments=[seg("p0/0", 0, 1.0), seg("p0/0", 1, 3.0)], response=4)
    # A branch copies its parent's first segment (not counted again) and generates its own after the result.
    child = make_traj("p0", 1, origin="branch", parent="p0/0", segments=[seg("p0/0", 0, 1.0), seg("p0/1", 0, 5.0)],
                      response=8, finish="length")
    result = RolloutResult(groups=[[root, child]], prompt_info=[{}],
                           stats={"branches": 1, "fills": 0, "generated_tokens": 12, "engine_prompt_tokens": 100,
                                  "engine_cached_tokens": 25})
    out = metrics.rollout_metrics(result, seconds=2.0)
    assert out["rollout/branches_per_prompt"] == 1.0
    assert out["rollout/entropy_first_segment"] == 1.0
    assert out["rollout/entropy_after_tool"] == pytest.approx(4.0)  # mean of 3.0 and the branch's own 5.0
    assert out["rollout/response_length"] == 6.0 and out["rollout/truncated_frac"] == 0.5
    assert out["rollout/generated_tokens_per_s"] == 6.0 and out["rollout/prefix_cache_hit_rate"] == 0.25


def test_tool_metrics_per_step_deltas():
    trajs = [make_traj("p0", 0, tool_calls=[call("search", "p0/0"), call("python", "p0/0", error="timeout")]),
             make_traj("p0", 1, tool_calls=[call("search", "p0/0")])]  # inherited from its parent
    before = {"search": {"calls": 5, "errors": 1, "timeouts": 0, "cache_hits": 2}, "python": {"calls": 1},
              "cache": {"hits": 2, "inflight_hits": 0, "misses": 4}}
    after = {"search": {"calls": 6, "errors": 1, "timeouts": 0, "cache_hits": 3}, "python": {"calls": 2, "errors": 1,
             "timeouts": 1}, "cache": {"hits": 3, "inflight_hits": 1, "misses": 6}}
    out = metrics.tool_metrics(trajs, {"tool_errors": 1, "call_limit_hits": 0}, before, after, ["python", "search"])
    assert out["tools/calls_per_traj"] == 1.5 and out["tools/search/calls_per_traj"] == 1.0
    assert out["tools/search/calls"] == 1 and out["tools/search/cache_hits"] == 1
    assert out["tools/python/timeouts"] == 1 and out["tools/errors"] == 1
    assert out["tools/cache_hit_rate"] == pytest.approx(0.5)  # 2 hits of 4 lookups this step


def test_token_statistics_mismatch_entropy_and_reference_kl():
    # Prompt of 3 tokens; response: 2 generated, 2 tool-result (mask 0), 2 generated; the last one is the
    # EOS appended at the call limit (engine log-prob 0.0 placeholder, excluded from the mismatch).
    t = make_traj("p0", 0, response=6, mask=[1, 1, 0, 0, 1, 1], logprobs=[-1.0, -2.0, 0.0, 0.0, -0.5, 0.0],
                  tool_calls=[call("python", "p0/0", result_offset=2, num_result_tokens=2)], call_limit_hit=True)
    old = [0.0, 0.0, 0.0, -1.1, -2.0, 9.0, 9.0, -0.5, -3.0]
    batch = {"old_logprobs": [old], "entropy": [[0.0] * 3 + [1.0, 2.0, 7.0, 7.0, 4.0, 6.0]],
             "ref_logprobs": [[x - 0.25 for x in old]]}
    out = metrics.token_statistics(batch, [t], entropy_window=1)
    assert out["rollout/logprob_abs_diff"] == pytest.approx((0.1 + 0.0 + 0.0) / 3)
    assert out["rollout/logprob_ratio_out_frac"] == 0.0   # exp(0.1): inside [0.8, 1.25]
    assert "rollout/routing_recorded_frac" not in out     # no routing replay
    assert out["actor/entropy"] == pytest.approx((1 + 2 + 4 + 6) / 4)
    assert out["actor/entropy_after_tool"] == 4.0  # the first generated token after the result block
    assert out["actor/ref_kl"] == pytest.approx(0.25)


def test_the_ratio_band_and_the_routing_coverage():
    t = make_traj("p0", 0, response=3, mask=[1, 1, 1], logprobs=[-1.0, -1.0, -1.0])
    # actor - engine = +0.3 (ratio 1.35, out), -0.3 (0.74, out), 0.2 (1.22, in); context of 3 + 3 tokens
    recorded, missing = [[0, 1]], [[-1, -1]]
    batch = {"old_logprobs": [[0.0, 0.0, 0.0, -0.7, -1.3, -0.8]],
             "routed_experts": [[recorded] * 4 + [missing] * 2]}   # 4 of the 5 rows the engine's forwards saw
    out = metrics.token_statistics(batch, [t], entropy_window=1)
    assert out["rollout/logprob_ratio_out_frac"] == pytest.approx(2 / 3)
    assert out["rollout/routing_recorded_frac"] == pytest.approx(4 / 5)
    # A trailing tool result (mask 0) and the EOS appended at the call limit were never in an engine forward.
    t = make_traj("p0", 0, response=5, mask=[1, 1, 0, 0, 1], logprobs=[-1.0, -1.0, 0.0, 0.0, 0.0], call_limit_hit=True)
    batch = {"old_logprobs": [[-1.0] * 8], "routed_experts": [[recorded] * 4 + [missing] * 4]}
    assert metrics.token_statistics(batch, [t], entropy_window=1)["rollout/routing_recorded_frac"] == 1.0


def test_the_unreplayed_pass_is_measured_on_the_same_tokens():
    # actor.moe_replay_diagnostics: the replayed pass is 0.05 from the engine on each token; the actor's own
    # routing is 0.3 off on the second token (ratio 1.35: out of the band), exact on the others
    t = make_traj("p0", 0, response=3, mask=[1, 1, 1], logprobs=[-1.0, -1.0, -1.0])
    batch = {"old_logprobs": [[0.0, 0.0, 0.0, -0.95, -1.05, -0.95]],
             "unreplayed_logprobs": [[0.0, 0.0, 0.0, -1.0, -0.7, -1.0]],
             "routed_experts": [[[[0, 1]]] * 6]}
    out = metrics.token_statistics(batch, [t], entropy_window=1)
    assert out["rollout/logprob_abs_diff"] == pytest.approx(0.05)
    assert out["rollout/logprob_abs_diff_unreplayed"] == pytest.approx(0.1)
    assert out["rollout/logprob_ratio_out_frac"] == 0.0
    assert out["rollout/logprob_ratio_out_frac_unreplayed"] == pytest.approx(1 / 3)
    del batch["unreplayed_logprobs"]
    assert "rollout/logprob_abs_diff_unreplayed" not in metrics.token_statistics(batch, [t], entropy_window=1)


def test_phase_timer_outside_model_share(monkeypatch):
    clock = iter([100.0, 100.0, 103.0, 103.0, 104.0, 104.0])  # start; rollout 3 s; sync 1 s; metrics()
    monkeypatch.setattr(metrics.time, "perf_counter", lambda: next(clock))
    timer = metrics.PhaseTimer()
    with timer("rollout"):
        pass
    with timer("sync"):
        pass
    out = timer.metrics()
    assert (out["time/rollout_s"], out["time/sync_s"], out["time/step_s"]) == (3.0, 1.0, 4.0)
    assert out["time/outside_model_frac"] == 0.25  # sync is outside model compute, rollout is not


def test_sync_metrics_rate():
    out = metrics.sync_metrics({"seconds": 2.0, "send_s": 1.5, "bytes": 2e9, "buckets": 3, "driver_bytes": 4096,
                                "driver_weight_bytes": 0, "verified_after_load": ["a", "b"]})
    assert out["sync/seconds"] == 2.0 and out["sync/gb_per_s"] == 1.0 and out["sync/verified"] == 2
    assert out["sync/send_s"] == 1.5 and out["sync/driver_weight_bytes"] == 0
