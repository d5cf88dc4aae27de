"""Qwen3 (``model_type: qwen3``, Qwen/Qwen3-0.6B ... 32B and ARPO's Qwen3 checkpoints).

q/k RMSNorm on every head (``qk_layernorm``), no QKV bias, and an explicit ``head_dim`` (128 for every
size, which is not ``hidden_size / num_attention_heads`` for 0.6B, 4B, 14B and 32B). Plain RoPE
(``rope_scaling: null`` in every release); small sizes tie the output layer to the embeddings.
"""

from __future__ import annotations

from typing import Any, Mapping

from megatron_arpo.models.family import ModelFamily
from megatron_arpo.models.rules import ATTENTION_IN, ATTENTION_OUT_MLP, EMBEDDING, FINAL, QK_NORM


def _derived_hf_fields(cfg) -> Mapping[str, Any]:
    return {"max_window_layers": cfg.num_hidden_layers}


FAMILY = ModelFamily(
    model_type="qwen3",
    hf_architecture="Qwen3ForCausalLM",
    table=EMBEDDING + ATTENTION_IN + QK_NORM + ATTENTION_OUT_MLP + FINAL,
    transformer_config={"qk_layernorm": True, "add_qkv_bias": False},
    implicit_fields={"qk_layernorm": True, "attention_bias": False},
    required_hf_values={"use_sliding_window": False},
    extra_hf_fields={"attention_dropout": 0.0, "sliding_window": None, "use_sliding_window": False,
                     "use_cache": True, "initializer_range": 0.02},
    derived_hf_fields=_derived_hf_fields,
)
