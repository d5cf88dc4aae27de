"""Bad input: each error names the tensor/field and what was expected; nothing half-written is left."""

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from megatron_arpo.hf.checkpoint_io import HFCheckpointReader
from megatron_arpo.actor.hf_live import validate_hf_checkpoint
from megatron_arpo.model_config import load_model_config
from megatron_arpo.models.registry import families
from megatron_arpo.tiny.checkpoint import tiny_checkpoint


@pytest.fixture
def hf_copy(tmp_path):
    src = tiny_checkpoint("tiny-qwen3-untied")
    dst = tmp_path / "hf"
    shutil.copytree(src, dst)
    return dst


def _edit(hf_dir: Path, fn):
    tensors = load_file(hf_dir / "model.safetensors")
    fn(tensors)
    save_file(tensors, hf_dir / "model.safetensors", metadata={"format": "pt"})


def _validate(hf_dir, name="tiny-qwen3-untied"):
    validate_hf_checkpoint(HFCheckpointReader(hf_dir), load_model_config(name))


def test_valid_checkpoint_passes(hf_copy):
    _validate(hf_copy)


def test_missing_tensor(hf_copy):
    _edit(hf_copy, lambda t: t.pop("model.layers.1.self_attn.v_proj.weight"))
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.self_attn\.v_proj\.weight"):
        _validate(hf_copy)


def test_extra_tensor(hf_copy):
    _edit(hf_copy, lambda t: t.update({"model.layers.0.mlp.extra.weight": torch.zeros(2)}))
    with pytest.raises(ValueError, match=r"no mapping rule consumes: model\.layers\.0\.mlp\.extra\.weight"):
        _validate(hf_copy)


def test_shape_mismatch(hf_copy):
    _edit(hf_copy, lambda t: t.update({"model.norm.weight": torch.ones(128)}))
    with pytest.raises(ValueError, match=r"model\.norm\.weight: expected shape \[256\], got \[128\]"):
        _validate(hf_copy)


def test_dtype_mismatch(hf_copy):
    _edit(hf_copy, lambda t: t.update({"model.norm.weight": t["model.norm.weight"].half()}))
    with pytest.raises(ValueError, match=r"dtype mismatch: 1 tensor\(s\) are F16.*model\.norm\.weight"):
        _validate(hf_copy)


def test_config_disagrees_with_yaml(hf_copy):
    with pytest.raises(ValueError, match=r"tie_word_embeddings: model config says True, .* says False"):
        _validate(hf_copy, "tiny-qwen3")


def test_unsupported_model_type(hf_copy):
    config = json.loads((hf_copy / "config.json").read_text())
    config["model_type"] = "mistral"
    (hf_copy / "config.json").write_text(json.dumps(config))
    from conversion.dist_ckpt import convert_hf_to_megatron

    with pytest.raises(ValueError, match=r"unsupported model_type 'mistral'.*" + re.escape(str(sorted(families())))):
        convert_hf_to_megatron(hf_copy, hf_copy.parent / "out")
    assert not (hf_copy.parent / "out").exists()


def test_truncated_safetensors(hf_copy):
    path = hf_copy / "model.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])
    with pytest.raises(ValueError, match=r"model\.safetensors: .*truncated"):
        HFCheckpointReader(hf_copy)


def test_missing_shard_of_index(hf_copy):
    (hf_copy / "model.safetensors.index.json").write_text(json.dumps(
        {"weight_map": {"model.norm.weight": "model-00002-of-00002.safetensors"}}))
    with pytest.raises(FileNotFoundError, match="model-00002-of-00002.safetensors.*missing"):
        HFCheckpointReader(hf_copy)
