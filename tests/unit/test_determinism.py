"""``trainer.deterministic``: what it sets in the actor and the engines, and the configs it refuses.

The run-to-run promise itself (same seed, same metrics and weights) is tests/e2e/test_train_determinism.py,
whose second run has the flag on: on this CPU the deterministic path must give the same bits as the default.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from megatron_arpo import determinism
from megatron_arpo.actor import model_builder
from megatron_arpo.config import ConfigError, load_config
from megatron_arpo.model_config import load_model_config
from megatron_arpo.rollout.engine import EngineConfig
from megatron_arpo.rollout.engine_actor import engine_actor_options

DEMO = Path(__file__).resolve().parents[2] / "configs" / "demo.yaml"


def test_a_live_web_search_is_refused_with_the_reason():
    overrides = ["trainer.deterministic=true", "tools.search.backend=web"]
    with pytest.raises(ConfigError) as refused:
        load_config(DEMO, overrides)
    problems = [p for p in refused.value.errors if p.startswith("trainer.deterministic")]
    assert len(problems) == 1
    assert "live web search" in problems[0] and "backend local or http" in problems[0]
    # The same search without the flag, and the flag with the local search, are not refused for it.
    assert not determinism.deterministic_problems(load_config(DEMO, overrides[1:]))
    assert not determinism.deterministic_problems(load_config(DEMO, overrides[:1]))


def test_off_policy_weights_in_flight_are_refused_with_the_flag_and_the_default_producer_is_not():
    off = ["trainer.placement=separate", "trainer.actor_devices=1", "trainer.rollout_devices=1",
           "trainer.mode=off_policy", "rollout.max_staleness=1"]
    with pytest.raises(ConfigError) as refused:
        load_config(DEMO, ["trainer.deterministic=true", *off, "rollout.in_flight_updates=true"])
    [problem] = [p for p in refused.value.errors if p.startswith("trainer.deterministic")]
    assert "rollout.in_flight_updates: true" in problem and "rollout.in_flight_updates: false" in problem
    assert not determinism.deterministic_problems(load_config(DEMO, ["trainer.deterministic=true", *off]))
    assert not determinism.deterministic_problems(load_config(DEMO, [*off, "rollout.in_flight_updates=true"]))


def test_a_non_deterministic_nccl_algorithm_in_the_environment_is_refused(monkeypatch):
    cfg = load_config(DEMO, ["trainer.deterministic=true"])
    monkeypatch.setenv("NCCL_ALGO", "CollnetDirect")
    [problem] = determinism.deterministic_problems(cfg)
    assert "NCCL_ALGO=CollnetDirect" in problem and "NCCL_ALGO=Ring" in problem
    monkeypatch.setenv("NCCL_ALGO", "Tree")
    assert not determinism.deterministic_problems(cfg)
    assert determinism.actor_env(True, {"NCCL_ALGO": "Tree"})["NCCL_ALGO"] == "Tree"
    assert determinism.actor_env(True, {})["NCCL_ALGO"] == "Ring"
    assert determinism.actor_env(False, {}) == {}


def test_gpu_engines_get_the_batch_invariant_mode_only_with_the_flag():
    def env(on_gpu: bool, **kw) -> dict:
        return engine_actor_options(EngineConfig(model="m", **kw), on_gpu=on_gpu)[1]

    assert env(True, batch_invariant=True)["VLLM_BATCH_INVARIANT"] == "1"
    assert "VLLM_BATCH_INVARIANT" not in env(True)
    # vLLM's batch-invariant ops are Triton kernels: a CPU engine would fail its first forward with them.
    assert "VLLM_BATCH_INVARIANT" not in env(False, batch_invariant=True)


def test_megatron_gets_its_deterministic_mode():
    cfg = load_model_config("qwen3-0.6b")
    assert model_builder.build_transformer_config(cfg, use_te=False, deterministic=True).deterministic_mode
    assert not model_builder.build_transformer_config(cfg, use_te=False).deterministic_mode


def test_an_actor_process_turns_on_torch_deterministic_algorithms_and_its_environment():
    code = ("import os, torch; from megatron_arpo import determinism as d; d.apply_actor_settings(True); "
            "print(torch.are_deterministic_algorithms_enabled(), os.environ['CUBLAS_WORKSPACE_CONFIG'], "
            "os.environ['NVTE_ALLOW_NONDETERMINISTIC_ALGO'])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", ":4096:8", "0"]
    assert not torch.are_deterministic_algorithms_enabled()  # nothing leaked into this process
