"""Model config -> Megatron TransformerConfig / layer spec mapping (config objects only, no weights)."""

from __future__ import annotations

import dataclasses
import re

import pytest
import torch
import torch.nn.functional as F

from megatron_arpo.actor import model_builder
from megatron_arpo.model_config import load_model_config
from megatron_arpo.models.registry import families


@pytest.mark.parametrize("name", ["qwen3-32b", "qwq-32b", "qwen3-0.6b"])
def test_kv_channels_is_head_dim(name):
    cfg = load_model_config(name)
    tc = model_builder.build_transformer_config(cfg, tensor_parallel=8, pipeline_parallel=4,
                                                params_dtype=torch.bfloat16, use_te=False)
    assert tc.kv_channels == 128
    # qwen3-0.6b: 16 heads * 128 = 2048 != hidden 1024, so the explicit head_dim matters.
    assert tc.kv_channels == cfg.head_dim
    assert tc.num_query_groups == cfg.num_key_value_heads
    assert tc.num_attention_heads == cfg.num_attention_heads
    assert tc.ffn_hidden_size == cfg.intermediate_size
    assert tc.num_layers == cfg.num_hidden_layers
    assert tc.layernorm_epsilon == cfg.rms_norm_eps
    assert tc.tensor_model_parallel_size == 8 and tc.pipeline_model_parallel_size == 4
    assert tc.bf16 and not tc.fp16 and tc.params_dtype == torch.bfloat16


def test_family_flags():
    qwen3 = model_builder.build_transformer_config(load_model_config("qwen3-32b"), use_te=False)
    qwq = model_builder.build_transformer_config(load_model_config("qwq-32b"), use_te=False)
    assert qwen3.qk_layernorm and not qwen3.add_qkv_bias
    assert qwq.add_qkv_bias and not qwq.qk_layernorm
    for tc in (qwen3, qwq):
        assert tc.normalization == "RMSNorm"
        assert tc.gated_linear_unit and tc.activation_func is F.silu
        assert not tc.add_bias_linear
        assert tc.hidden_dropout == 0.0 and tc.attention_dropout == 0.0
        assert not tc.bf16 and not tc.fp16 and tc.params_dtype == torch.float32
        # CPU: no fused kernels.
        assert not (tc.gradient_accumulation_fusion or tc.masked_softmax_fusion or tc.persist_layer_norm
                    or tc.bias_activation_fusion or tc.bias_dropout_fusion or tc.apply_rope_fusion)


def test_fp16_and_recompute_flags():
    tc = model_builder.build_transformer_config(load_model_config("tiny-qwen3"), params_dtype=torch.float16,
                                                recompute="full", use_te=False)
    assert tc.fp16 and not tc.bf16
    assert tc.recompute_granularity == "full"


def test_unknown_model_type_lists_supported():
    cfg = dataclasses.replace(load_model_config("tiny-qwen3"), model_type="mistral")
    with pytest.raises(ValueError, match=r"unsupported model_type 'mistral'.*" + re.escape(str(sorted(families())))):
        model_builder.build_transformer_config(cfg, use_te=False)


def test_bad_layouts_name_the_key_and_valid_values():
    cfg = load_model_config("tiny-qwen3")  # 4 heads, 2 kv heads, 2 layers
    with pytest.raises(ValueError, match=r"actor.tensor_parallel: 4 does not divide tiny-qwen3 num_key_value_heads 2; "
                                         r"valid values: \[1, 2\]"):
        model_builder.build_transformer_config(cfg, tensor_parallel=4, use_te=False)
    with pytest.raises(ValueError, match=r"actor.tensor_parallel: 3 does not divide tiny-qwen3 num_attention_heads 4"):
        model_builder.build_transformer_config(cfg, tensor_parallel=3, use_te=False)
    with pytest.raises(ValueError, match=r"actor.pipeline_parallel: 3 does not divide tiny-qwen3 num_hidden_layers 2; "
                                         r"valid values: \[1, 2\]"):
        model_builder.build_transformer_config(cfg, pipeline_parallel=3, use_te=False)
    with pytest.raises(ValueError, match=r"actor.sequence_parallel: true needs actor.tensor_parallel > 1.*"
                                         r"actor.tensor_parallel to one of \[2\]"):
        model_builder.build_transformer_config(cfg, sequence_parallel=True, use_te=False)
    qwq = load_model_config("qwq-32b")  # 40 heads, 8 kv heads, 64 layers
    with pytest.raises(ValueError, match=r"valid values: \[1, 2, 4, 8\]"):
        model_builder.build_transformer_config(qwq, tensor_parallel=16, use_te=False)
    with pytest.raises(ValueError, match=r"valid values: \[1, 2, 4, 8, 16, 32, 64\]"):
        model_builder.build_transformer_config(qwq, pipeline_parallel=3, use_te=False)


@pytest.mark.parametrize("mode,granularity,modules", [("none", None, None), ("selective", "selective", ["core_attn"]),
                                                       ("full", "full", None)])
def test_recompute_modes_reach_transformer_config(mode, granularity, modules):
    tc = model_builder.build_transformer_config(load_model_config("tiny-qwen3"), recompute=mode, use_te=False)
    assert tc.recompute_granularity == granularity
    if modules is not None:
        assert tc.recompute_modules == modules
    if mode == "full":
        assert (tc.recompute_method, tc.recompute_num_layers) == ("uniform", 1)
    with pytest.raises(ValueError, match=r"actor.recompute: 'some' is not supported; allowed: \['none', 'selective', 'full'\]"):
        model_builder.build_transformer_config(load_model_config("tiny-qwen3"), recompute="some", use_te=False)


def test_sequence_parallel_reaches_transformer_config():
    cfg = load_model_config("tiny-qwen3")
    assert model_builder.build_transformer_config(cfg, tensor_parallel=2, sequence_parallel=True, use_te=False
                                                  ).sequence_parallel
    assert not model_builder.build_transformer_config(cfg, tensor_parallel=2, use_te=False).sequence_parallel


def test_local_spec_norms_carry_the_sequence_parallel_mark():
    """Megatron sums over TP the grads of parameters marked ``sequence_parallel`` (finalize_model_grads);
    torch's WrappedTorchNorm refuses SP outright, our TorchRMSNorm marks its weight instead."""
    cfg = load_model_config("tiny-qwen3")
    for sp in (True, False):
        tc = model_builder.build_transformer_config(cfg, tensor_parallel=2, sequence_parallel=sp, use_te=False)
        norm = model_builder.TorchRMSNorm(tc, hidden_size=cfg.hidden_size, eps=cfg.rms_norm_eps)
        assert isinstance(norm, torch.nn.RMSNorm) and norm.eps == cfg.rms_norm_eps
        assert norm.weight.sequence_parallel is sp
    spec = model_builder.get_layer_spec(cfg, use_te=False)
    attn = spec.submodules.self_attention.submodules
    for built in (spec.submodules.input_layernorm, spec.submodules.pre_mlp_layernorm, attn.q_layernorm,
                  attn.k_layernorm):
        assert built is model_builder.TorchRMSNorm


def test_local_layer_spec_follows_family():
    from megatron.core.transformer.identity_op import IdentityOp

    qwen3 = model_builder.get_layer_spec(load_model_config("tiny-qwen3"), use_te=False)
    qwq = model_builder.get_layer_spec(load_model_config("tiny-qwq"), use_te=False)
    attn3 = qwen3.submodules.self_attention.submodules
    attn2 = qwq.submodules.self_attention.submodules
    assert attn3.q_layernorm is not IdentityOp and attn3.k_layernorm is not IdentityOp
    assert attn2.q_layernorm is IdentityOp and attn2.k_layernorm is IdentityOp
    # Local spec: separate norm modules (the TE spec fuses them into linear_qkv / linear_fc1).
    assert qwen3.submodules.input_layernorm is not IdentityOp
    assert qwen3.submodules.pre_mlp_layernorm is not IdentityOp


def test_use_te_auto_is_off_without_cuda():
    assert torch.cuda.is_available() or model_builder.resolve_use_te(None) is False
    assert model_builder.resolve_use_te(True) is True


def test_use_te_auto_on_a_gpu_box_without_te_is_loud_or_refuses(monkeypatch, caplog):
    """The TE selection logic for a GPU machine (which cannot run here): CUDA present, TE absent."""
    import importlib.util

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name == "transformer_engine" else real_find_spec(name, *a))
    with caplog.at_level("WARNING", logger=model_builder.__name__):
        assert model_builder.resolve_use_te(None, micro_batch_tokens=4096) is False
    assert "FALLING BACK TO THE LOCAL LAYER SPEC" in caplog.text
    with pytest.raises(ValueError, match=r"actor.use_te: auto found CUDA but no Transformer Engine.*"
                                         r"actor.micro_batch_tokens 20480.*pip install 'megatron-arpo\[gpu\]'.*"
                                         r"actor.use_te: false"):
        model_builder.resolve_use_te(None, micro_batch_tokens=20480)
    # An explicit choice is taken as given, quietly.
    caplog.clear()
    assert model_builder.resolve_use_te(False, micro_batch_tokens=20480) is False and not caplog.text
    # With TE importable, auto picks it.
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: object() if name == "transformer_engine" else real_find_spec(name, *a))
    assert model_builder.resolve_use_te(None, micro_batch_tokens=20480) is True


def test_causal_mask_convention():
    mask = model_builder.causal_attention_mask(4)
    assert mask.shape == (1, 1, 4, 4) and mask.dtype == torch.bool
    # True = masked: query i may not see key j > i.
    assert mask[0, 0, 0, 1] and not mask[0, 0, 1, 0] and not mask[0, 0, 2, 2]
    assert int(mask.sum()) == 6


def test_llama3_rope_scaling_uses_every_parameter():
    """Megatron's RotaryEmbedding, rescaled by apply_rope_scaling, has transformers' llama3 frequencies exactly;
    Megatron's own rope_scaling switch (factor only, Llama 3.1 defaults for the rest) does not, for tiny-llama."""
    from types import SimpleNamespace

    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from megatron_arpo.model_config import hf_config_dict

    cfg = load_model_config("tiny-llama")
    hf_inv_freq, _ = ROPE_INIT_FUNCTIONS["llama3"](AutoConfig.for_model(**hf_config_dict(cfg)), "cpu")

    def rotary(**scaling):
        return RotaryEmbedding(kv_channels=cfg.head_dim, rotary_percent=1.0, rotary_base=int(cfg.rope_theta),
                               use_cpu_initialization=True, **scaling)

    model = SimpleNamespace(rotary_pos_emb=rotary())
    model_builder.apply_rope_scaling(model, cfg)
    assert torch.equal(model.rotary_pos_emb.inv_freq, hf_inv_freq.float())
    switch_only = rotary(rope_scaling=True, rope_scaling_factor=cfg.rope_scaling.factor).inv_freq
    assert (switch_only - hf_inv_freq).abs().max() > 1e-3
    unscaled = SimpleNamespace(rotary_pos_emb=rotary())
    model_builder.apply_rope_scaling(unscaled, load_model_config("tiny-qwen3"))  # plain RoPE: untouched
    assert torch.equal(unscaled.rotary_pos_emb.inv_freq, rotary().inv_freq)
