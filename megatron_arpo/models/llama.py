"""Llama 3.x (``model_type: llama``): Llama-3.1-8B and ARPO's Llama3.1-8B checkpoint.

The Qwen2 decoder without biases: RMSNorm pre-norm, grouped-query attention with no q/k/v bias
(``attention_bias: false``) and no q/k norm, SwiGLU MLP without bias (``mlp_bias: false``), untied output
layer at 8B. ``head_dim`` is ``hidden_size / num_attention_heads`` unless config.json sets it.

RoPE: ``rope_theta`` 500000 with ``rope_scaling`` of type ``llama3`` (factor 8, low/high frequency
factors 1 and 4, original context 8192 for 3.1/3.2/3.3). All four parameters are carried from the
config to Megatron (:func:`megatron_arpo.actor.model_builder.apply_rope_scaling`) and to config.json,
which vLLM and transformers read; Llama 3.0's plain RoPE (``rope_scaling: null``) works too. The HF
checkpoints' q/k rows are already in the rotate-half order Megatron's (non-interleaved) RoPE uses, so
the mapping is the plain fused-QKV one.
"""

from __future__ import annotations

from megatron_arpo.models.family import ModelFamily
from megatron_arpo.models.rules import ATTENTION_IN, ATTENTION_OUT_MLP, EMBEDDING, FINAL

FAMILY = ModelFamily(
    model_type="llama",
    hf_architecture="LlamaForCausalLM",
    table=EMBEDDING + ATTENTION_IN + ATTENTION_OUT_MLP + FINAL,
    transformer_config={"qk_layernorm": False, "add_qkv_bias": False},
    implicit_fields={"qk_layernorm": False, "attention_bias": False},
    required_hf_values={"mlp_bias": False},
    extra_hf_fields={"attention_dropout": 0.0, "mlp_bias": False, "pretraining_tp": 1, "use_cache": True,
                     "initializer_range": 0.02},
    rope_types=("llama3",),
)
