"""hf-to-megatron output loads with Megatron's own dist_checkpointing.load at another TP/PP, with parity."""

import subprocess
import sys

import pytest
import torch

from conversion.parity import parity_worker
from megatron_arpo.testing.dist import run_distributed
from megatron_arpo.testing.tiny import tiny_checkpoint

TOKENS = torch.tensor([[1, 5, 17, 300, 999, 42, 7, 8], [3, 4, 900, 12, 13, 14, 15, 16]])


@pytest.mark.slow
@pytest.mark.parametrize("name,tp,pp", [("tiny-qwq", 2, 2), ("tiny-qwen3", 1, 2), ("tiny-llama", 2, 2),
                                        ("tiny-qwen2.5", 2, 2)])
def test_converted_checkpoint_loads_at_other_layout(tmp_path, name, tp, pp):
    hf_dir = str(tiny_checkpoint(name))
    out = tmp_path / "mg"
    # written for TP=1/PP=1 (a different layout from the one loading it)
    subprocess.run([sys.executable, "-m", "conversion", "hf-to-megatron", "--hf", hf_dir, "--out", str(out),
                    "--tp", "1", "--pp", "1"], check=True, capture_output=True, timeout=300)
    results = run_distributed(parity_worker, tp * pp, hf_dir, name, tp, pp, TOKENS, str(out), timeout=300)
    diffs = [r["max_abs_diff"] for r in results if r["max_abs_diff"] is not None]
    assert len(diffs) == tp and max(diffs) < 1e-4, diffs
    for r in results:
        assert r["mismatches"] == [], r["mismatches"]


def save_with_megatron(rank, world_size, hf_dir, name, tp, pp, out):
    """A checkpoint as training writes it: the live model at TP x PP, saved by Megatron's dist_checkpointing."""
    from megatron.core import dist_checkpointing
    from megatron.core import parallel_state as ps

    from conversion import live
    from megatron_arpo.actor.model_builder import build_gpt_model, initialize_model_parallel
    from megatron_arpo.model_config import load_model_config

    cfg = load_model_config(name)
    initialize_model_parallel(tp, pp, seed=1)
    model = build_gpt_model(cfg, tensor_parallel=tp, pipeline_parallel=pp, params_dtype=torch.float32, use_te=False)
    live.load_hf_into_megatron(model, cfg, hf_dir, ps.get_tensor_model_parallel_rank(), tp,
                               ps.get_pipeline_model_parallel_rank(), pp)
    dist_checkpointing.save(model.sharded_state_dict(), out)


@pytest.mark.slow
def test_megatron_to_hf_reads_a_tp2_training_save(tmp_path):
    """Row-parallel TP splits store half rows: those tensors go through memory, the rest as byte copies."""
    import json
    import shutil

    from conversion.megatron_to_hf import convert_megatron_to_hf
    from conversion.verify import compare_hf_dirs
    from megatron_arpo.model_config import MODEL_CONFIG_DIR

    name = "tiny-qwq"
    hf_dir = tiny_checkpoint(name)
    out = tmp_path / "ckpt"
    out.mkdir()
    run_distributed(save_with_megatron, 2, str(hf_dir), name, 2, 1, str(out), timeout=300)
    shutil.copy(MODEL_CONFIG_DIR / f"{name}.yaml", out / "model_config.yaml")
    convert_megatron_to_hf(out, tmp_path / "hf", tokenizer=hf_dir)
    assert compare_hf_dirs(hf_dir, tmp_path / "hf") == []
    report = json.loads((tmp_path / "hf" / "conversion.json").read_text())
    assert 0 < report["byte_copied_tensors"] < report["num_tensors"], report
