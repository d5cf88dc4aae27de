"""An exported HF checkpoint (HF -> Megatron -> HF) generates the original's greedy tokens in vLLM.

tiny-qwen3 (tied embeddings, q/k norm) and tiny-qwq (Qwen2, QKV bias, untied) each go through the round trip
at TP=2, PP=2; each export then runs in a vLLM engine of this process. The reference tokens are
transformers' greedy decoding of the original checkpoint: tests/integration/test_tiny_vllm.py shows that
vLLM on the original decodes the same tokens as transformers, so one engine per model is enough.
"""

import gc
import subprocess
import sys

import pytest
import torch

from megatron_arpo.tiny.checkpoint import tiny_checkpoint

PROMPTS = ([1, 2, 3, 4, 5], [100, 200, 300], [999, 7])
NUM_TOKENS = 24


def greedy_tokens(model_dir) -> list[list[int]]:
    # vllm is imported here, not at the top: collecting the other tiers must not pay for it.
    from vllm import LLM, SamplingParams
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory
    from vllm.inputs import TokensPrompt

    from megatron_arpo.rollout.engine import guard_llvmlite_for_vllm

    guard_llvmlite_for_vllm()  # earlier tests in this process may have loaded llvmlite (bm25s -> numba)
    llm = LLM(model=str(model_dir), dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
    try:
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in PROMPTS],
                            SamplingParams(temperature=0.0, max_tokens=NUM_TOKENS, ignore_eos=True), use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]
    finally:
        # Two engines are created in this process one after the other: release each one completely.
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        cleanup_dist_env_and_memory()


def reference_tokens(model_dir) -> list[list[int]]:
    """transformers' greedy tokens on the original checkpoint; an EOS is a token like any other, as in vLLM
    with ``ignore_eos`` (``generate``'s ``min_new_tokens`` would forbid it instead)."""
    from transformers import AutoModelForCausalLM  # heavy: imported where it is used, as vllm is

    model = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    tokens = []
    for ids in PROMPTS:
        seq = list(ids)
        with torch.no_grad():
            for _ in range(NUM_TOKENS):
                seq.append(int(model(torch.tensor([seq])).logits[0, -1].argmax()))
        tokens.append(seq[len(ids):])
    return tokens


def round_trip(hf, out):
    for args in (["hf-to-megatron", "--hf", hf, "--out", out / "mg", "--tp", "2", "--pp", "2"],
                 ["megatron-to-hf", "--megatron", out / "mg", "--out", out / "hf"]):
        proc = subprocess.run([sys.executable, "-m", "conversion", *map(str, args)], capture_output=True, text=True,
                              timeout=300)
        assert proc.returncode == 0, proc.stderr[-4000:]
    return out / "hf"


@pytest.mark.slow
def test_exported_checkpoints_generate_same_greedy_tokens(tmp_path):
    for name in ("tiny-qwen3", "tiny-qwq"):
        hf = tiny_checkpoint(name)
        exported = round_trip(hf, tmp_path / name)
        original = reference_tokens(hf)
        assert len(original) == 3 and all(len(t) == NUM_TOKENS for t in original), name
        assert greedy_tokens(exported) == original, name
