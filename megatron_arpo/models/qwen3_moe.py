"""Qwen3-MoE (``model_type: qwen3_moe``, Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B).

The Qwen3 attention (q/k RMSNorm per head, no QKV bias, explicit ``head_dim``, plain RoPE, untied output)
with every MLP replaced by routed experts: a linear router (HF ``mlp.gate``) scores ``num_experts``
SwiGLU experts of width ``moe_intermediate_size``, each token goes to its ``num_experts_per_tok`` best,
and with ``norm_topk_prob`` their softmax weights are renormalised to sum to one. No shared experts.

Megatron: softmax router in fp32 with top-k (``moe_router_pre_softmax`` off when ``norm_topk_prob``, which
is the same renormalised top-k), the auxiliary load-balancing loss weighted by ``router_aux_loss_coef``,
an all-to-all token dispatcher (all-gather on CPU: actor.model_builder), and one ``SequentialMLP`` module per expert (no grouped GEMM, so the
parameter names are per expert on both specs). Every released checkpoint makes every layer sparse
(``decoder_sparse_step: 1``, ``mlp_only_layers: []``); other values are refused.
"""

from __future__ import annotations

from typing import Any, Mapping

from megatron_arpo.models.family import ModelFamily
from megatron_arpo.models.rules import ATTENTION_IN, ATTENTION_OUT, EMBEDDING, FINAL, QK_NORM, ROUTED_EXPERTS


def _derived_hf_fields(cfg) -> Mapping[str, Any]:
    return {"max_window_layers": cfg.num_hidden_layers}


def _transformer_config(cfg) -> Mapping[str, Any]:
    """Megatron's MoE keywords for this model (``actor.model_builder`` adds the parallel sizes)."""
    return {
        "num_moe_experts": cfg.num_experts,
        "moe_router_topk": cfg.num_experts_per_tok,
        "moe_ffn_hidden_size": cfg.moe_intermediate_size,
        # top-k of the logits, then softmax over those k == HF's softmax, top-k, renormalise
        "moe_router_pre_softmax": not cfg.norm_topk_prob,
        "moe_router_score_function": "softmax",
        "moe_router_dtype": "fp32",  # HF computes the routing softmax in fp32
        "moe_router_load_balancing_type": "aux_loss",
        "moe_aux_loss_coeff": cfg.router_aux_loss_coef,
        "moe_token_dispatcher_type": "alltoall",
        "moe_grouped_gemm": False,
        "moe_shared_expert_intermediate_size": None,
    }


FAMILY = ModelFamily(
    model_type="qwen3_moe",
    hf_architecture="Qwen3MoeForCausalLM",
    table=EMBEDDING + ATTENTION_IN + QK_NORM + ATTENTION_OUT + ROUTED_EXPERTS + FINAL,
    transformer_config={"qk_layernorm": True, "add_qkv_bias": False},
    implicit_fields={"qk_layernorm": True, "attention_bias": False, "decoder_sparse_step": 1,
                     "mlp_only_layers": ()},
    required_hf_values={"use_sliding_window": False},
    extra_hf_fields={"attention_dropout": 0.0, "sliding_window": None, "use_sliding_window": False,
                     "output_router_logits": False, "use_cache": True, "initializer_range": 0.02},
    derived_hf_fields=_derived_hf_fields,
    moe=True,
    hf_defaults={"norm_topk_prob": False, "router_aux_loss_coef": 0.001},
    moe_transformer_config=_transformer_config,
)
