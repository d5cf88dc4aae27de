"""The registry-agreement test: every registered model family builds, maps both ways with full coverage, round-trips.

For each family in :func:`megatron_arpo.models.registry.families` (found from its module, so a new family is
covered without editing this file) and the tiny model YAML of that family:

- its mapping table names exactly the tensors of the HF model class transformers builds from the family's
  ``config.json`` (same names, same shapes, lm_head absent only when tied), and that class is the family's
  ``hf_architecture``;
- Megatron builds the family's model (``build_gpt_model``, TP=1, PP=1), whose parameters are exactly the
  table's Megatron names with the table's shapes, and a Megatron state made from HF tensors by the table
  loads into it strictly;
- HF -> Megatron -> HF through the table is bit-exact at TP=2 x PP=2.
"""

from __future__ import annotations

import pytest
import torch

from megatron_arpo.hf import mapping
from megatron_arpo.model_config import MODEL_CONFIG_DIR, hf_config_dict, load_model_config
from megatron_arpo.models.registry import families, get_family
from megatron_arpo.device.local_ranks import run_distributed


def _tiny_configs() -> dict[str, str]:
    """model_type -> the first tiny model YAML of that family (real-vocabulary ones are too slow here)."""
    out: dict[str, str] = {}
    for path in sorted(MODEL_CONFIG_DIR.glob("tiny-*.yaml")):
        if "qwen-vocab" not in path.stem:
            out.setdefault(load_model_config(path).model_type, path.stem)
    return out


TINY = _tiny_configs()
FAMILIES = sorted(families())


def _random_hf(cfg, seed=0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    shapes = get_family(cfg.model_type).hf_tensor_shapes(cfg)
    return {name: torch.randn(shape, generator=gen) for name, shape in shapes.items()}


def test_every_family_has_a_tiny_model():
    assert FAMILIES and sorted(TINY) == FAMILIES, f"families {FAMILIES}, tiny YAMLs for {sorted(TINY)}"


def _saved_shapes(model, tmp_path) -> dict[str, tuple[int, ...]]:
    """Names and shapes ``save_pretrained`` writes: transformers 5 fuses MoE experts in memory
    (``mlp.experts.gate_up_proj``) and writes them per expert, as the published checkpoints are."""
    from safetensors import safe_open

    model.save_pretrained(tmp_path)
    with safe_open(str(tmp_path / "model.safetensors"), "pt") as fh:
        return {name: tuple(fh.get_slice(name).get_shape()) for name in fh.keys()}


@pytest.mark.parametrize("model_type", FAMILIES)
def test_table_matches_the_hf_model_class(model_type, tmp_path):
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = load_model_config(TINY[model_type])
    fields = hf_config_dict(cfg)
    hf_config = AutoConfig.for_model(**fields)
    if cfg.is_moe:
        model = AutoModelForCausalLM.from_config(hf_config)
    else:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(hf_config)
    assert type(model).__name__ == get_family(cfg.model_type).hf_architecture
    hf_shapes = (_saved_shapes(model, tmp_path) if cfg.is_moe
                 else {name: tuple(t.shape) for name, t in model.state_dict().items()})
    if cfg.tie_word_embeddings:
        hf_shapes.pop("lm_head.weight", None)  # the same tensor as the embedding; tied checkpoints omit it
    assert hf_shapes == get_family(cfg.model_type).hf_tensor_shapes(cfg)
    # Coverage both ways against the real model's tensors, as the converters check it.
    bound = mapping.bind_table(cfg)
    mapping.check_hf_coverage(bound, hf_shapes, f"{model_type} HF model")
    mapping.check_hf_shapes(bound, cfg, hf_shapes, f"{model_type} HF model")


@pytest.mark.parametrize("model_type", FAMILIES)
def test_round_trip_tp2_pp2_bit_exact(model_type):
    cfg = load_model_config(TINY[model_type])
    hf = _random_hf(cfg)
    back = mapping.megatron_states_to_hf(mapping.hf_to_megatron_states(hf, cfg, 2, 2), cfg, 2, 2)
    assert sorted(back) == sorted(hf)
    for name, tensor in hf.items():
        assert torch.equal(back[name], tensor), name


def _build_and_load(rank: int, world_size: int, names: list[str]) -> dict[str, list[str]]:
    from megatron_arpo.actor import model_builder

    model_builder.initialize_model_parallel(1, 1, seed=0)
    problems: dict[str, list[str]] = {}
    for name in names:
        cfg = load_model_config(name)
        model = model_builder.build_gpt_model(cfg, use_te=False)
        params = {k: tuple(v.shape) for k, v in model.named_parameters()}
        bound = [r for r in mapping.bind_table(cfg) if not mapping.is_shared_output(r, cfg, 1)]
        issues = []
        try:
            mapping.check_megatron_coverage(bound, params, name)
        except ValueError as exc:
            issues.append(str(exc))
        issues += [f"{r.megatron}: model {params.get(r.megatron)}, table {r.shard_shape(cfg, 1)}"
                   for r in bound if params.get(r.megatron) not in (None, r.shard_shape(cfg, 1))]
        (state,) = mapping.hf_to_megatron_states(_random_hf(cfg), cfg, 1, 1).values()
        result = model.load_state_dict(state, strict=False)
        missing = [k for k in result.missing_keys if not k.endswith("_extra_state")]
        if missing or result.unexpected_keys:
            issues.append(f"load_state_dict: missing {missing}, unexpected {result.unexpected_keys}")
        problems[name] = issues
    return problems


def test_every_family_builds_in_megatron_with_the_tables_parameters():
    (problems,) = run_distributed(_build_and_load, 1, [TINY[t] for t in FAMILIES], timeout=240)
    assert sorted(problems) == sorted(TINY[t] for t in FAMILIES)
    assert all(not issues for issues in problems.values()), problems
