"""Qwen2 (``model_type: qwen2``): QwQ-32B and the Qwen2.5 series (ARPO's Qwen2.5-3B/7B checkpoints).

Bias on the q/k/v projections (always: Qwen2's config.json has no ``attention_bias`` key), no q/k norm,
``head_dim`` derived as ``hidden_size / num_attention_heads``. Plain RoPE. Sliding-window attention is
off in every release (``use_sliding_window: false``; ``sliding_window`` and ``max_window_layers`` are
then unused); a checkpoint that turns it on is refused. Qwen2.5 <= 3B ties the output layer to the
embeddings.
"""

from __future__ import annotations

from typing import Any, Mapping

from megatron_arpo.models.family import ModelFamily
from megatron_arpo.models.rules import ATTENTION_IN, ATTENTION_OUT_MLP, EMBEDDING, FINAL, QKV_BIAS


def _derived_hf_fields(cfg) -> Mapping[str, Any]:
    return {"max_window_layers": cfg.num_hidden_layers, "sliding_window": cfg.max_position_embeddings}


FAMILY = ModelFamily(
    model_type="qwen2",
    hf_architecture="Qwen2ForCausalLM",
    table=EMBEDDING + ATTENTION_IN + QKV_BIAS + ATTENTION_OUT_MLP + FINAL,
    transformer_config={"qk_layernorm": False, "add_qkv_bias": True},
    implicit_fields={"qk_layernorm": False, "attention_bias": True},
    required_hf_values={"use_sliding_window": False},
    hf_omitted_fields=("attention_bias",),
    extra_hf_fields={"attention_dropout": 0.0, "use_sliding_window": False, "use_cache": True,
                     "initializer_range": 0.02},
    derived_hf_fields=_derived_hf_fields,
    head_dim_derived=True,
)
