"""The parallel layout of megatron_arpo.parallel_layout, derived from real experiment configs, and its refusals."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_arpo.config import ConfigError
from megatron_arpo.model_config import load_model_config
from megatron_arpo.parallel_layout import ParallelLayout, derive_data_parallel, engine_tp_errors, model_layout_errors
from support.configs import tiny_config


def test_cpu_nodes_run_one_replica_unless_data_parallel_is_given():
    layout = tiny_config(actor={"tensor_parallel": 2}).layout
    assert (layout.tp, layout.pp, layout.dp, layout.world_size) == (2, 1, 1, 2)
    assert layout.total_devices is None and layout.engine_slots == 1
    assert tiny_config(actor={"tensor_parallel": 2, "data_parallel": 3}).layout.world_size == 6


def test_gpu_data_parallelism_fills_the_actor_devices():
    cfg = tiny_config(model={"config": "qwen3-8b"}, launcher={"nodes": 2, "gpus_per_node": 8},
                 actor={"tensor_parallel": 2, "pipeline_parallel": 2},
                 rollout={"num_engines": 4, "tensor_parallel": 4, "response_length": 1024})
    assert (cfg.layout.dp, cfg.layout.world_size, cfg.layout.total_devices, cfg.layout.engine_slots) == (4, 16, 16, 16)
    split = cfg.with_overrides(["trainer.placement=separate", "trainer.actor_devices=8",
                                "trainer.rollout_devices=8", "rollout.num_engines=2"])
    assert (split.layout.dp, split.layout.world_size, split.layout.placement) == (2, 8, "separate")
    assert cfg.layout is cfg.layout  # computed once per config


def test_an_actor_worker_takes_the_layout_over_its_actual_world():
    layout = tiny_config(actor={"tensor_parallel": 2}).layout
    assert layout.for_world(4) == dataclasses.replace(layout, dp=2)
    with pytest.raises(ValueError, match=r"world size 3 is not a multiple of actor.tensor_parallel x "
                                         r"actor.pipeline_parallel = 2"):
        layout.for_world(3)
    with pytest.raises(ValueError, match=r"actor.data_parallel is 1 but the world of 4 ranks gives 2 with tp=2, pp=1; "
                                         r"set it to 2 or null"):
        layout.for_world(4, data_parallel=1)


def test_sizes_that_do_not_fit_are_refused_naming_the_key_and_the_fix():
    with pytest.raises(ConfigError, match=r"actor.tensor_parallel x actor.pipeline_parallel = 3 does not divide the "
                                          r"8 actor devices; choose tp\*pp among the divisors of 8"):
        tiny_config(model={"config": "qwen3-8b"}, launcher={"gpus_per_node": 8},
               actor={"pipeline_parallel": 3, "tensor_parallel": 1})
    with pytest.raises(ConfigError, match=r"actor.data_parallel: 2 gives a world of 4 but there are 8 actor devices; "
                                          r"set it to 4 or null"):
        tiny_config(model={"config": "qwen3-8b"}, launcher={"gpus_per_node": 8},
               actor={"tensor_parallel": 2, "data_parallel": 2})
    with pytest.raises(ConfigError, match=r"trainer.actor_devices: required when trainer.placement is 'separate'"):
        tiny_config(trainer={"placement": "separate", "rollout_devices": 1})
    with pytest.raises(ConfigError, match=r"rollout.num_engines x rollout.tensor_parallel = 16 exceeds the 8 rollout "
                                          r"devices"):
        tiny_config(model={"config": "qwen3-8b"}, launcher={"gpus_per_node": 8},
               rollout={"num_engines": 4, "tensor_parallel": 4, "response_length": 1024})


def test_a_config_changed_after_it_was_built_is_checked_when_its_layout_is_read():
    cfg = tiny_config(actor={"tensor_parallel": 2})
    changed = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, placement="separate"))
    with pytest.raises(ConfigError, match=r"trainer.actor_devices: required"):
        changed.layout


def test_model_checks_name_the_values_that_work():
    model = load_model_config("qwq-32b")
    assert model_layout_errors(model, 8, 64) == []
    assert model_layout_errors(model, 3, 1) == ["actor.tensor_parallel: 3 does not divide qwq-32b num_attention_heads "
                                                "40; valid values: [1, 2, 4, 8]"]
    assert "plan.pipeline_parallel: 5 does not divide qwq-32b num_hidden_layers 64" in \
        model_layout_errors(model, 1, 5, section="plan")[0]
    assert engine_tp_errors(model, 5) == ["rollout.tensor_parallel: 5 does not divide qwq-32b num_key_value_heads 8; "
                                           "valid values: [1, 2, 4, 8]"]


def test_data_parallelism_is_derived_the_same_way_everywhere():
    assert derive_data_parallel(2, 2, 16) == 4
    assert derive_data_parallel(2, 2, None) == 1
    assert derive_data_parallel(2, 2, 16, data_parallel=2) == 2
    assert isinstance(tiny_config().layout, ParallelLayout)
