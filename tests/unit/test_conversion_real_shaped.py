"""bf16 checkpoints with real models' config.json field sets: round trips, config.json carry-over, verify."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

from conversion.verify import compare_hf_dirs
from support.real_shaped import PUBLISHED_CONFIGS, build_real_shaped_checkpoint
from test_conversion_cli import run_cli

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def real_shaped(tmp_path_factory):
    root = tmp_path_factory.mktemp("real")
    built = {}

    def get(name, num_layers=2, width_divisor=8):
        key = (name, num_layers, width_divisor)
        if key not in built:
            built[key] = build_real_shaped_checkpoint(name, root / f"{name}-{num_layers}-{width_divisor}",
                                                      num_layers=num_layers, width_divisor=width_divisor)
        return built[key]
    return get


@pytest.mark.parametrize("name", ["qwq-32b", "qwen3-8b", "qwen3-4b"])
def test_round_trip_is_bit_exact_and_config_json_comes_back_unchanged(real_shaped, tmp_path, name):
    hf = real_shaped(name)
    assert len(json.loads((hf / "model.safetensors.index.json").read_text())["weight_map"]) > 0
    run_cli("hf-to-megatron", "--hf", hf, "--out", tmp_path / "mg", "--tp", 2, "--pp", 2)
    proc = run_cli("megatron-to-hf", "--megatron", tmp_path / "mg", "--out", tmp_path / "back",
                   "--max-shard-size", "100MB")
    back = tmp_path / "back"
    assert compare_hf_dirs(hf, back) == []
    original, returned = json.loads((hf / "config.json").read_text()), json.loads((back / "config.json").read_text())
    assert list(returned) == list(original)  # same keys, same order
    for key, value in original.items():
        assert returned[key] == value and type(returned[key]) is type(value), key
    assert (back / "config.json").read_bytes() == (hf / "config.json").read_bytes()
    published = PUBLISHED_CONFIGS[name]
    for key in ("sliding_window", "max_window_layers", "transformers_version", "use_sliding_window"):
        assert returned[key] == published[key], key  # fields our model config does not model
    if name == "qwq-32b":
        assert (returned["sliding_window"], returned["max_window_layers"]) == (32768, 64)
    report = json.loads((back / "conversion.json").read_text())
    assert report["config_json"]["changed"] == [] and report["dtype"] == "bfloat16"
    assert "no field changed" in proc.stdout


def test_a_dtype_change_is_the_only_config_change_and_is_reported(real_shaped, tmp_path):
    hf = real_shaped("qwq-32b")
    run_cli("hf-to-megatron", "--hf", hf, "--out", tmp_path / "mg", "--dtype", "float32")
    proc = run_cli("megatron-to-hf", "--megatron", tmp_path / "mg", "--out", tmp_path / "back")
    original = json.loads((hf / "config.json").read_text())
    returned = json.loads((tmp_path / "back" / "config.json").read_text())
    assert {k for k in original if returned[k] != original[k]} == {"torch_dtype"}
    assert list(returned) == list(original) and returned["torch_dtype"] == "float32"
    report = json.loads((tmp_path / "back" / "conversion.json").read_text())
    assert [(c["field"], c["old"], c["new"]) for c in report["config_json"]["changed"]] == [
        ("torch_dtype", "bfloat16", "float32")]
    assert "1 field(s) changed" in proc.stdout and 'torch_dtype: "bfloat16" -> "float32"' in proc.stdout


def _verify(hf, *args):
    return subprocess.run([sys.executable, "-m", "conversion", "verify", "--hf", str(hf), *args],
                          capture_output=True, text=True, timeout=900, cwd=str(REPO))


@pytest.mark.slow
def test_verify_passes_on_bf16_real_width_qwen3_at_every_default_layout(real_shaped):
    """Qwen3-0.6B at its real widths and vocabulary (2 layers): TP=1, TP=2 and PP=2."""
    hf = real_shaped("qwen3-0.6b", num_layers=2, width_divisor=1)
    out = _verify(hf)
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert out.stdout.count("tensors bit-exact in bfloat16") == 3 and "FAIL" not in out.stdout
    assert "verify: all checks passed" in out.stdout


@pytest.mark.slow
def test_verify_passes_on_bf16_qwq_with_qkv_bias(real_shaped):
    out = _verify(real_shaped("qwq-32b"), "--tp", "2", "--pp", "1")
    assert out.returncode == 0, out.stdout + out.stderr[-3000:]
    assert "round trip HF->Megatron->HF      27/27 tensors bit-exact" in out.stdout
    assert "27/27 tensors bit-exact in bfloat16  PASS" in out.stdout and "FAIL" not in out.stdout
