"""The architecture of one model, as a typed value: :class:`ModelConfig` (HF field names) and its parts.

Plain frozen dataclasses, no behaviour beyond derived sizes: loading and validating model YAMLs, and the
HF ``config.json`` side, are :mod:`megatron_arpo.model_config`; what a family is, :mod:`.family`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeScaling:
    """HF ``rope_scaling`` (``rope_parameters`` in transformers >= 5) of type ``llama3`` (Llama 3.1+).

    Frequencies with wavelength above ``original_max_position_embeddings / low_freq_factor`` are divided
    by ``factor``, those below ``original_max_position_embeddings / high_freq_factor`` kept, the band
    between interpolated smoothly (transformers' ``_compute_llama3_parameters``).
    """

    rope_type: str
    factor: float
    low_freq_factor: float
    high_freq_factor: float
    original_max_position_embeddings: int

    def to_hf(self) -> dict[str, Any]:
        return {"factor": self.factor, "low_freq_factor": self.low_freq_factor,
                "high_freq_factor": self.high_freq_factor,
                "original_max_position_embeddings": self.original_max_position_embeddings,
                "rope_type": self.rope_type}


@dataclass(frozen=True)
class ParallelDefaults:
    """Default parallelism for a model of this size (overridable in the experiment config)."""

    actor_tensor_parallel: int = 1
    actor_pipeline_parallel: int = 1
    rollout_tensor_parallel: int = 1


# The ModelConfig fields of a mixture-of-experts model (None in dense families), in config.json order.
MOE_FIELDS = ("num_experts", "num_experts_per_tok", "moe_intermediate_size", "norm_topk_prob",
              "router_aux_loss_coef", "decoder_sparse_step", "mlp_only_layers")


@dataclass(frozen=True)
class ModelConfig:
    """The architecture of one model, with HF field names."""

    name: str
    model_type: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_layernorm: bool
    rope_scaling: RopeScaling | None = None
    hidden_act: str = "silu"
    torch_dtype: str = "bfloat16"
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    # Megatron pads the embedding rows to a multiple of this times the tensor-parallel size.
    make_vocab_size_divisible_by: int = 128
    defaults: ParallelDefaults = field(default_factory=ParallelDefaults)
    # Mixture of experts (qwen3_moe); None in dense families. HF names: routed experts per MoE layer,
    # experts per token, each expert's FFN width, top-k weights renormalised, load-balancing loss weight,
    # and which layers are MoE (every decoder_sparse_step-th layer not in mlp_only_layers).
    num_experts: int | None = None
    num_experts_per_tok: int | None = None
    moe_intermediate_size: int | None = None
    norm_topk_prob: bool | None = None
    router_aux_loss_coef: float | None = None
    decoder_sparse_step: int | None = None
    mlp_only_layers: tuple[int, ...] | None = None

    @property
    def is_moe(self) -> bool:
        return self.num_experts is not None

    @property
    def num_query_groups(self) -> int:
        return self.num_key_value_heads

    def padded_vocab_size(self, tensor_parallel: int = 1) -> int:
        multiple = self.make_vocab_size_divisible_by * tensor_parallel
        return -(-self.vocab_size // multiple) * multiple

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)
