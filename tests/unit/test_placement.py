"""The bundle plan of megatron_arpo.cluster.placement, computed from real experiment configs."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_arpo.cluster.placement import plan_placement
from megatron_arpo.config import ConfigError
from support.configs import tiny_config


def test_colocated_cpu_shares_bundles_between_ranks_and_engines():
    cfg = tiny_config(actor={"tensor_parallel": 2, "data_parallel": 2}, rollout={"num_engines": 1})
    plan = plan_placement(cfg)
    assert list(plan.pools) == ["shared"]
    pool = plan.pools["shared"]
    assert pool.size == 4 and all(b == {"CPU": 1.0} for b in pool.bundles) and pool.strategy == "PACK"
    assert plan.actor_bundles == (0, 1, 2, 3)
    assert plan.engine_bundles == ((0,),)
    assert plan.actor_pool == plan.rollout_pool == "shared"
    # Both roles fit into one bundle at once: that is what lets Ray co-schedule them.
    assert plan.actor_num_cpus + plan.engine_num_cpus <= pool.bundles[0]["CPU"]
    assert plan.actor_num_gpus == plan.engine_num_gpus == 0


def test_colocated_cpu_pool_grows_to_fit_more_engine_slots_than_ranks():
    cfg = tiny_config(rollout={"num_engines": 3})
    plan = plan_placement(cfg, strategy="SPREAD", cpus_per_bundle=2)
    assert plan.pools["shared"].size == 3 and plan.pools["shared"].strategy == "SPREAD"
    assert plan.actor_bundles == (0,)
    assert plan.engine_bundles == ((0,), (1,), (2,))
    assert plan.actor_num_cpus == 1.0 and plan.pools["shared"].bundles[0] == {"CPU": 2.0}


def test_colocated_gpu_one_bundle_per_gpu_with_time_slicing():
    cfg = tiny_config(model={"config": "qwen3-8b"}, launcher={"nodes": 2, "gpus_per_node": 4, "cpus_per_task": 32},
                 actor={"tensor_parallel": 2, "pipeline_parallel": 1},
                 rollout={"num_engines": 4, "tensor_parallel": 2, "response_length": 1024})
    plan = plan_placement(cfg)
    pool = plan.pools["shared"]
    assert pool.size == 8 and pool.bundles[0] == {"GPU": 1.0, "CPU": 8.0}
    assert plan.actor_bundles == tuple(range(8))  # DP derived from the devices: 8 / 2 = 4
    assert plan.engine_bundles == ((0, 1), (2, 3), (4, 5), (6, 7))
    assert plan.actor_num_gpus == plan.engine_num_gpus == 0.5
    assert plan.actor_num_gpus + plan.engine_num_gpus <= pool.bundles[0]["GPU"]


def test_separate_gpu_pools_are_disjoint_and_sized_from_the_config():
    cfg = tiny_config(model={"config": "qwen3-8b"}, launcher={"nodes": 2, "gpus_per_node": 8},
                 actor={"tensor_parallel": 4, "pipeline_parallel": 1},
                 rollout={"num_engines": 2, "tensor_parallel": 2, "response_length": 1024},
                 trainer={"placement": "separate", "actor_devices": 12, "rollout_devices": 4})
    plan = plan_placement(cfg)
    assert {name: p.size for name, p in plan.pools.items()} == {"actor": 12, "rollout": 4}
    assert plan.actor_pool == "actor" and plan.rollout_pool == "rollout"
    assert plan.actor_bundles == tuple(range(12))
    assert plan.engine_bundles == ((0, 1), (2, 3))
    assert plan.actor_num_gpus == plan.engine_num_gpus == 1.0
    assert plan.pools["actor"].bundles[0] == {"GPU": 1.0, "CPU": 1.0}
    assert "separate on GPU" in plan.describe()


def test_separate_cpu_pools_are_process_slots():
    cfg = tiny_config(actor={"tensor_parallel": 2}, rollout={"num_engines": 2},
                 trainer={"placement": "separate", "actor_devices": 2, "rollout_devices": 2})
    plan = plan_placement(cfg)
    assert {name: p.size for name, p in plan.pools.items()} == {"actor": 2, "rollout": 2}
    assert plan.engine_bundles == ((0,), (1,))
    assert plan.actor_num_cpus == plan.engine_num_cpus == 1.0


def test_pools_too_small_are_errors_naming_the_keys():
    # load-time validation rejects these too; a config changed after loading gets its layout (and so its
    # refusal) when the plan reads cfg.layout
    cfg = tiny_config(actor={"tensor_parallel": 2, "data_parallel": 1}, rollout={"num_engines": 2},
                 trainer={"placement": "separate", "actor_devices": 2, "rollout_devices": 2})
    more_engines = dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, num_engines=3))
    with pytest.raises(ConfigError, match=r"rollout.num_engines x rollout.tensor_parallel = 3 exceeds the 2 rollout "
                                          r"devices"):
        plan_placement(more_engines)
    small_actor = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, actor_devices=1))
    with pytest.raises(ConfigError, match=r"actor.tensor_parallel x actor.pipeline_parallel = 2 does not divide the 1 "
                                          r"actor devices"):
        plan_placement(small_actor)
    no_sizes = dataclasses.replace(cfg, launcher=dataclasses.replace(cfg.launcher, gpus_per_node=8),
                                   trainer=dataclasses.replace(cfg.trainer, rollout_devices=None))
    with pytest.raises(ConfigError, match="trainer.rollout_devices: required when trainer.placement is 'separate'"):
        plan_placement(no_sizes)


def test_bad_strategy_and_share_are_rejected():
    cfg = tiny_config()
    with pytest.raises(ValueError, match="strategy 'SPREADOUT'"):
        plan_placement(cfg, strategy="SPREADOUT")
    with pytest.raises(ValueError, match="colocate_share"):
        plan_placement(cfg, colocate_share=0)


def test_engine_actor_options_follow_the_plan():
    """What each engine actor is started with (resources, vLLM's executor env) comes from the plan."""
    from megatron_arpo.rollout.engine import EngineConfig
    from megatron_arpo.rollout.engine_actor import engine_actor_options

    cfg = tiny_config(model={"config": "qwen3-8b"}, launcher={"nodes": 2, "gpus_per_node": 4, "cpus_per_task": 32},
                 actor={"tensor_parallel": 2, "pipeline_parallel": 1},
                 rollout={"num_engines": 4, "tensor_parallel": 2, "response_length": 1024})
    plan = plan_placement(cfg)
    engine = EngineConfig(model="/ckpt", tensor_parallel_size=cfg.rollout.tensor_parallel)
    resources, env = engine_actor_options(engine, on_gpu=True, num_cpus=plan.engine_num_cpus,
                                          gpu_share=plan.engine_num_gpus, bundle_indices=plan.engine_bundles[2])
    # TP=2 colocated: the actor holds no GPU; vLLM's ray workers take half a GPU on bundles 4 and 5.
    assert resources == {"num_cpus": 4.0, "num_gpus": 0.0}
    assert env["VLLM_RAY_BUNDLE_INDICES"] == "4,5" and env["VLLM_RAY_PER_WORKER_GPUS"] == "0.5"
    one = EngineConfig(model="/ckpt", tensor_parallel_size=1)
    resources, env = engine_actor_options(one, on_gpu=True, num_cpus=4.0, gpu_share=0.5, bundle_indices=(3,))
    assert resources == {"num_cpus": 4.0, "num_gpus": 0.5} and "VLLM_RAY_BUNDLE_INDICES" not in env
    with pytest.raises(ValueError, match=r"tensor_parallel_size 2 needs as many placement-group bundles, got \[4\]"):
        engine_actor_options(engine, on_gpu=True, gpu_share=0.5, bundle_indices=(4,))
    # CPU: vLLM's mp executor runs both workers inside the actor's slot; no GPU, no bundle env.
    resources, env = engine_actor_options(engine, on_gpu=False, num_cpus=1.0, bundle_indices=(0, 1))
    assert resources == {"num_cpus": 1.0, "num_gpus": 0.0} and "VLLM_RAY_BUNDLE_INDICES" not in env


def test_an_engine_that_would_span_two_nodes_is_refused_with_the_numbers():
    cfg = tiny_config(model={"config": "qwen3-8b"}, launcher={"nodes": 2, "gpus_per_node": 6},
                 actor={"tensor_parallel": 2, "pipeline_parallel": 1},
                 rollout={"num_engines": 3, "tensor_parallel": 4, "response_length": 1024})
    with pytest.raises(ValueError, match=r"rollout.tensor_parallel = 4 GPUs per engine do not divide the 6 GPUs "
                                         r"of a node \(launcher.gpus_per_node\).*use a divisor of 6"):
        plan_placement(cfg)
