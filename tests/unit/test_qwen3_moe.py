"""The qwen3_moe family: config conventions, refusals, and the per-expert mapping table (HF <-> Megatron).

The table is checked against what transformers writes for ``Qwen3MoeForCausalLM`` (``save_pretrained``:
per-expert ``gate_proj``/``up_proj``/``down_proj`` tensors, as the published checkpoints have; the
in-memory module of transformers 5 fuses them), and the in-memory conversion round trips bit-exactly
with experts spread over expert-parallel ranks.
"""

from __future__ import annotations

import pytest
import torch
import yaml
from safetensors import safe_open

from megatron_arpo.hf import mapping
from megatron_arpo.model_config import (MODEL_CONFIG_DIR, check_hf_config, hf_config_dict, load_model_config,
                                        model_config_from_hf)
from megatron_arpo.models.registry import get_family

TINY = "tiny-qwen3-moe"


def _random_hf(cfg, seed=0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = get_family(cfg.model_type).hf_tensor_shapes(cfg)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def _write_yaml(tmp_path, **change):
    data = {**yaml.safe_load((MODEL_CONFIG_DIR / f"{TINY}.yaml").read_text()), **change}
    data = {k: v for k, v in data.items() if v is not None}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    return path


def test_table_names_what_transformers_saves(tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = load_model_config(TINY)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(**hf_config_dict(cfg)))
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    model.save_pretrained(tmp_path / "hf")
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as fh:
        saved = {name: tuple(fh.get_slice(name).get_shape()) for name in fh.keys()}
    assert saved == get_family(cfg.model_type).hf_tensor_shapes(cfg)
    assert "model.layers.1.mlp.experts.3.down_proj.weight" in saved
    bound = mapping.bind_table(cfg)
    mapping.check_hf_coverage(bound, saved, "saved Qwen3MoeForCausalLM")
    mapping.check_hf_shapes(bound, cfg, saved, "saved Qwen3MoeForCausalLM")


def test_megatron_names_are_per_expert():
    cfg = load_model_config(TINY)
    names = [rule.megatron for rule in mapping.bind_table(cfg) if rule.layer == 0]
    assert "decoder.layers.0.mlp.router.weight" in names
    assert [n for n in names if n.endswith("linear_fc1.weight")] == [
        f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(4)]
    assert not any(n == "decoder.layers.0.mlp.linear_fc1.weight" for n in names)


@pytest.mark.parametrize(("tp", "pp", "ep"), [(1, 1, 1), (2, 1, 2), (2, 2, 2), (1, 2, 4)])
def test_round_trip_bit_exact_with_expert_parallelism(tp, pp, ep):
    cfg = load_model_config(TINY)
    hf = _random_hf(cfg)
    states = mapping.hf_to_megatron_states(hf, cfg, tp, pp, ep)
    back = mapping.megatron_states_to_hf(states, cfg, tp, pp, ep)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def test_each_ep_rank_holds_its_own_experts_under_local_indices():
    cfg = load_model_config(TINY)
    hf = _random_hf(cfg)
    states = mapping.hf_to_megatron_states(hf, cfg, 2, 1, 2)
    rank = states[(0, 1, 1)]  # pp 0, tp 1, ep 1: global experts 2 and 3 as local 0 and 1
    assert sorted(n for n in rank if ".local_experts." in n and n.startswith("decoder.layers.0.")) == [
        f"decoder.layers.0.mlp.experts.local_experts.{i}.{m}.weight" for i in (0, 1) for m in ("linear_fc1",
                                                                                                 "linear_fc2")]
    h = "model.layers.0.mlp.experts.2."
    ffn = cfg.moe_intermediate_size
    want = torch.cat([hf[h + "gate_proj.weight"][ffn // 2:], hf[h + "up_proj.weight"][ffn // 2:]])
    assert torch.equal(rank["decoder.layers.0.mlp.experts.local_experts.0.linear_fc1.weight"], want)
    assert torch.equal(rank["decoder.layers.0.mlp.router.weight"], hf["model.layers.0.mlp.gate.weight"])
    # A swap of two experts' local indices on one EP rank is a wrong model: the round trip catches it.
    fc1 = "decoder.layers.0.mlp.experts.local_experts.{}.linear_fc1.weight"
    for tp_rank in (0, 1):
        r = states[(0, tp_rank, 1)]
        r[fc1.format(0)], r[fc1.format(1)] = r[fc1.format(1)], r[fc1.format(0)]
    back = mapping.megatron_states_to_hf(states, cfg, 2, 1, 2)
    assert not torch.equal(back[h + "gate_proj.weight"], hf[h + "gate_proj.weight"])


def test_experts_not_divisible_by_ep_is_refused():
    cfg = load_model_config(TINY)
    with pytest.raises(ValueError, match="num_experts 4 is not divisible by expert-parallel size 3"):
        mapping.hf_to_megatron_states(_random_hf(cfg), cfg, 1, 1, 3)


def test_canonical_name_shifts_the_local_expert_index():
    name = "module.decoder.layers.1.mlp.experts.local_experts.1.linear_fc2.weight"
    assert mapping.canonical_megatron_name(name, 2, 64) == "decoder.layers.3.mlp.experts.local_experts.65.linear_fc2.weight"
    assert mapping.canonical_megatron_name("decoder.layers.0.mlp.router.weight", 0, 64) == \
        "decoder.layers.0.mlp.router.weight"


def test_hf_config_round_trip_and_transformers5_spelling():
    cfg = load_model_config("qwen3-30b-a3b")
    hf = hf_config_dict(cfg)
    assert hf["mlp_only_layers"] == [] and hf["num_experts"] == 128 and hf["max_window_layers"] == 48
    check_hf_config(cfg, hf)
    v5 = {k: v for k, v in hf.items() if k != "num_experts"} | {"num_local_experts": 128}
    assert model_config_from_hf(v5).num_experts == 128
    # transformers' Qwen3MoeConfig assumes norm_topk_prob false when config.json omits it
    assert model_config_from_hf({k: v for k, v in hf.items() if k != "norm_topk_prob"}).norm_topk_prob is False


def test_moe_checkpoint_against_a_dense_yaml_is_refused():
    with pytest.raises(ValueError, match="model_type: model config says 'qwen3', .* says 'qwen3_moe'"):
        check_hf_config(load_model_config("qwen3-4b"), hf_config_dict(load_model_config("qwen3-30b-a3b")))


@pytest.mark.parametrize(("change", "expected"), [
    ({"decoder_sparse_step": 2}, "always has decoder_sparse_step=1, but the config says 2; set decoder_sparse_step: 1"),
    ({"mlp_only_layers": [0]}, "always has mlp_only_layers=[], but the config says [0]; set mlp_only_layers: []"),
    ({"num_experts": None}, "is a mixture-of-experts model and needs ['num_experts']"),
    ({"num_experts_per_tok": 5}, "num_experts_per_tok 5 exceeds num_experts 4"),
    ({"mlp_only_layers": "none"}, "mlp_only_layers must be a list of layer indices"),
    ({"model_type": "qwen3"}, "is a dense model, but the config sets the mixture-of-experts field(s)"),
])
def test_invalid_moe_yaml(tmp_path, change, expected):
    with pytest.raises(ValueError) as info:
        load_model_config(_write_yaml(tmp_path, **change))
    assert expected in str(info.value)
