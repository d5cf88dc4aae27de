"""hf-to-megatron output against Megatron itself: the layout its ``sharded_state_dict()`` asks for, its own
``dist_checkpointing.load`` at another TP/PP (parameters bit-identical to the in-memory HF loader, logits
at parity), the actor's load path, and the round trip back to HF.

The writer (:mod:`conversion.dcp_write`) never imports megatron-core; the oracle here is megatron-core.
"""

import json
import subprocess
import sys

import pytest
import torch

from conversion.parity import parity_worker
from megatron_arpo.device.local_ranks import run_distributed
from megatron_arpo.tiny.checkpoint import tiny_checkpoint

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

    from megatron_arpo.actor import hf_live as live
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


MODELS = ["tiny-qwen3", "tiny-qwen3-untied", "tiny-qwen2.5", "tiny-llama",
          "tiny-qwen3-moe"]  # tied, untied, QKV bias, llama, routed experts


def megatron_layout(rank, world_size, name, tp, dtype_name):
    """What Megatron's TP=1/PP=1 GPTModel (vocab padded for ``tp``) would save: key -> (shape, dtype, chunks)."""
    from megatron.core.dist_checkpointing.dict_utils import nested_values
    from megatron.core.dist_checkpointing.mapping import (
        ShardedObject, ShardedTensor, apply_factories, is_main_replica)

    from conversion.meta import build_meta_gpt_model
    from megatron_arpo.actor.model_builder import initialize_model_parallel
    from megatron_arpo.model_config import load_model_config

    cfg = load_model_config(name)
    initialize_model_parallel(1, 1, seed=1)
    dtype = getattr(torch, dtype_name)
    model = build_meta_gpt_model(cfg, 1, 1, padded_vocab=cfg.padded_vocab_size(tp), params_dtype=dtype).to(dtype)
    sharded = model.sharded_state_dict()
    apply_factories(sharded)
    tensors, objects = {}, set()
    for item in nested_values(sharded):
        if not is_main_replica(item.replica_id):
            continue
        if isinstance(item, ShardedObject):
            objects.add(item.unique_key)
        elif isinstance(item, ShardedTensor):
            shape, dtype_str, chunks = tensors.setdefault(item.key, (tuple(item.global_shape), str(item.dtype), []))
            assert shape == tuple(item.global_shape) and dtype_str == str(item.dtype), item.key
            # local_shape leaves out the prepended (layer) axes, each of size 1 in the saved chunk
            chunks.append((tuple(item.global_offset), (1,) * item.prepend_axis_num + tuple(item.local_shape)))
    return {k: (shape, dtype_str, sorted(chunks)) for k, (shape, dtype_str, chunks) in tensors.items()}, objects


def written_layout(ckpt):
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata

    metadata = FileSystemReader(str(ckpt)).read_metadata()
    tensors = {k: (tuple(v.size), str(v.properties.dtype), sorted((tuple(c.offsets), tuple(c.sizes)) for c in v.chunks))
               for k, v in metadata.state_dict_metadata.items() if not isinstance(v, BytesStorageMetadata)}
    objects = {k for k, v in metadata.state_dict_metadata.items() if isinstance(v, BytesStorageMetadata)}
    stored = {(index.fqn, None if index.offset is None else tuple(index.offset)) for index in metadata.storage_data}
    expected_stored = {(k, offsets) for k, (_, _, chunks) in tensors.items() for offsets, _ in chunks}
    assert stored == expected_stored | {(k, None) for k in objects}
    return tensors, objects


@pytest.mark.slow
@pytest.mark.parametrize("name", MODELS)
def test_written_metadata_is_what_megatron_saves(tmp_path, name):
    """Key by key: global shape, dtype and every chunk's offsets and sizes (padded for TP=2, bf16)."""
    from conversion.dist_ckpt import convert_hf_to_megatron

    convert_hf_to_megatron(tiny_checkpoint(name), tmp_path / "mg", tp=2, dtype=torch.bfloat16)
    [(expected_tensors, expected_objects)] = run_distributed(megatron_layout, 1, name, 2, "bfloat16", timeout=300)
    tensors, objects = written_layout(tmp_path / "mg")
    assert sorted(tensors) == sorted(expected_tensors)
    for key, expected in expected_tensors.items():
        assert tensors[key] == expected, key
    assert objects == expected_objects and objects  # the linears' _extra_state
    assert json.loads((tmp_path / "mg" / "metadata.json").read_text()) == {
        "sharded_backend": "torch_dist", "sharded_backend_version": 1, "common_backend": "torch",
        "common_backend_version": 1}
    assert torch.load(tmp_path / "mg" / "common.pt", weights_only=True) == {}


def load_and_compare(rank, world_size, hf_dir, name, tp, pp, megatron_dir, dtype_name):
    """Load the converted checkpoint with the actor's loader; compare every parameter with the in-memory loader."""
    from megatron.core import parallel_state as ps

    from megatron_arpo.actor import hf_live as live
    from megatron_arpo.actor.checkpoint import load_checkpoint
    from megatron_arpo.actor.model_builder import build_gpt_model, initialize_model_parallel
    from megatron_arpo.model_config import load_model_config

    cfg = load_model_config(name)
    dtype = getattr(torch, dtype_name)
    initialize_model_parallel(tp, pp, seed=1)
    loaded = build_gpt_model(cfg, tensor_parallel=tp, pipeline_parallel=pp, params_dtype=dtype, use_te=False)
    reference = build_gpt_model(cfg, tensor_parallel=tp, pipeline_parallel=pp, params_dtype=dtype, use_te=False)
    for model in (loaded, reference):  # different contents before loading
        with torch.no_grad():
            for param in model.parameters():
                param.normal_()
    load_checkpoint(megatron_dir, model=loaded, layout={"tp": tp, "pp": pp})
    live.load_hf_into_megatron(reference, cfg, hf_dir, ps.get_tensor_model_parallel_rank(), tp,
                               ps.get_pipeline_model_parallel_rank(), pp)
    expected = dict(reference.named_parameters())
    got = dict(loaded.named_parameters())
    assert sorted(got) == sorted(expected)
    return [n for n, p in got.items() if p.dtype != expected[n].dtype or not torch.equal(p, expected[n])], len(got)


@pytest.mark.slow
@pytest.mark.parametrize("name,tp,pp", [(n, 2, 2) for n in MODELS] + [("tiny-qwen3", 1, 1)])
def test_actor_load_is_bit_identical_to_the_in_memory_loader(tmp_path, name, tp, pp):
    """Megatron's load (through the actor's checkpoint loader) at TP x PP of a checkpoint padded for TP=1."""
    from conversion.dist_ckpt import convert_hf_to_megatron

    hf_dir = tiny_checkpoint(name)
    convert_hf_to_megatron(hf_dir, tmp_path / "mg", tp=1)
    results = run_distributed(load_and_compare, tp * pp, str(hf_dir), name, tp, pp, str(tmp_path / "mg"), "float32",
                              timeout=300)
    for differing, count in results:
        assert count > 0 and differing == [], differing


def test_round_trip_is_bit_exact(tmp_path):
    """hf-to-megatron then megatron-to-hf gives the original tensors bit for bit (bf16 written from fp32 too)."""
    from conversion.dist_ckpt import convert_hf_to_megatron, convert_megatron_to_hf
    from megatron_arpo.hf.checkpoint_io import HFCheckpointReader
    from conversion.verify import compare_hf_dirs

    for name in MODELS:
        hf_dir = tiny_checkpoint(name)
        convert_hf_to_megatron(hf_dir, tmp_path / name / "mg", tp=2)
        convert_megatron_to_hf(tmp_path / name / "mg", tmp_path / name / "hf")
        assert compare_hf_dirs(hf_dir, tmp_path / name / "hf") == [], name
    convert_hf_to_megatron(hf_dir, tmp_path / "bf16" / "mg", dtype=torch.bfloat16)
    convert_megatron_to_hf(tmp_path / "bf16" / "mg", tmp_path / "bf16" / "hf")
    original, exported = HFCheckpointReader(hf_dir), HFCheckpointReader(tmp_path / "bf16" / "hf")
    assert sorted(original.names()) == sorted(exported.names())
    for tensor_name in original.names():
        got = exported.read(tensor_name)
        assert got.dtype == torch.bfloat16 and torch.equal(got, original.read(tensor_name).to(torch.bfloat16))


def test_hf_to_megatron_does_not_import_megatron(tmp_path):
    code = ("import sys; from conversion.__main__ import main; rc = main(sys.argv[1:]); "
            "bad = sorted(m for m in sys.modules if m == 'megatron' or m.startswith('megatron.')); "
            "print('MEGATRON_MODULES', bad); sys.exit(rc)")
    proc = subprocess.run([sys.executable, "-c", code, "hf-to-megatron", "--hf", str(tiny_checkpoint("tiny-qwen3")),
                           "--out", str(tmp_path / "mg"), "--tp", "2", "--pp", "2"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "MEGATRON_MODULES []" in proc.stdout, proc.stdout
    assert (tmp_path / "mg" / "metadata.json").exists()
