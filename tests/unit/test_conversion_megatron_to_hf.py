"""megatron-to-hf in process (it never imports Megatron): config.json carry-over, byte copies vs tensors."""

import dataclasses
import json
import shutil

import pytest

from megatron_arpo.hf.config_json import carry_over_config
from conversion.megatron_to_hf import convert_megatron_to_hf
from conversion.verify import compare_hf_dirs
from megatron_arpo.model_config import load_model_config
from support.real_shaped import PUBLISHED_CONFIGS, real_shaped_config
from megatron_arpo.tiny.checkpoint import tiny_checkpoint
from test_conversion_cli import run_cli


def test_nothing_changes_when_config_and_weights_agree():
    original = PUBLISHED_CONFIGS["qwq-32b"]
    config, changes = carry_over_config(original, load_model_config("qwq-32b"), "bfloat16")
    assert config == original and list(config) == list(original) and changes == []


def test_an_architecture_disagreement_is_changed_to_what_the_weights_say_and_reported():
    original = real_shaped_config("qwen3-8b", num_layers=36)
    cfg = dataclasses.replace(load_model_config("qwen3-8b"), vocab_size=151680)
    config, changes = carry_over_config(original, cfg, "bfloat16")
    assert [(c.field, c.old, c.new) for c in changes] == [("vocab_size", 151936, 151680)]
    assert "the weights have vocab_size=151680" in changes[0].describe()
    assert {k for k in original if config[k] != original[k]} == {"vocab_size"}


def test_transformers_5_keys_dtype_and_rope_parameters_are_kept_in_their_place():
    original = dict(PUBLISHED_CONFIGS["qwen3-4b"], num_hidden_layers=36)
    del original["torch_dtype"], original["rope_theta"]
    original["dtype"] = "bfloat16"
    original["rope_parameters"] = {"rope_theta": 500000.0, "rope_type": "default"}
    config, changes = carry_over_config(original, load_model_config("qwen3-4b"), "float32")
    assert "torch_dtype" not in config and "rope_theta" not in config
    assert config["dtype"] == "float32" and config["rope_parameters"] == {"rope_theta": 1e6, "rope_type": "default"}
    assert sorted(c.field for c in changes) == ["dtype", "rope_parameters.rope_theta"]


def test_a_missing_dtype_key_is_added_and_reported_as_absent_before():
    original = dict(PUBLISHED_CONFIGS["qwq-32b"])
    del original["torch_dtype"]
    config, changes = carry_over_config(original, load_model_config("qwq-32b"), "bfloat16")
    assert config["torch_dtype"] == "bfloat16"
    assert changes[0].describe() == 'torch_dtype: (absent) -> "bfloat16" (the exported tensors are bfloat16)'


def test_unexpressible_disagreement_is_an_error():
    cfg = dataclasses.replace(load_model_config("qwq-32b"), qk_layernorm=True)
    with pytest.raises(ValueError, match="qk_layernorm.*cannot express"):
        carry_over_config(PUBLISHED_CONFIGS["qwq-32b"], cfg, "bfloat16")


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    root = tmp_path_factory.mktemp("cfg")
    run_cli("hf-to-megatron", "--hf", tiny_checkpoint("tiny-qwq"), "--out", root / "mg")
    return root / "mg"


def test_without_a_recorded_original_the_config_is_generated_and_the_report_says_so(converted, tmp_path):
    mg = tmp_path / "mg"
    shutil.copytree(converted, mg)
    (mg / "hf_extra" / "config.json").unlink()
    convert_megatron_to_hf(mg, tmp_path / "hf")
    report = json.loads((tmp_path / "hf" / "conversion.json").read_text())
    assert report["config_json"]["origin"].startswith("generated from the model config")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "qwen2"


def test_legacy_hf_config_json_is_used_and_a_corrupt_original_is_named(converted, tmp_path):
    mg = tmp_path / "mg"
    shutil.copytree(converted, mg)
    original = mg / "hf_extra" / "config.json"
    (mg / "hf_config.json").write_text(json.dumps(json.loads(original.read_text()), sort_keys=True))
    original.unlink()
    convert_megatron_to_hf(mg, tmp_path / "hf")
    report = json.loads((tmp_path / "hf" / "conversion.json").read_text())
    assert report["config_json"] == {"origin": str(mg / "hf_config.json"), "changed": []}
    assert json.loads((tmp_path / "hf" / "config.json").read_text()) == json.loads(
        (tiny_checkpoint("tiny-qwq") / "config.json").read_text())
    (mg / "hf_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="hf_config.json: the recorded original config.json is not valid JSON"):
        convert_megatron_to_hf(mg, tmp_path / "hf2")
    assert not (tmp_path / "hf2").exists()


@pytest.mark.parametrize("name", ["tiny-qwq", "tiny-qwen3"])
def test_byte_copies_and_the_tensor_path_write_identical_files(tmp_path, name):
    run_cli("hf-to-megatron", "--hf", tiny_checkpoint(name), "--out", tmp_path / "mg", "--tp", 2)
    convert_megatron_to_hf(tmp_path / "mg", tmp_path / "bytes", max_shard_size=300_000)
    convert_megatron_to_hf(tmp_path / "mg", tmp_path / "tensors", max_shard_size=300_000, byte_copy=False)
    by_bytes = json.loads((tmp_path / "bytes" / "conversion.json").read_text())
    assert by_bytes["byte_copied_tensors"] == by_bytes["num_tensors"]
    assert json.loads((tmp_path / "tensors" / "conversion.json").read_text())["byte_copied_tensors"] == 0
    files = sorted(p.name for p in (tmp_path / "bytes").iterdir())
    assert len([f for f in files if f.endswith(".safetensors")]) > 2
    assert files == sorted(p.name for p in (tmp_path / "tensors").iterdir())
    for fname in files:
        if fname != "conversion.json":
            assert (tmp_path / "bytes" / fname).read_bytes() == (tmp_path / "tensors" / fname).read_bytes(), fname
    assert compare_hf_dirs(tiny_checkpoint(name), tmp_path / "bytes") == []


def test_pickles_are_read_without_torch_and_match_torchs_reading(converted):
    import subprocess
    import sys
    import zipfile

    import torch
    from torch.distributed.checkpoint import FileSystemReader

    from conversion.dcp_read import DistCheckpointReader
    from megatron_arpo.ckpt_format import dcp_pickles, torch_dist

    tensors, storage = torch_dist.read_dcp_metadata(converted / ".metadata")
    reference = FileSystemReader(str(converted)).read_metadata()
    assert set(tensors) == {k for k, v in reference.state_dict_metadata.items() if hasattr(v, "chunks")}
    for key, info in tensors.items():
        md = reference.state_dict_metadata[key]
        assert (info.dtype, info.size) == (str(md.properties.dtype).removeprefix("torch."), tuple(md.size))
        assert info.chunks == tuple((tuple(c.offsets), tuple(c.sizes)) for c in md.chunks)
    for index, where in reference.storage_data.items():
        mine = storage[(index.fqn, tuple(index.offset or ()))]
        assert (mine.relative_path, mine.offset, mine.length) == (where.relative_path, where.offset, where.length)
        if index.fqn in tensors:  # a chunk's data.pkl, read by hand, against torch.load
            with open(converted / where.relative_path, "rb") as fh:
                view = torch_dist._FileView(fh, where.offset, where.length)
                archive = zipfile.ZipFile(view)
                recipe = dcp_pickles.load_chunk_recipe(archive.read(next(n for n in archive.namelist()
                                                                         if n.endswith("/data.pkl"))))
                view.seek(0)
                tensor = torch.load(view, weights_only=True)
            assert (recipe.dtype, recipe.size, recipe.stride, recipe.storage_offset) == (
                str(tensor.dtype).removeprefix("torch."), tuple(tensor.shape), tensor.stride(),
                tensor.storage_offset())
            assert recipe.is_plain
    # megatron-to-hf on a converted checkpoint imports neither torch nor Megatron
    code = ("import sys; from conversion.__main__ import main; rc = main(['megatron-to-hf', '--megatron', "
            "sys.argv[1], '--out', sys.argv[2]]); heavy = [m for m in ('torch', 'megatron.core', 'safetensors') "
            "if m in sys.modules]; assert rc == 0 and not heavy, (rc, heavy)")
    subprocess.run([sys.executable, "-c", code, str(converted), str(converted.parent / "light")], check=True)
    assert compare_hf_dirs(tiny_checkpoint("tiny-qwq"), converted.parent / "light") == []

    bad = converted.parent / "evil"
    shutil.copytree(converted, bad)
    # builtins.print("pwned"), written as opcodes: pickling `print` itself names whatever replaced it (Ray's
    # tqdm_ray patches builtins.print once a Ray driver ran in this process).
    (bad / ".metadata").write_bytes(b"cbuiltins\nprint\n(Vpwned\ntR.")
    with pytest.raises(ValueError, match=r"\.metadata: refusing to load builtins\.print"):
        DistCheckpointReader(bad)


def test_an_unknown_torch_class_falls_back_to_dcps_own_reader(converted, monkeypatch):
    from megatron_arpo.ckpt_format import dcp_pickles, torch_dist

    def unknown(self, module, name):
        raise dcp_pickles.UnknownTorchName(f"{module}.{name}: not known here")

    expected = torch_dist.read_dcp_metadata(converted / ".metadata")[0]
    monkeypatch.setattr(dcp_pickles.MetadataUnpickler, "find_class", unknown)
    assert torch_dist.read_dcp_metadata(converted / ".metadata")[0] == expected


def test_stored_tensor_plainness():
    from megatron_arpo.ckpt_format.dcp_pickles import StoredTensor

    assert StoredTensor("bfloat16", "0", 12, 0, (3, 4), (4, 1)).is_plain
    assert not StoredTensor("bfloat16", "0", 12, 0, (4, 3), (1, 4)).is_plain  # transposed
    assert not StoredTensor("bfloat16", "0", 24, 0, (3, 4), (4, 1)).is_plain  # a view of a larger storage
    assert not StoredTensor("bfloat16", "0", 12, 2, (2, 4), (4, 1)).is_plain
