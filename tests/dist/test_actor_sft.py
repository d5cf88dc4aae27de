"""Cold-start SFT end to end through the CLI entry: 2 local gloo ranks (DP=2), a synthetic tool-use set
(ShareGPT JSONL with <python>/<result> turns), the loss falls, and the exported HF checkpoint loads in
transformers with trained weights."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from megatron_arpo.tiny.checkpoint import tiny_checkpoint

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]


def _conversation(i: int) -> dict:
    a, b = 3 + i, 11 + 2 * i
    answer = (f"<think>I will compute {a}*{b} with python.</think><python>print({a}*{b})</python>"
              f" <result>\n{a * b}\n</result><answer>The product is \\boxed{{{a * b}}}.</answer>")
    return {"system": "You can use <python> to run code.",
            "conversations": [{"from": "human", "value": f"What is {a} times {b}?"},
                              {"from": "gpt", "value": answer}]}


def test_sft_cli_lowers_loss_and_exports_hf(tmp_path):
    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(_conversation(i)) + "\n" for i in range(8)))
    config = {
        "name": "sft-test", "model": {"config": "tiny-qwen3", "hf_checkpoint": str(tiny_checkpoint("tiny-qwen3"))},
        "tools": {"search": {"enabled": False}},
        "data": {"max_prompt_tokens": 64}, "rollout": {"response_length": 64, "n": 2, "initial_rollouts": 2},
        "trainer": {"run_dir": str(tmp_path / "run"), "train_batch_size": 4},
        "launcher": {"gpus_per_node": 0},
        "actor": {"params_dtype": "fp32", "micro_batch_tokens": 256, "data_parallel": 2, "mini_batch_size": 2,
                  "optimizer": {"weight_decay": 0.0, "clip_grad": 1.0}},
        "sft": {"train_files": [str(data)], "max_seq_tokens": 128, "epochs": 6, "global_batch_size": 4,
                "lr": 3e-3, "lr_schedule": "constant", "warmup_fraction": 0.0},
    }
    cfg_path = tmp_path / "sft.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-c", "import sys; from megatron_arpo.sft import sft_main; "
                           "sys.exit(sft_main(sys.argv[1:]))", "--config", str(cfg_path)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = tmp_path / "run" / "sft"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert len(rows) == 12  # 6 epochs x 8 conversations / 4
    losses = [r["loss"] for r in rows]
    assert losses[-1] < 0.5 * losses[0], losses
    assert all(r["loss_tokens"] > 0 for r in rows)
    assert (out / "checkpoints" / "step-12" / "COMPLETE").exists()

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = out / "hf"
    tuned = load_file(str(hf / "model.safetensors"))
    base = load_file(str(tiny_checkpoint("tiny-qwen3") / "model.safetensors"))
    assert set(tuned) == set(base)
    assert max((tuned[k] - base[k]).abs().max().item() for k in base) > 1e-3
    # The exported checkpoint is the trained model: transformers' NLL on a training conversation's
    # assistant tokens fell as the trainer's did.
    from megatron_arpo.data.chat import load_chat_format
    from megatron_arpo.data.sft import normalize_conversation, tokenize_conversation

    tok = AutoTokenizer.from_pretrained(str(hf))
    ex, _ = tokenize_conversation(load_chat_format(tok, hf), normalize_conversation(_conversation(0), "row"), 128)
    ids = torch.tensor([ex.input_ids])
    mask = torch.tensor(ex.loss_mask[1:], dtype=torch.float64)

    def nll(model_dir):
        model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
        with torch.no_grad():
            logp = torch.log_softmax(model(ids).logits[0, :-1].double(), -1)
        token_logp = logp.gather(-1, ids[0, 1:, None]).squeeze(-1)
        return float(-(token_logp * mask).sum() / mask.sum())

    tuned_nll, base_nll = nll(hf), nll(tiny_checkpoint("tiny-qwen3"))
    assert base_nll == pytest.approx(losses[0], rel=0.1)
    assert tuned_nll < 0.5 * base_nll, (tuned_nll, base_nll)
