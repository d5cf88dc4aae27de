"""The off-policy loop parts (megatron_arpo/trainer/off_policy.py) on scripted engines and a stand-in actor:
the staleness bound decides which batches the engines generate during an update, versions and lags follow,
the buffer survives a checkpoint, a cancelled call gives its prompts back, a dead engine is replaced. The real
actor and engines run in tests/integration/test_off_policy_train.py."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from ray.exceptions import ActorDiedError

from megatron_arpo.config import build_config
from megatron_arpo.data.sampler import EpochSampler
from megatron_arpo.rollout.trajectory import NOT_SAMPLED
from megatron_arpo.trainer.metrics import PhaseTimer, metric_pattern
from megatron_arpo.trainer import steps
from megatron_arpo.trainer.off_policy import BUFFER_FILE, OffPolicyLoop, abandon_step
from megatron_arpo.trainer.signals import StepAborted
from megatron_arpo.trainer.state import PromptSet, Runtime
from scheduler_helpers import CODEC, RESULT, Counter, ScriptedStep, make_scheduler, table
from support.scripted import ScriptedEngine

BATCH = 2


def _script():
    counter = Counter()

    def script(context, request):
        g = counter.next()
        if context.count(RESULT) < 1:
            return ScriptedStep(CODEC.encode(f"<think>g{g}</think><search>q{g}</search>"), table((0.5, 0.5)))
        return ScriptedStep(CODEC.encode(f"<think>g{g}</think><answer>\\boxed{{{g}}}</answer><EOS>"), table((0.5, 0.5)))

    return script


class StandInActor:
    """Records each update's batch and the batches the engines had started when it began. With
    ``wait_for_call`` (``"update"`` or ``"logprob"``) that phase returns only once the engines started the
    next batch (it fails otherwise: the engines did not generate during it). Its log-probs are the
    batch's ``proximal`` rows."""

    def __init__(self, scheduler, wait_for_call):
        self.scheduler, self.wait_for_call = scheduler, wait_for_call
        self.updates: list[dict] = []
        self.started = threading.Event()
        self.proximal: list = []
        self.syncs: list = []
        self.kept_in_flight: list[bool] = []

    def _wait(self, phase):
        if self.wait_for_call == phase:
            assert self.started.wait(timeout=30), f"the engines generated nothing during the {phase}"

    def compute_log_probs(self, lp_batch, with_entropy=False):
        self._wait("logprob")
        return {"logprobs": self.proximal, "entropy": [[0.0] * len(row) for row in self.proximal],
                "padding_fraction": 0.0}

    def sync_weights(self, group, version, keep_in_flight=False, clear_cache=False):
        """What the weight sync does to the engines' labels (the weights of a scripted engine are its script)."""
        self.syncs.append((version, [e.target for e in group.engines]))
        assert clear_cache == keep_in_flight  # no KV of the old weights outlives an in-flight sync
        self.kept_in_flight.append(keep_in_flight)
        for handle in group.engines:
            handle.target.version = version
        return {"seconds": 1.0, "send_s": 1.0, "bytes": 0, "buckets": 0, "driver_bytes": 0, "driver_weight_bytes": 0}

    def update(self, batch):
        calls_before = self.scheduler._num_calls
        self._wait("update")
        self.updates.append({"batch": batch, "calls_before": calls_before})
        return {"loss": 0.0}


def make_runtime(tmp_path: Path, max_staleness: int, total_steps: int = 3, wait_for_call=None,
                 engine_latency: float = 0.0, num_engines: int = 1, max_engine_restarts: int = 3,
                 in_flight_updates: bool = False):
    cfg = build_config({"model": {"config": "tiny-qwen3"}, "rollout": {"response_length": 512, "n": 2,
                                                                       "initial_rollouts": 2,
                                                                       "max_staleness": max_staleness,
                                                                       "max_engine_restarts": max_engine_restarts,
                                                                       "in_flight_updates": in_flight_updates},
                        "data": {"max_prompt_tokens": 256}, "tools": {"search": {"enabled": False}},
                        "launcher": {"gpus_per_node": 0}, "actor": {"mini_batch_size": BATCH},
                        "trainer": {"placement": "separate", "actor_devices": 1, "rollout_devices": 1,
                                    "mode": "off_policy", "train_batch_size": BATCH}})
    sched, _ = make_scheduler(_script(), n=2, initial_rollouts=2, beam_size=1, call_limit=2, response_length=200,
                              engine_latency=engine_latency, num_engines=num_engines)
    rt = Runtime(cfg=cfg, run_dir=tmp_path)
    rt.scheduler, rt.group, rt.total_steps = sched, sched.group, total_steps
    records = [SimpleNamespace(uid=f"u{i}") for i in range(12)]
    rt.train = PromptSet(records, [CODEC.encode(f"Q{i}") for i in range(12)])
    rt.sampler = EpochSampler(12, BATCH, seed=0, shuffle=False)
    rt.actor = StandInActor(sched, wait_for_call)
    original = sched.run

    async def run(prompts, call_key=None, options=None):
        rt.actor.started.set()
        return await original(prompts, call_key=call_key, options=options)

    sched.run = run
    rt.off_policy = OffPolicyLoop(rt)
    return rt


def one_step(rt, step: int, stop_requested=lambda: False) -> dict:
    """What train.py does with a step in off-policy mode (scores and advantages left out)."""
    offp = rt.off_policy
    prompts, indices, result = offp.take_batch(step)
    trajs = result.trajectories()
    batch = {"input_ids": [], "group_ids": [], "loss_mask": [[0] * len(t.prompt_token_ids) + t.loss_mask for t in trajs]}
    rt.actor.proximal = [[0.0] * len(t.prompt_token_ids) + [v - 0.25 for v in t.response_logprobs] for t in trajs]
    rt.actor.started.clear()
    _, weights, _ = offp.train_while_generating(batch, trajs, PhaseTimer(), stop_requested)
    assert batch["old_logprobs"] is rt.actor.proximal
    rt.group.set_version(rt.policy_version)  # the weight sync: the handles and the engines' own labels
    for handle in rt.group.engines:
        handle.target.version = rt.policy_version
    row = offp.metrics(trajs, weights)
    assert [k for k in row if metric_pattern(k) is None] == []  # every key explained in docs/metrics.md
    return {"prompts": [p.prompt_id for p in prompts], "indices": indices, "trajs": trajs, "batch": batch, "row": row}


def test_max_staleness_0_generates_each_batch_after_the_previous_sync(tmp_path):
    rt = make_runtime(tmp_path, max_staleness=0)
    out = [one_step(rt, s) for s in (1, 2, 3)]
    # no call ran during any update: update s began after exactly s calls (train-1 .. train-s)
    assert [u["calls_before"] for u in rt.actor.updates] == [1, 2, 3]
    for s, o in enumerate(out, 1):
        assert {t.oldest_version() for t in o["trajs"]} == {s - 1}
        assert "behav_weights" not in o["batch"]  # sync's batch
        assert o["row"]["offpolicy/staleness/0"] == BATCH and o["row"]["offpolicy/token_share/0"] == 1.0
        assert [t.prompt_index for t in o["trajs"]] == [0, 0, 1, 1]
    assert [o["indices"] for o in out] == [[0, 1], [2, 3], [4, 5]]  # the sampler's order, as in sync mode


def test_max_staleness_1_generates_the_next_batch_during_the_update(tmp_path):
    rt = make_runtime(tmp_path, max_staleness=1, total_steps=3, wait_for_call="update")
    out = [one_step(rt, 1), one_step(rt, 2)]
    # each update returned only after the engines started the next batch (StandInActor.wait_for_call)
    assert len(rt.actor.updates) == 2
    assert len(rt.off_policy.buffer) == BATCH and rt.off_policy.next_batch == 4
    assert {t.oldest_version() for t in out[0]["trajs"]} == {0}
    assert {t.oldest_version() for t in out[1]["trajs"]} == {0}  # generated on version 0, trained at version 1
    lagged = out[1]
    assert "behav_weights" in lagged["batch"]  # behaviour 0.25 above proximal: w = exp(-0.25) on lag-1 tokens
    for t, w, m in zip(lagged["trajs"], lagged["batch"]["behav_weights"], lagged["batch"]["loss_mask"]):
        p = len(t.prompt_token_ids)
        for j, v in enumerate(t.token_versions):
            expected = pytest.approx(0.7788, abs=1e-4) if v != NOT_SAMPLED else 1.0
            assert w[p + j] == expected
    assert lagged["row"]["offpolicy/staleness/1"] == BATCH and lagged["row"]["offpolicy/token_share/1"] == 1.0
    assert lagged["row"]["offpolicy/is_weight_mean"] == pytest.approx(0.7788, abs=1e-4)
    # the last step generates nothing beyond the run (batch 4 would be step 4 of 3)
    rt.actor.wait_for_call = None
    one_step(rt, 3)
    assert rt.off_policy.next_batch == 4 and len(rt.off_policy.buffer) == 0


def test_the_engines_generate_during_the_log_probs_too(tmp_path):
    # the log-prob pass is part of the actor's step: the next batch starts while it runs, not after it
    rt = make_runtime(tmp_path, max_staleness=1, total_steps=3, wait_for_call="logprob")
    one_step(rt, 1)
    assert rt.off_policy.next_batch == 3 and len(rt.off_policy.buffer) == BATCH


def test_a_stop_before_the_update_abandons_the_step_and_keeps_its_batch(tmp_path):
    # the stop arrives once the engines started batch 2 (the log-prob pass waits for that): batch 2 finishes
    rt = make_runtime(tmp_path, max_staleness=1, total_steps=3, wait_for_call="logprob")
    with pytest.raises(StepAborted, match="before its update"):
        one_step(rt, 1, stop_requested=rt.actor.started.is_set)
    assert rt.actor.updates == [] and rt.policy_version == 0
    taken = [g.prompt_id for g in rt.off_policy.taken]
    taken_tokens = rt.off_policy.taken_stats["generated_tokens"]
    next_tokens = rt.off_policy.stats["generated_tokens"]  # batch 2, generated before the stop was served
    assert taken_tokens > 0 and next_tokens > 0
    abandon_step(rt, rt.sampler.state_dict())
    assert len(rt.off_policy.buffer) == 2 * BATCH  # batch 1 back in front of batch 2
    # through a checkpoint, as a stop saves it
    state = json.loads(json.dumps(rt.off_policy.state()))
    rt.off_policy.save(tmp_path)
    resumed = make_runtime(tmp_path / "r", max_staleness=1, total_steps=3)
    resumed.off_policy.restore(tmp_path, state)
    prompts, _, result = resumed.off_policy.take_batch(1)
    assert [p.prompt_id for p in prompts] == taken  # the resumed step trains the same batch
    # each row counts what it would have without the stop: step 1 batch 1's call, step 2 batch 2's
    assert result.stats["generated_tokens"] == taken_tokens
    assert resumed.off_policy.stats["generated_tokens"] == next_tokens  # for the next step's row


def test_a_stop_that_cancels_the_wait_for_a_batch_puts_back_nothing_already_trained(tmp_path):
    rt = make_runtime(tmp_path, max_staleness=0)
    first = one_step(rt, 1)  # max_staleness 0: the buffer is empty after it, step 2 waits for its batch
    rt.group.engines[0].target.latency_s = 3600.0  # the call never finishes by itself
    before = rt.sampler.state_dict()
    with pytest.raises(StepAborted):
        rt.off_policy.take_batch(2, cancel_when=lambda: True)
    abandon_step(rt, before)
    # step 1's batch was trained: the checkpoint the stop saves next must not hold it again
    assert len(rt.off_policy.buffer) == 0, [g.prompt_id for g in rt.off_policy.buffer.groups]
    assert rt.off_policy.buffer.counters["dropped_in_flight"] == BATCH
    assert rt.sampler.state_dict() == before and first["indices"] == [0, 1]


def test_a_checkpoint_restores_the_buffer_and_the_next_batch(tmp_path):
    rt = make_runtime(tmp_path, max_staleness=1, total_steps=4)
    one_step(rt, 1)
    ckpt = tmp_path / "step-1"
    ckpt.mkdir()
    rt.off_policy.save(ckpt)
    state = rt.off_policy.state()
    assert (ckpt / BUFFER_FILE).exists() and state["next_batch"] == 3
    assert state["stats"]["generated_tokens"] > 0  # batch 2's call, reported by step 2's row
    state = json.loads(json.dumps(state))  # as state.json holds it
    rt.step = 1
    resumed = make_runtime(tmp_path / "r", max_staleness=1, total_steps=4)
    resumed.step, resumed.policy_version = 1, 1
    resumed.group.set_version(1)
    for handle in resumed.group.engines:
        handle.target.version = 1
    resumed.off_policy.restore(ckpt, state)
    assert [g.to_dict() for g in resumed.off_policy.buffer.groups] == [g.to_dict() for g in rt.off_policy.buffer.groups]
    prompts_a, _, result_a = rt.off_policy.take_batch(2)
    prompts_b, _, result_b = resumed.off_policy.take_batch(2)
    assert [p.prompt_id for p in prompts_a] == [p.prompt_id for p in prompts_b]
    assert result_b.stats == result_a.stats


def test_a_cancelled_call_counts_its_groups_and_gives_its_prompts_back(tmp_path):
    rt = make_runtime(tmp_path, max_staleness=0, engine_latency=3600.0)  # the call never finishes by itself
    before = rt.sampler.state_dict()
    with pytest.raises(StepAborted):
        rt.off_policy.take_batch(1, cancel_when=lambda: True)
    assert rt.sampler.state_dict() == before and rt.off_policy.buffer.counters["dropped_in_flight"] == BATCH
    assert rt.off_policy.buffer.in_flight == 0 and rt.off_policy.next_batch == 1


def test_engines_labelling_tokens_with_another_version_stop_the_step_instead_of_regenerating_forever(tmp_path):
    rt = make_runtime(tmp_path, max_staleness=0)
    rt.policy_version = 2
    rt.group.set_version(2)  # the handles say 2, the engines' own labels stay 0: every group is stale
    with pytest.raises(RuntimeError, match="label their tokens with another version"):
        rt.off_policy.take_batch(1)
    assert rt.off_policy.buffer.counters["dropped_stale"] > 0


def test_actor_idle_counts_the_wait_for_the_call_still_running_after_the_update(tmp_path):
    rt = make_runtime(tmp_path, max_staleness=1, total_steps=3, wait_for_call="update", engine_latency=0.05)
    one_step(rt, 1)
    ends = {}
    update, run = rt.actor.update, rt.scheduler.run

    def timed_update(batch):  # returns as soon as the next batch has started: the actor then waits for it
        out = update(batch)
        ends["update"] = time.perf_counter()
        return out

    async def timed_run(*args, **kwargs):
        out = await run(*args, **kwargs)
        ends["call"] = time.perf_counter()
        return out

    rt.actor.update, rt.scheduler.run = timed_update, timed_run
    rt.off_policy.waited_s = 0.0
    one_step(rt, 2)
    waited_after_update = ends["call"] - ends["update"]
    assert waited_after_update > 0.05  # the call outlived the update (its requests take 0.05 s each)
    # the same interval, give or take the few statements between the two clocks (none before the fix)
    assert rt.off_policy.waited_s >= 0.5 * waited_after_update


class DyingEngine:
    """A scripted engine whose actor dies at its first request of call ``dies_in``: that request and every
    later call (``health`` included) raise ray's ActorDiedError, as a Ray actor handle of a dead actor does."""

    def __init__(self, engine: ScriptedEngine, dies_in: str):
        self.engine, self.dies_in, self.dead = engine, dies_in, False

    async def generate(self, request):
        if request.request_id.startswith(f"{self.dies_in}:"):
            self.dead = True
        if self.dead:
            raise ActorDiedError()
        return await self.engine.generate(request)

    async def health(self):
        if self.dead:
            raise ActorDiedError()
        return await self.engine.health()

    def __getattr__(self, name):
        return getattr(self.engine, name)


def with_dying_engine(rt, dies_in: str):
    """Engine 1 of ``rt`` dies in call ``dies_in``; returns the list of restarted indices (the stand-in for
    trainer.runtime.restart_engine: a fresh scripted engine in its place, holding no version yet)."""
    handle = rt.group.engines[1]
    handle.target = DyingEngine(handle.target, dies_in)
    restarted = []

    def restart(index):
        restarted.append(index)
        old = rt.group.engines[index].target.engine
        rt.group.replace(index, ScriptedEngine(old.script, engine_index=index), version=0)

    rt.off_policy.restart_engine = restart
    return restarted


def test_an_engine_dying_while_the_actor_waits_loses_its_call_only_and_is_replaced_at_once(tmp_path, caplog):
    rt = make_runtime(tmp_path, max_staleness=0, num_engines=2)
    restarted = with_dying_engine(rt, "train-1")
    out = one_step(rt, 1)
    offp = rt.off_policy
    assert restarted == [1] and offp.restarts == 1  # the dead engine, once; engine 0 answered its probe
    assert offp.buffer.counters["dropped_in_flight"] == BATCH and offp.buffer.in_flight == 0
    assert out["indices"] == [0, 1]  # the lost call's prompts, drawn again by the call that succeeded
    assert len(rt.actor.updates) == 1 and len(out["trajs"]) == 2 * BATCH  # the step got its batch
    assert rt.actor.syncs[0][0] == 0 and rt.group.engines[1].target in rt.actor.syncs[0][1]  # synced at once
    assert {t.oldest_version() for t in out["trajs"]} == {0}
    assert out["row"]["offpolicy/engine_restarts_total"] == 1.0
    assert out["row"]["offpolicy/dropped_in_flight_total"] == BATCH
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("died during batch 1" in w and f"{BATCH} in-flight groups" in w and "restarting" in w
               for w in warnings), warnings
    assert any("restarting vLLM engine 1" in w for w in warnings), warnings


def test_an_engine_dying_during_the_update_is_replaced_after_it(tmp_path):
    rt = make_runtime(tmp_path, max_staleness=1, total_steps=3, num_engines=2, wait_for_call="update")
    restarted = with_dying_engine(rt, "train-2")  # the batch the engines generate during update 1
    one_step(rt, 1)
    offp = rt.off_policy
    assert len(rt.actor.updates) == 1 and rt.policy_version == 1  # the update finished
    assert restarted == [] and offp.dead is not None  # not replaced while the actor was inside its update
    assert offp.buffer.counters["dropped_in_flight"] == BATCH and offp.next_batch == 2
    offp.check_engines()  # train.py, before the step's sync
    assert restarted == [1] and offp.dead is None and rt.actor.syncs == []  # the step's sync follows
    steps.sync_weights(rt)  # the step's sync (train.py: phases.switch_phase(rt, "rollout"))
    rt.actor.wait_for_call = None
    out = one_step(rt, 2)
    assert out["indices"] == [2, 3]  # batch 2's prompts, regenerated
    assert {t.oldest_version() for t in out["trajs"]} == {1}
    assert out["row"]["offpolicy/engine_restarts_total"] == 1.0


def test_engine_deaths_beyond_max_engine_restarts_stop_the_run_naming_the_key(tmp_path):
    rt = make_runtime(tmp_path, max_staleness=0, num_engines=2, max_engine_restarts=0)
    restarted = with_dying_engine(rt, "train-1")
    with pytest.raises(RuntimeError, match=r"vLLM engine 1 died .*rollout.max_engine_restarts=0 allows no more"):
        rt.off_policy.take_batch(1)
    assert restarted == [] and rt.off_policy.buffer.counters["dropped_in_flight"] == BATCH


def test_an_engine_that_died_between_calls_is_found_by_its_health_probe_before_the_sync(tmp_path):
    rt = make_runtime(tmp_path, max_staleness=0, num_engines=2)
    restarted = with_dying_engine(rt, "never")
    one_step(rt, 1)
    rt.off_policy.check_engines()  # every engine answers: nothing to do
    assert restarted == []
    rt.group.engines[1].target.dead = True  # killed while no call ran (no call saw it)
    rt.off_policy.check_engines()
    assert restarted == [1] and rt.off_policy.restarts == 1


# ---------------------------------------------------------------- rollout.in_flight_updates
def in_flight_step(rt, step: int) -> dict:
    """One off-policy step with the real sync call (steps.sync_weights), as train.py runs it."""
    offp = rt.off_policy
    prompts, indices, result = offp.take_batch(step)
    trajs = result.trajectories()
    batch = {"input_ids": [], "group_ids": [], "loss_mask": [[0] * len(t.prompt_token_ids) + t.loss_mask for t in trajs]}
    rt.actor.proximal = [[0.0] * len(t.prompt_token_ids) + list(t.response_logprobs) for t in trajs]
    rt.actor.started.clear()
    _, weights, _ = offp.train_while_generating(batch, trajs, PhaseTimer(), lambda: False)
    running_at_sync = offp.running()
    offp.check_engines()
    steps.sync_weights(rt)
    return {"indices": indices, "trajs": trajs, "row": offp.metrics(trajs, weights), "running_at_sync": running_at_sync}


def count_concurrent_calls(rt) -> dict:
    seen = {"now": 0, "most": 0}
    run = rt.scheduler.run

    async def counted(*args, **kwargs):
        seen["now"] += 1
        seen["most"] = max(seen["most"], seen["now"])
        try:
            return await run(*args, **kwargs)
        finally:
            seen["now"] -= 1

    rt.scheduler.run = counted
    return seen


def slow_after_batch_1(request) -> float:
    """Requests of batch 1 take 0.05 s, later ones 0.5 s: batch 2 (started with batch 1) runs through step 1's sync."""
    return 0.05 if request.request_id.startswith("train-1:") else 0.5


def test_in_flight_updates_sync_while_a_call_runs_and_run_calls_side_by_side(tmp_path):
    rt = make_runtime(tmp_path, max_staleness=1, total_steps=4, engine_latency=slow_after_batch_1,
                      in_flight_updates=True)
    seen = count_concurrent_calls(rt)
    out = [in_flight_step(rt, s) for s in (1, 2, 3, 4)]
    # batches 1 and 2 start together (both within the bound at version 0); never more than max_staleness + 1
    assert seen["most"] == 2
    # step 1's sync ran with batch 2 generating (the engines pause with its requests), the last one with none;
    # every sync of the mode pauses the engines rather than needing them idle
    assert out[0]["running_at_sync"] == 1 and out[-1]["running_at_sync"] == 0
    assert rt.actor.kept_in_flight == [True] * 4
    # batch 2: its first requests sampled by version 0, the second ones (0.5 s later) by version 1
    assert {v for t in out[1]["trajs"] for v in t.token_versions if v != NOT_SAMPLED} == {0, 1}
    assert out[1]["row"]["offpolicy/staleness/1"] == BATCH and 0.0 < out[1]["row"]["offpolicy/token_share/1"] < 1.0
    for s, o in enumerate(out[1:], 2):  # batch s: started on version s - 2 or later, trained at s - 1
        assert {v for t in o["trajs"] for v in t.token_versions if v != NOT_SAMPLED} <= {s - 2, s - 1}
    assert [o["indices"] for o in out] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # the sampler's order
    offp = rt.off_policy
    assert offp.buffer.counters["dropped_stale"] == 0 and offp.buffer.counters["dropped_in_flight"] == 0
    assert offp.next_batch == 5 and offp.calls == {} and len(offp.buffer) == 0  # nothing beyond the run


def test_in_flight_calls_finish_before_a_checkpoint_and_are_cancelled_by_a_stop(tmp_path):
    rt = make_runtime(tmp_path, max_staleness=1, total_steps=4, engine_latency=slow_after_batch_1,
                      in_flight_updates=True)
    in_flight_step(rt, 1)
    assert rt.off_policy.running() == 1
    rt.off_policy.settle(cancel=False)  # a periodic checkpoint: batch 2 finishes into the buffer
    assert rt.off_policy.calls == {} and len(rt.off_policy.buffer) == BATCH and rt.off_policy.next_batch == 3
    in_flight_step(rt, 2)  # batch 3 runs on
    before = rt.sampler.state_dict()
    assert rt.off_policy.running() == 1 and rt.off_policy.next_batch == 4
    rt.off_policy.settle(cancel=True)  # a stop request: batch 3 is lost, its prompts drawn again after the resume
    offp = rt.off_policy
    assert offp.calls == {} and offp.next_batch == 3 and offp.buffer.in_flight == 0
    assert offp.buffer.counters["dropped_in_flight"] == BATCH
    assert rt.sampler.state_dict() != before and rt.sampler.next_batch() == [4, 5]  # batch 3's prompts again
    assert offp.state()["next_batch"] == 3


def test_in_flight_updates_need_off_policy_and_a_staleness_bound():
    base = {"model": {"config": "tiny-qwen3"}, "launcher": {"gpus_per_node": 0},
            "trainer": {"placement": "separate", "actor_devices": 1, "rollout_devices": 1, "mode": "off_policy"}}
    with pytest.raises(Exception, match=r"rollout.in_flight_updates: true needs .*max_staleness: 1 or more"):
        build_config({**base, "rollout": {"in_flight_updates": True, "max_staleness": 0}})
    sync = {**base, "trainer": {**base["trainer"], "mode": "sync"}}
    with pytest.raises(Exception, match=r"got mode sync"):
        build_config({**sync, "rollout": {"in_flight_updates": True}})


def test_an_engine_dying_with_calls_side_by_side_loses_those_calls_and_keeps_the_data_order(tmp_path, caplog):
    rt = make_runtime(tmp_path, max_staleness=1, total_steps=4, num_engines=2, engine_latency=0.05,
                      in_flight_updates=True)
    restarted = with_dying_engine(rt, "train-2")  # started with batch 1 at step 1; its engine serves both
    out = [in_flight_step(rt, s) for s in (1, 2, 3, 4)]
    offp = rt.off_policy
    assert restarted == [1] and offp.restarts == 1  # once, although both calls may have seen the death
    lost = offp.buffer.counters["dropped_in_flight"]
    # batch 2; when batch 1 also had requests on engine 1, its death (seen later) drops it and every call
    # started after it, the regenerated batch 2 included: they drew their prompts after batch 1's
    assert lost >= BATCH and lost % BATCH == 0 and offp.buffer.in_flight == 0
    assert [o["indices"] for o in out] == [[0, 1], [2, 3], [4, 5], [6, 7]]  # lost prompts drawn again, in order
    for s, o in enumerate(out, 1):
        assert all(s - 1 - t.oldest_version() <= 1 for t in o["trajs"])  # within the bound after the restart
    assert out[-1]["row"]["offpolicy/engine_restarts_total"] == 1.0
    assert offp.calls == {} and offp.next_batch == 5


def test_an_engine_dying_inside_the_weight_sync_is_replaced_and_the_sync_runs_again(tmp_path, caplog):
    from megatron_arpo.trainer.state import PhaseState
    from megatron_arpo.weight_sync.protocol import WeightSyncError

    rt = make_runtime(tmp_path, max_staleness=1, total_steps=3, num_engines=2, in_flight_updates=True)
    rt.phases = PhaseState(sleep_level=None, offload=False)
    restarted = with_dying_engine(rt, "never")
    sync = rt.actor.sync_weights

    def dies_inside(group, version, **kwargs):  # engine 1 dies after the sync began: the sync fails
        if len(rt.actor.syncs) == 0 and not restarted:
            group.engines[1].target.dead = True
            raise WeightSyncError("weight sync: engine 1 failed in finish_weight_update: ActorDiedError")
        return sync(group, version, **kwargs)

    rt.actor.sync_weights = dies_inside
    one = rt.off_policy.take_batch(1)
    rt.policy_version = 1
    rt.phases.weights_stale = True
    row = rt.off_policy.switch_to_rollout()
    assert restarted == [1] and rt.off_policy.restarts == 1
    assert [v for v, _ in rt.actor.syncs] == [1] and row["sync/seconds"] == 1.0  # the sync again, into both
    assert rt.group.engines[1].target in rt.actor.syncs[0][1] and not rt.phases.weights_stale
    assert {e.version for e in rt.group.engines} == {1}
    assert any("died during the weight sync to version 1" in r.getMessage() for r in caplog.records)
    assert one[1] == [0, 1]

    # a sync that fails with every engine alive (a transport or checksum failure) is not retried
    rt.actor.sync_weights = lambda group, version, **kw: (_ for _ in ()).throw(WeightSyncError("checksum mismatch"))
    rt.phases.weights_stale = True
    with pytest.raises(WeightSyncError, match="checksum mismatch"):
        rt.off_policy.switch_to_rollout()
    assert rt.off_policy.restarts == 1


def test_work_between_the_batch_and_the_update_keeps_the_running_calls_going(tmp_path):
    # reward and advantages (train.py), the sync: with calls in flight they run in a worker thread while the
    # event loop serves those calls; with none, in the caller's thread as in sync mode
    rt = make_runtime(tmp_path, max_staleness=1, total_steps=4, engine_latency=slow_after_batch_1,
                      in_flight_updates=True)
    offp = rt.off_policy
    offp.take_batch(1)  # batch 2 started with batch 1 and runs on (its requests take 0.5 s)
    assert offp.running() == 1
    threads = []

    def work():
        threads.append(threading.current_thread())
        time.sleep(3.0)  # batch 2's requests (two rounds of 0.5 s) finish meanwhile
        return "scored"

    assert offp.background(work) == "scored"
    assert threads[0] is not threading.main_thread() and offp.running() == 0
    assert offp.background(lambda: threading.current_thread()) is threading.main_thread()
