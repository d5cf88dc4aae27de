"""``python -m conversion`` end to end on tiny checkpoints (subprocesses: the CLI sets up its own gloo group)."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conversion.verify import compare_hf_dirs
from megatron_arpo.tiny.checkpoint import tiny_checkpoint


def run_cli(*args, check=True):
    proc = subprocess.run([sys.executable, "-m", "conversion", *map(str, args)], capture_output=True, text=True,
                          timeout=300)
    if check and proc.returncode != 0:
        raise AssertionError(f"exit {proc.returncode}\n{proc.stdout}\n{proc.stderr[-3000:]}")
    return proc


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwq"])
def test_round_trip_cli_loads_in_transformers(tmp_path, name):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf = tiny_checkpoint(name)
    to_mg = run_cli("hf-to-megatron", "--hf", hf, "--out", tmp_path / "mg", "--tp", 2, "--pp", 2)
    to_hf = run_cli("megatron-to-hf", "--megatron", tmp_path / "mg", "--out", tmp_path / "hf", "--max-shard-size", "1MB")
    # Progress without -v: plain lines into a file or pipe (first and last here), never a redrawn bar.
    for proc, what, unit in ((to_mg, "hf-to-megatron", "chunks"), (to_hf, "megatron-to-hf", "tensors")):
        lines = [l for l in proc.stderr.splitlines() if "megatron_arpo.progress" in l]
        assert len(lines) >= 2 and f"{what}: 1/" in lines[0] and f" {unit} (100%)" in lines[-1], proc.stderr
        assert "MB/s" in lines[-1] and "ETA 0 s" in lines[-1] and "\r" not in proc.stderr
    out = tmp_path / "hf"
    assert compare_hf_dirs(hf, out) == []
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert ("lm_head.weight" in index["weight_map"]) == (name != "tiny-qwen3")
    for fname in ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json"):
        assert (out / fname).exists(), fname
    tokens = torch.tensor([[1, 2, 3, 500, 999]])
    ref = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32)
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    with torch.no_grad():
        assert torch.equal(ref(tokens).logits, got(tokens).logits)
    assert AutoTokenizer.from_pretrained(out).encode("hello world") == AutoTokenizer.from_pretrained(hf).encode("hello world")


def test_training_checkpoint_layout_and_errors(tmp_path):
    hf = tiny_checkpoint("tiny-qwen3-untied")
    run_cli("hf-to-megatron", "--hf", hf, "--out", tmp_path / "mg")
    # existing output refused, exit 2, message names the fix
    proc = run_cli("hf-to-megatron", "--hf", hf, "--out", tmp_path / "mg", check=False)
    assert proc.returncode == 2 and "--overwrite" in proc.stderr
    # a training run dir: run/latest_checkpointed_iteration.txt, run/iter_0000010/model/<dist ckpt>
    run_dir = tmp_path / "run"
    (run_dir / "iter_0000010").mkdir(parents=True)
    (run_dir / "latest_checkpointed_iteration.txt").write_text("10")
    shutil.copytree(tmp_path / "mg", run_dir / "iter_0000010" / "model")
    shutil.move(run_dir / "iter_0000010" / "model" / "model_config.yaml", run_dir / "model_config.yaml")
    run_cli("megatron-to-hf", "--megatron", run_dir, "--out", tmp_path / "hf", "--tokenizer", hf)
    assert compare_hf_dirs(hf, tmp_path / "hf") == []
    # a truncated data file fails mid-export: nothing at the target, no temp dirs left
    data = next((tmp_path / "mg").glob("*.distcp"))
    data.write_bytes(data.read_bytes()[: data.stat().st_size // 3])
    proc = run_cli("megatron-to-hf", "--megatron", tmp_path / "mg", "--out", tmp_path / "hf2", check=False)
    assert proc.returncode == 2 and f"{data}: truncated .distcp shard" in proc.stderr
    assert not (tmp_path / "hf2").exists()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".hf2")]
    # wrong model config for the checkpoint
    proc = run_cli("megatron-to-hf", "--megatron", run_dir, "--out", tmp_path / "hf3", "--model-config", "tiny-qwq",
                   check=False)
    assert proc.returncode == 2 and "linear_qkv.bias" in proc.stderr


@pytest.mark.parametrize("config", ["model_configs/qwq-32b.yaml", "model_configs/qwen3-32b.yaml"])
def test_shapes_32b(config):
    proc = run_cli("shapes", "--model-config", config, "--tp", 8, "--pp", 4)
    lines = proc.stdout.splitlines()
    assert sum(1 for line in lines if line.rstrip().endswith(" ok")) == 32
    assert "mapping covers every parameter of every rank" in proc.stdout


def test_shapes_rejects_bad_layout_and_plan_is_its_deprecated_name():
    proc = run_cli("plan", "--model-config", "qwq-32b", "--tp", 16, "--pp", 4, check=False)
    assert "use `megatron-arpo convert shapes`" in proc.stderr
    assert proc.returncode == 2 and "tensor_parallel: 16 does not divide qwq-32b num_attention_heads 40; " \
        "valid values: [1, 2, 4, 8]" in proc.stderr


def test_bf16_round_trip_keeps_dtype(tmp_path):
    """bf16 checkpoints stay bf16 everywhere (norms included), bit-exact."""
    import safetensors.torch as st

    src = tiny_checkpoint("tiny-qwq")
    hf = tmp_path / "hf_bf16"
    shutil.copytree(src, hf)
    tensors = {k: v.to(torch.bfloat16) for k, v in st.load_file(hf / "model.safetensors").items()}
    st.save_file(tensors, hf / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((hf / "config.json").read_text())
    config["torch_dtype"] = "bfloat16"
    (hf / "config.json").write_text(json.dumps(config))
    run_cli("hf-to-megatron", "--hf", hf, "--out", tmp_path / "mg", "--tp", 2)
    run_cli("megatron-to-hf", "--megatron", tmp_path / "mg", "--out", tmp_path / "back")
    assert compare_hf_dirs(hf, tmp_path / "back") == []
    assert json.loads((tmp_path / "back" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_verify_fails_on_a_wrong_model_config():
    """The passing table on bf16 real-shaped checkpoints: tests/unit/test_conversion_real_shaped.py."""
    hf = str(tiny_checkpoint("tiny-qwq"))
    bad = subprocess.run([sys.executable, "-m", "conversion", "verify", "--hf", hf, "--tp", "2", "--pp", "1",
                          "--model-config", "model_configs/tiny-qwen3.yaml"],
                         capture_output=True, text=True, timeout=600, cwd=str(Path(__file__).resolve().parents[2]))
    assert bad.returncode == 2 and "disagrees with model config" in bad.stderr, bad.stdout + bad.stderr
    assert "Traceback" not in bad.stderr
