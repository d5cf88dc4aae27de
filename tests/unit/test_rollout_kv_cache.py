"""The start-up KV-cache check (megatron_arpo.rollout.kv_cache) on an engine's numbers, and the fixed-size
setting (rollout.kv_cache_gib) reaching the engine. A real engine's numbers: tests/integration/test_trainer_phases.py."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_arpo.config import build_config
from megatron_arpo.errors import InputError
from megatron_arpo.rollout.engine import EngineConfig
from megatron_arpo.rollout.kv_cache import PLANNED_CONCURRENCY, KvCacheTooSmall, check_kv_caches

QWQ_TP4_TOKEN = 2 * 64 * 2 * 128 * 2  # K and V x 64 layers x 2 of 8 KV heads x head_dim 128 x bf16


def info(tokens: int, index: int = 0, block_size: int = 16, max_model_len: int = 10192) -> dict:
    blocks = tokens // block_size
    return {"engine_index": index, "blocks": blocks, "block_size": block_size, "tokens": blocks * block_size,
            "bytes_per_token": QWQ_TP4_TOKEN, "bytes": blocks * block_size * QWQ_TP4_TOKEN,
            "max_model_len": max_model_len}


def experiment(**rollout_keys):
    return build_config({"model": {"config": "tiny-qwen3"}, "tools": {"search": {"enabled": False}},
                         "data": {"max_prompt_tokens": 64}, "rollout": {"response_length": 64, **rollout_keys}})


def rollout(**kw):
    return dataclasses.replace(experiment().rollout, **kw)


def test_the_planned_cache_passes_and_each_engine_is_logged():
    lines = check_kv_caches([info(32 * 10192), info(40 * 10192, index=1)], rollout(max_num_seqs=32), on_gpu=True)
    assert lines[0] == ("engine 0: KV cache 19.91 GiB per worker (326,144 tokens in 20,384 blocks of 16); the plan "
                        "needs 19.91 GiB (32 sequences x 10192 tokens = 326,144)")
    assert lines[1].startswith("engine 1: KV cache 24.88 GiB per worker")


def test_a_cache_the_actor_ate_into_is_refused_with_the_numbers_and_the_fix():
    # The defect's numbers: 19.9 GiB planned, 4.2 left once a colocated actor allocated during vLLM's profile.
    with pytest.raises(KvCacheTooSmall) as err:
        check_kv_caches([info(32 * 10192), info(68_800, index=1)], rollout(max_num_seqs=32), on_gpu=True)
    assert str(err.value) == (
        "vLLM engine 1 got a KV cache of 4.20 GiB per worker (68,800 tokens), smaller than the plan's 19.91 GiB "
        "(32 sequences x max_model_len 10192 = 326,144 tokens); raise rollout.gpu_memory_utilization or set "
        "rollout.kv_cache_gib (megatron-arpo plan shows the need), lower rollout.max_num_seqs or max_model_len, "
        "or enable rollout.enable_sleep_mode")
    assert isinstance(err.value, InputError)  # one line, exit 2, no traceback


def test_without_max_num_seqs_the_plan_assumes_the_planners_concurrency():
    from launchers.planner import PlanInput

    assert PLANNED_CONCURRENCY == PlanInput.concurrency
    with pytest.raises(KvCacheTooSmall, match=r"\(64 sequences \(rollout.max_num_seqs unset: the plan's 64\) x "
                                              r"max_model_len 256 = 16,384 tokens\); raise rollout.cpu_kv_cache_gib"):
        check_kv_caches([info(16_000, max_model_len=256)], rollout(), on_gpu=False)
    check_kv_caches([info(16_384, max_model_len=256)], rollout(), on_gpu=False)


def test_a_fixed_kv_cache_size_reaches_the_engine_config():
    cfg = experiment(kv_cache_gib=19.9)
    assert EngineConfig.from_rollout_section("m", cfg.rollout).kv_cache_gib == 19.9
    assert EngineConfig.from_rollout_section("m", rollout()).kv_cache_gib is None
