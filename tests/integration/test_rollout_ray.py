"""`VllmEngine` as a Ray async actor: the scheduler drives it through a RolloutGroup, and weights arrive
through vLLM's weight-transfer API (our gloo receiver in the engine, the sender in this process).

A private single-node Ray (2 CPUs) from tests/integration/ray_cluster.py; one engine actor for the module.
"""

from __future__ import annotations

import asyncio
import json
import math
from pathlib import Path

import pytest
import torch

from megatron_arpo.rollout.engine import EngineConfig, SegmentRequest
from megatron_arpo.rollout.engine_actor import create_engine_actor
from megatron_arpo.rollout.group import RolloutGroup
from megatron_arpo.rollout.protocol import TagProtocol
from megatron_arpo.rollout.scheduler import RolloutOptions, RolloutPrompt, RolloutScheduler
from megatron_arpo.weight_sync.senders.local import LocalSync
from megatron_arpo.tiny.checkpoint import tiny_checkpoint
from megatron_arpo.tools.registry import build_tools

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt():
    return tiny_checkpoint("tiny-qwen3")


@pytest.fixture(scope="module")
def actor(ray_single_node, ckpt):  # noqa: F811
    import ray

    cfg = EngineConfig(model=str(ckpt), dtype="float32", max_model_len=1024, block_size=32, seed=0,
                       enforce_eager=True, cpu_omp_threads_bind="nobind", weight_transfer="gloo")
    handle = create_engine_actor(cfg, num_cpus=1, env={"PYTHONPATH": str(REPO)})
    health = ray.get(handle.health.remote(), timeout=600)
    assert health["ok"] and health["max_model_len"] == 1024
    yield handle
    ray.kill(handle)


def test_scheduler_and_weight_sync_through_a_ray_actor(actor, ckpt, tmp_path):
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "0", "contents": "Ottawa is the capital of Canada."}) + "\n")
    tools = build_tools({"search": {"corpus": str(corpus)}})
    allowed = tokenizer.encode("x y", add_special_tokens=False) + tokenizer.convert_tokens_to_ids(
        ["<search>", "</search>", "<|im_end|>"])
    opts = RolloutOptions(n=4, initial_rollouts=2, beam_size=2, branch_threshold=1.0, call_limit=2,
                          response_length=64, seed=1, allowed_token_ids=tuple(allowed))
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of Canada? Search."}],
                                           tokenize=False, add_generation_prompt=True)
    ids = tokenizer.encode(prompt, add_special_tokens=False)
    scheduler = RolloutScheduler(RolloutGroup([actor]), tools, TagProtocol(tokenizer, ["search"]), opts)
    name = "model.embed_tokens.weight"
    original = load_file(str(ckpt / "model.safetensors"))[name]

    async def scenario():
        result = await scheduler.run([RolloutPrompt("a", ids), RolloutPrompt("b", ids)])
        await tools.close()
        loop = asyncio.get_running_loop()
        with LocalSync([actor]) as sync:  # blocking sender calls run off the loop
            zero = await loop.run_in_executor(None, lambda: sync.push([(name, torch.zeros_like(original))],
                                                                      verify_fraction=1.0))
            zeroed = await actor.generate.remote(SegmentRequest("z", ids, max_tokens=4, logprobs=3))
            await loop.run_in_executor(None, lambda: sync.push([(name, original)], verify_fraction=1.0))
        restored = await actor.generate.remote(SegmentRequest("r", ids, max_tokens=4, logprobs=3))
        return result, zero, zeroed, restored

    result, zero, zeroed, restored = asyncio.run(scenario())
    assert [len(g) for g in result.groups] == [4, 4] and result.stats["branches"] >= 1
    for group in result.groups:
        by_id = {t.traj_id: t for t in group}
        for traj in group:
            traj.check()
            if traj.origin == "branch":
                off = traj.branch_offset
                assert traj.response_ids[:off] == by_id[traj.parent_id].response_ids[:off]
    assert zero["verified_after_load"] == [name]
    assert zeroed.logprobs == pytest.approx([-math.log(1000)] * 4, abs=1e-4)
    assert not any(lp == pytest.approx(-math.log(1000), abs=1e-3) for lp in restored.logprobs)
