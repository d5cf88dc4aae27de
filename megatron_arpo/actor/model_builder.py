"""Build Megatron-Core GPT models from a model config (``model_configs/*.yaml``).

This is the only place that constructs Megatron's ``TransformerConfig``
(:func:`build_transformer_config`). Family-specific choices come from ``ARCHITECTURES``, a registry keyed
by the exact HF ``model_type`` (``qwen3``, ``qwen2``); a miss raises listing the supported types.

- ``qwen3``: q/k RMSNorm (``qk_layernorm``), no QKV bias, explicit ``head_dim`` (128 for every Qwen3 size,
  which is not ``hidden_size / num_attention_heads`` for 0.6B, 4B, 14B, 32B: ``kv_channels`` is always
  set from ``head_dim``).
- ``qwen2`` (QwQ-32B): QKV bias, no q/k norm.

Both: RMSNorm, SwiGLU MLP (``gated_linear_unit`` + silu), no other linear bias, RoPE with
``rotary_base = rope_theta``, grouped-query attention, no dropout.

Layer specs: on CPU the local spec (pure Megatron modules, torch RMSNorm); on GPU, when Transformer Engine
is importable, the TE spec. ``use_te=None`` picks TE exactly when it is importable and CUDA is available.

Parameter names the local spec produces (verified by building tiny-qwen3 / tiny-qwq, see
tests/unit/test_model_builder.py); ``N`` is the layer index local to the pipeline stage:

    embedding.word_embeddings.weight                      [vocab_padded/tp, hidden]  (first stage)
    decoder.layers.N.input_layernorm.weight               [hidden]
    decoder.layers.N.self_attention.linear_qkv.weight     [(heads + 2*kv_heads)*head_dim/tp, hidden]
    decoder.layers.N.self_attention.linear_qkv.bias       [(heads + 2*kv_heads)*head_dim/tp]  (qwen2)
    decoder.layers.N.self_attention.q_layernorm.weight    [head_dim]                 (qwen3)
    decoder.layers.N.self_attention.k_layernorm.weight    [head_dim]                 (qwen3)
    decoder.layers.N.self_attention.linear_proj.weight    [hidden, heads*head_dim/tp]
    decoder.layers.N.pre_mlp_layernorm.weight             [hidden]
    decoder.layers.N.mlp.linear_fc1.weight                [2*ffn/tp, hidden]  (gate rows, then up rows)
    decoder.layers.N.mlp.linear_fc2.weight                [hidden, ffn/tp]
    decoder.final_layernorm.weight                        [hidden]                   (last stage)
    output_layer.weight                                   [vocab_padded/tp, hidden]  (last stage)

``linear_qkv`` rows are grouped per query group: for each kv head, its ``heads/kv_heads`` q heads, then
its k head, then its v head (each ``head_dim`` rows); TP splits whole groups. ``output_layer.weight`` is
absent when embeddings are tied, except on the last stage of a PP>1 model, where it is a copy of the
word embeddings that Megatron keeps in sync. ``state_dict()`` also holds ``linear_*._extra_state`` (and
``output_layer._extra_state``) entries whose value is None under the local spec; skip them.

Under the TE spec the two pre-norms are fused into the following linear layer:
``input_layernorm.weight`` becomes ``self_attention.linear_qkv.layer_norm_weight`` and
``pre_mlp_layernorm.weight`` becomes ``mlp.linear_fc1.layer_norm_weight``; everything else keeps its
name (q/k layernorms stay separate modules).

Callers initialise Megatron's parallel state first (:func:`initialize_model_parallel`). On CPU, call
``cpu_compat.apply_cpu_compat()`` before building, and pass :func:`causal_attention_mask` to forward.
"""

from __future__ import annotations

import importlib.util
import logging
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn.functional as F

from megatron_arpo.model_config import ModelConfig

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Architecture:
    """What a model family needs from Megatron beyond the shared Qwen-style fields."""

    qk_layernorm: bool
    add_qkv_bias: bool


ARCHITECTURES: Mapping[str, Architecture] = {
    "qwen3": Architecture(qk_layernorm=True, add_qkv_bias=False),
    "qwen2": Architecture(qk_layernorm=False, add_qkv_bias=True),
}


def get_architecture(model_cfg: ModelConfig) -> Architecture:
    try:
        arch = ARCHITECTURES[model_cfg.model_type]
    except KeyError:
        raise ValueError(
            f"model config {model_cfg.name!r}: unsupported model_type {model_cfg.model_type!r}; "
            f"supported model types: {sorted(ARCHITECTURES)}"
        ) from None
    if (model_cfg.qk_layernorm, model_cfg.attention_bias) != (arch.qk_layernorm, arch.add_qkv_bias):
        raise ValueError(
            f"model config {model_cfg.name!r}: model_type {model_cfg.model_type!r} needs qk_layernorm="
            f"{arch.qk_layernorm} and attention_bias={arch.add_qkv_bias}, got qk_layernorm="
            f"{model_cfg.qk_layernorm} and attention_bias={model_cfg.attention_bias}"
        )
    return arch


def resolve_use_te(use_te: bool | None) -> bool:
    """``None`` means: Transformer Engine when it is importable and CUDA is available."""
    if use_te is None:
        return torch.cuda.is_available() and importlib.util.find_spec("transformer_engine") is not None
    return bool(use_te)


def build_transformer_config(
    model_cfg: ModelConfig,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    recompute: bool = False,
    use_te: bool | None = None,
):
    """Map a model config onto Megatron's ``TransformerConfig`` (the only place that builds one)."""
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    arch = get_architecture(model_cfg)
    use_te = resolve_use_te(use_te)
    if params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params_dtype {params_dtype} is not supported; use torch.float32, bfloat16 or float16")
    if model_cfg.num_key_value_heads % tensor_parallel:
        raise ValueError(
            f"model config {model_cfg.name!r}: num_key_value_heads {model_cfg.num_key_value_heads} is not "
            f"divisible by tensor_parallel {tensor_parallel}; pick a tensor_parallel that divides it"
        )
    if model_cfg.num_hidden_layers % pipeline_parallel:
        raise ValueError(
            f"model config {model_cfg.name!r}: num_hidden_layers {model_cfg.num_hidden_layers} is not "
            f"divisible by pipeline_parallel {pipeline_parallel}"
        )
    recompute_kwargs = (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
        if recompute else {}
    )
    return TransformerConfig(
        num_layers=model_cfg.num_hidden_layers,
        hidden_size=model_cfg.hidden_size,
        ffn_hidden_size=model_cfg.intermediate_size,
        num_attention_heads=model_cfg.num_attention_heads,
        num_query_groups=model_cfg.num_key_value_heads,
        kv_channels=model_cfg.head_dim,  # explicit: Qwen3 head_dim != hidden_size / heads
        normalization="RMSNorm",
        layernorm_epsilon=model_cfg.rms_norm_eps,
        gated_linear_unit=True,
        activation_func=F.silu,
        add_bias_linear=False,
        add_qkv_bias=arch.add_qkv_bias,
        qk_layernorm=arch.qk_layernorm,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        sequence_parallel=sequence_parallel and tensor_parallel > 1,
        params_dtype=params_dtype,
        pipeline_dtype=params_dtype,
        bf16=params_dtype == torch.bfloat16,
        fp16=params_dtype == torch.float16,
        # CPU has none of the fused kernels (apex / TE / custom CUDA); TE brings its own attention,
        # RoPE and norm fusions through the spec. gradient_accumulation_fusion needs apex's or TE's
        # fused wgrad kernel and is left off everywhere until it is measured on GPU.
        attention_backend=AttnBackend.auto if use_te else AttnBackend.local,
        gradient_accumulation_fusion=False,
        masked_softmax_fusion=False,
        persist_layer_norm=False,
        bias_activation_fusion=use_te,
        bias_dropout_fusion=use_te,
        apply_rope_fusion=use_te,
        **recompute_kwargs,
    )


def get_layer_spec(model_cfg: ModelConfig, use_te: bool | None = None):
    """The decoder layer spec: Transformer Engine modules on GPU, local Megatron modules on CPU."""
    from megatron.core.models.gpt import gpt_layer_specs

    arch = get_architecture(model_cfg)
    if resolve_use_te(use_te):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=arch.qk_layernorm)
    return gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=arch.qk_layernorm, normalization="RMSNorm")


def build_gpt_model(
    model_cfg: ModelConfig,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    params_dtype: torch.dtype = torch.float32,
    use_te: bool | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    recompute: bool = False,
):
    """A ``GPTModel`` for this rank's pipeline stage (parallel state must already be initialised)."""
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_gpt_model needs Megatron's parallel state; call initialize_model_parallel first")
    for name, want, have in (
        ("tensor_parallel", tensor_parallel, parallel_state.get_tensor_model_parallel_world_size()),
        ("pipeline_parallel", pipeline_parallel, parallel_state.get_pipeline_model_parallel_world_size()),
    ):
        if want != have:
            raise ValueError(f"build_gpt_model({name}={want}) but parallel state was initialised with {have}")
    use_te = resolve_use_te(use_te)
    config = build_transformer_config(
        model_cfg, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
        params_dtype=params_dtype, recompute=recompute, use_te=use_te,
    )
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    return GPTModel(
        config=config,
        transformer_layer_spec=get_layer_spec(model_cfg, use_te),
        vocab_size=model_cfg.padded_vocab_size(tensor_parallel),
        max_sequence_length=model_cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=model_cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model_cfg.rope_theta),
    )


def place_model(model, config):
    """This rank's stage on its GPU in its training precision, as Megatron's own ``get_model`` does.

    ``build_gpt_model`` allocates the tensor-parallel weights on the current device in ``params_dtype``,
    but modules built with plain torch (the local spec's RMSNorm weights) start on the CPU in fp32: the
    whole stage is moved to ``torch.cuda.current_device()`` when CUDA is available, then wrapped in
    ``Float16Module`` for bf16/fp16 (casts every parameter, feeds the first stage half precision inputs
    and returns fp32 outputs from the last). Returns the module to train or run; the bare ``GPTModel``
    stays what checkpoints, conversion and export use.
    """
    if torch.cuda.is_available():
        model.cuda(torch.cuda.current_device())
    if config.bf16 or config.fp16:
        from megatron.core.transformer.module import Float16Module

        return Float16Module(config, model)
    return model


def causal_attention_mask(seq_len: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """[1, 1, s, s] bool, True where attention is masked (a key after the query): GPTModel's convention."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def initialize_model_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 0) -> None:
    """Set up Megatron's TP/PP/DP groups on the current default process group and seed its RNG tracker.

    Seeds as Megatron's training entry does: each pipeline stage gets ``seed + 100 * pp_rank``; the
    tracker's model-parallel stream adds the TP rank, so TP shards are initialised differently.
    """
    from megatron.core import parallel_state, tensor_parallel as mcore_tp

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
    )
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(stage_seed)
    mcore_tp.model_parallel_cuda_manual_seed(stage_seed)
