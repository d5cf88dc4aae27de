"""Live-model path on gloo: HF -> Megatron load, logits parity with transformers, bit-exact export."""

import pytest
import torch

from conversion.parity import parity_worker
from megatron_arpo.device.local_ranks import run_distributed
from megatron_arpo.tiny.checkpoint import tiny_checkpoint

TOKENS = torch.tensor([[1, 5, 17, 300, 999, 42, 7, 8], [3, 4, 900, 12, 13, 14, 15, 16]])


@pytest.mark.parametrize("name,tp,pp", [
    ("tiny-qwen3", 1, 1),
    ("tiny-qwen3", 2, 1),
    ("tiny-qwq", 2, 1),
    ("tiny-qwen3", 1, 2),
    ("tiny-qwen3-untied", 1, 2),
    ("tiny-llama", 2, 1),  # llama3 RoPE scaling with non-default parameters: logits parity checks all four
    ("tiny-qwen3-moe", 2, 1),  # routed experts split by TP (EP: test_moe_parallel.py)
])  # PP=2 (and TP x PP) of tiny-llama and tiny-qwen2.5: test_conversion_dist_ckpt.py
def test_load_parity_and_export(name, tp, pp):
    hf_dir = str(tiny_checkpoint(name))
    results = run_distributed(parity_worker, tp * pp, hf_dir, name, tp, pp, TOKENS, timeout=240)
    diffs = [r["max_abs_diff"] for r in results if r["max_abs_diff"] is not None]
    assert len(diffs) == tp  # the last stage's TP ranks
    assert max(diffs) < 1e-4, diffs
    for r in results:
        assert r["mismatches"] == [], r["mismatches"]
        assert r["num_exported"] == results[0]["num_exported"] > 0
    # The weight sync's send path: each stage's TP rank 0 holds its stage's tensors, bit-exact; the other
    # TP ranks only contribute shards. Together the stages send every tensor once.
    senders = [r for r in results if r["stage_sent"]]
    assert len(senders) == pp and all(r["stage_wrong"] == [] for r in results)
    assert all(r["stage_empty_buckets"] > 0 for r in results if not r["stage_sent"]) and len(results) - pp == \
        (tp - 1) * pp
    names = [n for r in senders for n in r["stage_sent"]]
    assert len(names) == len(set(names)) == results[0]["num_exported"]
