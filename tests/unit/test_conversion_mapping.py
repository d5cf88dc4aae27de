"""Mapping tables: coverage both ways, TP sharding, in-memory round trips, shapes for 32B configs."""

import re

import pytest
import torch

from megatron_arpo.hf import mapping
from megatron_arpo.model_config import load_model_config
from megatron_arpo.models.registry import families

TINY = ["tiny-qwen3", "tiny-qwen3-untied", "tiny-qwq"]
PARALLEL = [(1, 1), (2, 1), (1, 2), (2, 2)]


def random_hf(cfg, seed=0):
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for rule in mapping.bind_table(cfg):
        for name, shape in rule.hf_shapes(cfg).items():
            out[name] = torch.randn(shape, generator=gen)
    return out


@pytest.mark.parametrize("name", TINY)
@pytest.mark.parametrize("tp,pp", PARALLEL)
def test_round_trip_bit_exact(name, tp, pp):
    cfg = load_model_config(name)
    hf = random_hf(cfg)
    states = mapping.hf_to_megatron_states(hf, cfg, tp, pp)
    assert len(states) == tp * pp
    back = mapping.megatron_states_to_hf(states, cfg, tp, pp)
    assert sorted(back) == sorted(hf)
    for key, tensor in hf.items():
        assert back[key].dtype == tensor.dtype and torch.equal(back[key], tensor), key
    assert ("lm_head.weight" in back) == (not cfg.tie_word_embeddings)


def test_tied_pp2_keeps_output_copy_on_last_stage():
    cfg = load_model_config("tiny-qwen3")
    states = mapping.hf_to_megatron_states(random_hf(cfg), cfg, 1, 2)
    assert "output_layer.weight" not in states[(0, 0)]
    assert torch.equal(states[(1, 0)]["output_layer.weight"][:1000], random_hf(cfg)["model.embed_tokens.weight"])
    single = mapping.hf_to_megatron_states(random_hf(cfg), cfg, 1, 1)
    assert "output_layer.weight" not in single[(0, 0)]


def test_qkv_interleave_per_group():
    cfg = load_model_config("tiny-qwq")  # 4 heads, 2 groups, head_dim 64
    hf = random_hf(cfg)
    rule = next(r for r in mapping.bind_table(cfg) if r.megatron == "decoder.layers.0.self_attention.linear_qkv.weight")
    full = rule.read_shard(mapping.tensor_reader(hf), cfg, 0, 1)
    q, k, v = (hf[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv")
    hd = 64
    # group 0: q heads 0,1 then k0, v0; group 1: q heads 2,3 then k1, v1
    expected = torch.cat([q[0:2 * hd], k[0:hd], v[0:hd], q[2 * hd:4 * hd], k[hd:2 * hd], v[hd:2 * hd]])
    assert torch.equal(full, expected)
    # TP=2 splits by groups: rank 1 holds group 1 only
    shard1 = rule.read_shard(mapping.tensor_reader(hf), cfg, 1, 2)
    assert torch.equal(shard1, expected[4 * hd:])


def test_fc1_shard_is_gate_shard_then_up_shard():
    cfg = load_model_config("tiny-qwen3")
    hf = random_hf(cfg)
    rule = next(r for r in mapping.bind_table(cfg) if r.megatron == "decoder.layers.1.mlp.linear_fc1.weight")
    gate, up = hf["model.layers.1.mlp.gate_proj.weight"], hf["model.layers.1.mlp.up_proj.weight"]
    shard = rule.read_shard(mapping.tensor_reader(hf), cfg, 1, 2)
    assert torch.equal(shard, torch.cat([gate[256:], up[256:]]))
    full = rule.read_shard(mapping.tensor_reader(hf), cfg, 0, 1)
    for tp_rank in range(2):
        assert torch.equal(mapping.shard_full(mapping.Shard.GATED, full, tp_rank, 2),
                           rule.read_shard(mapping.tensor_reader(hf), cfg, tp_rank, 2))


@pytest.mark.parametrize("name", TINY)
def test_read_shard_equals_shard_of_full(name):
    cfg = load_model_config(name)
    hf = random_hf(cfg)
    read = mapping.tensor_reader(hf)
    for rule in mapping.bind_table(cfg):
        full = rule.read_shard(read, cfg, 0, 1)
        shards = [rule.read_shard(read, cfg, r, 2) for r in range(2)]
        assert full.shape == rule.megatron_shape(cfg, 1)
        if rule.shard is mapping.Shard.VOCAB:  # padded size depends on TP
            full = rule.read_shard(read, cfg, 0, 1)[: cfg.vocab_size]
            assert torch.equal(mapping.unshard(rule.shard, shards)[: cfg.vocab_size], full)
            continue
        for r in range(2):
            assert shards[r].shape == rule.shard_shape(cfg, 2)
            assert torch.equal(mapping.shard_full(rule.shard, full, r, 2), shards[r])
        assert torch.equal(mapping.unshard(rule.shard, shards), full)


def test_vocab_padding_and_trim():
    cfg = load_model_config("tiny-qwen3-untied")
    hf = random_hf(cfg)
    rule = next(r for r in mapping.bind_table(cfg) if r.megatron == "output_layer.weight")
    shards = [rule.read_shard(mapping.tensor_reader(hf), cfg, r, 2) for r in range(2)]
    assert [s.shape[0] for s in shards] == [512, 512]  # padded 1000 -> 1024
    assert torch.count_nonzero(shards[1][1000 - 512:]) == 0
    assert torch.equal(rule.to_hf(torch.cat(shards), cfg)["lm_head.weight"], hf["lm_head.weight"])


def test_coverage_errors_name_tensors():
    cfg = load_model_config("tiny-qwen3-untied")
    bound = mapping.bind_table(cfg)
    hf = random_hf(cfg)
    names = set(hf) - {"model.layers.1.mlp.up_proj.weight"} | {"model.layers.9.extra.weight"}
    with pytest.raises(ValueError, match=r"missing 1 tensor.*model\.layers\.1\.mlp\.up_proj\.weight.*"
                                         r"model\.layers\.9\.extra\.weight"):
        mapping.check_hf_coverage(bound, names, "ckpt")
    # a tied checkpoint given to an untied config: lm_head missing
    with pytest.raises(ValueError, match="lm_head.weight"):
        mapping.check_hf_coverage(bound, set(hf) - {"lm_head.weight"}, "ckpt")
    tied = mapping.bind_table(load_model_config("tiny-qwen3"))
    with pytest.raises(ValueError, match="no mapping rule consumes.*lm_head.weight"):
        mapping.check_hf_coverage(tied, hf, "ckpt")


def test_shape_mismatch_error():
    cfg = load_model_config("tiny-qwen3")
    hf = {k: tuple(v.shape) for k, v in random_hf(cfg).items()}
    hf["model.layers.0.self_attn.k_proj.weight"] = (256, 256)
    with pytest.raises(ValueError, match=r"k_proj.weight: expected shape \[128, 256\], got \[256, 256\]"):
        mapping.check_hf_shapes(mapping.bind_table(cfg), cfg, hf, "ckpt")


def test_unsupported_model_type_lists_supported():
    with pytest.raises(ValueError, match=r"mistral.*" + re.escape(str(sorted(families())))):
        mapping.get_table("mistral")


def test_tables_are_immutable():
    with pytest.raises(TypeError):
        families()["mistral"] = ()  # type: ignore[index]
    rule = mapping.get_table("qwen3")[0]
    with pytest.raises(Exception):
        rule.hf = "x"


def test_canonical_names():
    assert mapping.canonical_megatron_name("module.module.decoder.layers.1.mlp.linear_fc1.layer_norm_weight", 4) \
        == "decoder.layers.5.pre_mlp_layernorm.weight"
    assert mapping.canonical_megatron_name("decoder.layers.0.self_attention.linear_qkv.layer_norm_weight") \
        == "decoder.layers.0.input_layernorm.weight"
    assert mapping.canonical_megatron_name("output_layer.weight", 3) == "output_layer.weight"


@pytest.mark.parametrize("name", ["qwen3-32b", "qwq-32b", "qwen3-0.6b"])
def test_32b_shapes(name):
    cfg = load_model_config(name)
    shapes = {r.megatron: r.shard_shape(cfg, 8) for r in mapping.bind_table(cfg)}
    qkv = shapes["decoder.layers.63.self_attention.linear_qkv.weight"] if cfg.num_hidden_layers == 64 else None
    if name == "qwen3-32b":
        assert qkv == ((64 + 16) * 128 // 8, 5120)
        assert shapes["embedding.word_embeddings.weight"] == (152576 // 8, 5120)
    if name == "qwq-32b":
        assert qkv == ((40 + 16) * 128 // 8, 5120)
        assert shapes["decoder.layers.0.self_attention.linear_qkv.bias"] == ((40 + 16) * 128 // 8,)
        assert shapes["decoder.layers.0.mlp.linear_fc1.weight"] == (2 * 27648 // 8, 5120)


@pytest.mark.parametrize("name", ["qwq-32b", "qwen3-32b", *TINY])
def test_row_blocks_partition_every_hf_tensor_and_read_disjoint_megatron_rows(name):
    """megatron-to-hf copies these blocks as bytes: each HF row written once, each Megatron row read once."""
    cfg = load_model_config(name)
    for rule in (r for r in mapping.bind_table(cfg) if r.layer in (None, 0)):
        megatron_rows = rule.megatron_shape(cfg, 1)[0]
        used = []
        for hf_name, blocks in rule.hf_row_blocks(cfg).items():
            hf_rows = rule.hf_shapes(cfg)[hf_name][0]
            covered = sorted((dst, dst + rows) for _, rows, dst in blocks)
            assert covered[0][0] == 0 and covered[-1][1] == hf_rows, hf_name
            assert all(a[1] == b[0] for a, b in zip(covered, covered[1:])), hf_name
            used += [(start, start + rows) for start, rows, _ in blocks]
        used.sort()
        assert all(a[1] <= b[0] for a, b in zip(used, used[1:])) and (not used or used[-1][1] <= megatron_rows)
        if not isinstance(rule.rule, mapping.VocabEmbedding):
            assert sum(b - a for a, b in used) in (0, megatron_rows), rule.megatron  # all rows but vocab padding
