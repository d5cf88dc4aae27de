"""An exported HF checkpoint (HF -> Megatron -> HF) generates the same greedy tokens in vLLM as the original."""

import json
import os
import subprocess
import sys

import pytest

from megatron_arpo.tiny.checkpoint import tiny_checkpoint

GENERATE = r"""
import json, sys
from vllm import LLM, SamplingParams
llm = LLM(model=sys.argv[1], dtype="float32", max_model_len=256, enforce_eager=True, seed=0)
prompts = [{"prompt_token_ids": ids} for ids in ([1, 2, 3, 4, 5], [100, 200, 300], [999, 7])]
outs = llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True))
print("TOKENS=" + json.dumps([list(o.outputs[0].token_ids) for o in outs]))
"""


def greedy_tokens(model_dir):
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND="nobind")
    proc = subprocess.run([sys.executable, "-c", GENERATE, str(model_dir)], capture_output=True, text=True,
                          env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = next(line for line in proc.stdout.splitlines() if line.startswith("TOKENS="))
    return json.loads(line[len("TOKENS="):])


@pytest.mark.slow
@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwq"])
def test_exported_checkpoint_generates_same_greedy_tokens(tmp_path, name):
    hf = tiny_checkpoint(name)
    for args in (["hf-to-megatron", "--hf", hf, "--out", tmp_path / "mg", "--tp", "2", "--pp", "2"],
                 ["megatron-to-hf", "--megatron", tmp_path / "mg", "--out", tmp_path / "hf"]):
        subprocess.run([sys.executable, "-m", "conversion", *map(str, args)], check=True, capture_output=True,
                       timeout=300)
    original = greedy_tokens(hf)
    exported = greedy_tokens(tmp_path / "hf")
    assert len(original) == 3 and all(len(t) == 24 for t in original)
    assert exported == original
