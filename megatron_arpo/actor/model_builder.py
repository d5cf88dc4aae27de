"""Build Megatron-Core GPT models from a model config (``model_configs/*.yaml``).

This is the only place that constructs Megatron's ``TransformerConfig``
(:func:`build_transformer_config`). What differs between model families (``qk_layernorm``,
``add_qkv_bias``) is data in the family's module (``megatron_arpo/models/<model_type>.py``,
``FAMILY.transformer_config``), found by the exact HF ``model_type``; nothing here branches on a family.
``kv_channels`` is always set from ``head_dim`` (Qwen3's 128 is not ``hidden_size / num_attention_heads``
for 0.6B, 4B, 14B, 32B).

Every family: RMSNorm, SwiGLU MLP (``gated_linear_unit`` + silu), no other linear bias, RoPE with
``rotary_base = rope_theta``, grouped-query attention, no dropout. RoPE scaling of type ``llama3``
(``rope_scaling`` in the model config): Megatron 0.16's ``RotaryEmbedding`` takes only ``rope_scaling``
(a switch) and ``rope_scaling_factor`` and applies its own defaults for the other three parameters
(``low_freq_factor=1``, ``high_freq_factor=4``, ``original_max_position_embeddings=8192``), so
:func:`apply_rope_scaling` recomputes the inverse frequencies with Megatron's own ``_apply_scaling`` and
every parameter of the config after the model is built (the logits parity tests use a tiny Llama whose
parameters differ from those defaults, so a dropped parameter fails them).

Layer specs: on CPU the local spec (pure Megatron modules, torch RMSNorm); on GPU, when Transformer Engine
is importable, the TE spec. ``use_te=None`` picks TE exactly when it is importable and CUDA is available;
on a GPU machine without TE it falls back to the local spec loudly, and refuses micro-batches of
``LOCAL_ATTENTION_MAX_TOKENS`` or more (:func:`resolve_use_te`): the local spec's attention keeps the
``s x s`` score matrix of every head, quadratic in the row length.

Sequence parallelism (``sequence_parallel=True``, needs TP > 1) reaches ``TransformerConfig``. Megatron's
local spec builds its norms with torch (``WrappedTorchNorm``), which refuses sequence parallelism: with
SP each TP rank normalises its own slice of the sequence, so the norm weights' gradients are partial
and must be summed over TP, which Megatron does for parameters marked ``sequence_parallel``.
:class:`TorchRMSNorm` is torch's ``RMSNorm`` with that mark; the local spec uses it for every norm,
including the final one (a block spec), so SP runs with the local spec too.

Recompute (``recompute``): ``"none"``; ``"selective"`` maps to Megatron's selective recompute of the
core attention (``recompute_modules=["core_attn"]``, its default: the ``s x s`` scores and softmax are
recomputed in backward, the linear layers' activations kept); ``"full"`` to full uniform recompute of
every layer (only each layer's input is kept).

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
    decoder.layers.N.mlp.router.weight                    [experts, hidden]          (qwen3_moe, in place
    decoder.layers.N.mlp.experts.local_experts.E.linear_fc1.weight  [2*moe_ffn/etp, hidden]  of the dense
    decoder.layers.N.mlp.experts.local_experts.E.linear_fc2.weight  [hidden, moe_ffn/etp]    linear_fc1/2)
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

MoE (``qwen3_moe``): ``E`` counts this expert-parallel rank's experts (``num_experts / EP``); the expert
linears are split by the expert tensor parallelism (``etp``, default ``tp``).

Callers initialise Megatron's parallel state first (:func:`initialize_model_parallel`). On CPU, call
``cpu_compat.apply_cpu_compat()`` before building, and pass :func:`causal_attention_mask` to forward.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import logging
import torch
import torch.nn.functional as F

from megatron_arpo.model_config import ModelConfig
from megatron_arpo.parallel_layout import model_layout_errors
from megatron_arpo.models.registry import get_family

logger = logging.getLogger(__name__)


RECOMPUTE_MODES = ("none", "selective", "full")
# Local-spec attention materialises [rows, heads/tp, s, s] scores (plus softmax and its grad): about
# 30 B per token^2 per layer measured (docs/design/fake_cuda.md §3), 1.9 GiB per layer at 8192 tokens.
LOCAL_ATTENTION_MAX_TOKENS = 8192


def resolve_use_te(use_te: bool | None, *, micro_batch_tokens: int | None = None) -> bool:
    """``None`` (``actor.use_te: auto``): Transformer Engine when it is importable and CUDA is available.

    On a GPU machine without Transformer Engine, ``auto`` falls back to the local spec with a warning,
    and refuses when ``micro_batch_tokens`` reaches ``LOCAL_ATTENTION_MAX_TOKENS`` (quadratic attention
    memory); ``use_te: false`` accepts the local spec explicitly.
    """
    if use_te is not None:
        return bool(use_te)
    if not torch.cuda.is_available():
        return False
    if importlib.util.find_spec("transformer_engine") is not None:
        return True
    if micro_batch_tokens is not None and micro_batch_tokens >= LOCAL_ATTENTION_MAX_TOKENS:
        raise ValueError(
            f"actor.use_te: auto found CUDA but no Transformer Engine, and the local layer spec's attention keeps "
            f"s x s scores: at actor.micro_batch_tokens {micro_batch_tokens} that is quadratic memory per layer. "
            f"Install Transformer Engine (pip install 'megatron-arpo[gpu]'), or set actor.use_te: false to accept "
            f"the local spec, with actor.micro_batch_tokens below {LOCAL_ATTENTION_MAX_TOKENS}")
    logger.warning("actor.use_te: auto found CUDA but no Transformer Engine: FALLING BACK TO THE LOCAL LAYER SPEC "
                   "(unfused attention with s x s scores, no fused kernels). Install transformer-engine, or set "
                   "actor.use_te: false to make this choice explicit")
    return False


class TorchRMSNorm:
    """torch ``RMSNorm`` for the local spec that also works under sequence parallelism (see the module doc)."""

    def __new__(cls, config, hidden_size: int, eps: float = 1e-5, persist_layer_norm: bool = False,
                zero_centered_gamma: bool = False, normalization: str = "RMSNorm"):
        if config.normalization != "RMSNorm" or config.layernorm_zero_centered_gamma:
            raise ValueError(f"TorchRMSNorm builds plain RMSNorm, not {config.normalization!r} "
                             f"(zero-centred gamma {config.layernorm_zero_centered_gamma})")
        norm = torch.nn.RMSNorm(normalized_shape=hidden_size, eps=eps)
        for param in norm.parameters():
            # finalize_model_grads sums the gradients of marked parameters over TP when SP is on
            setattr(param, "sequence_parallel", bool(config.sequence_parallel))
        return norm


def build_transformer_config(
    model_cfg: ModelConfig,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    params_dtype: torch.dtype = torch.float32,
    sequence_parallel: bool = False,
    recompute: str | bool = "none",
    use_te: bool | None = None,
    deterministic: bool = False,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
):
    """Map a model config onto Megatron's ``TransformerConfig`` (the only place that builds one).

    ``recompute``: ``"none"``, ``"selective"`` or ``"full"`` (``True``/``False`` mean full/none).
    ``deterministic``: Megatron's ``deterministic_mode`` (``trainer.deterministic``, megatron_arpo.determinism).
    ``expert_parallel`` / ``expert_tensor_parallel`` (MoE families; ``None``: the expert TP equals
    ``tensor_parallel``, Megatron's default): how the routed experts are split.
    """
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core.transformer.enums import AttnBackend
    from megatron.core.transformer.transformer_config import TransformerConfig

    family = get_family(model_cfg.model_type)
    use_te = resolve_use_te(use_te)
    if params_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"params_dtype {params_dtype} is not supported; use torch.float32, bfloat16 or float16")
    check_layout(model_cfg, tensor_parallel, pipeline_parallel, sequence_parallel, expert_parallel,
                 expert_tensor_parallel)
    recompute = {True: "full", False: "none"}.get(recompute, recompute)
    if recompute not in RECOMPUTE_MODES:
        raise ValueError(f"actor.recompute: {recompute!r} is not supported; allowed: {list(RECOMPUTE_MODES)}")
    moe_kwargs = dict(family.moe_transformer_config(model_cfg))
    if moe_kwargs and not torch.cuda.is_available():
        # Megatron's all-to-all dispatcher creates a CUDA stream for its device-to-host copies; on CPU the
        # all-gather dispatcher moves the same tokens with plain collectives (gloo).
        moe_kwargs["moe_token_dispatcher_type"] = "allgather"
    recompute_kwargs = {
        "none": {},
        "selective": dict(recompute_granularity="selective", recompute_modules=["core_attn"]),
        "full": dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    }[recompute]
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
        **family.transformer_config,  # qk_layernorm, add_qkv_bias
        **moe_kwargs,  # router, experts, dispatcher (MoE families)
        expert_model_parallel_size=expert_parallel,
        expert_tensor_parallel_size=expert_tensor_parallel or tensor_parallel,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        tensor_model_parallel_size=tensor_parallel,
        pipeline_model_parallel_size=pipeline_parallel,
        sequence_parallel=sequence_parallel,
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
        deterministic_mode=deterministic,
        **recompute_kwargs,
    )


def check_layout(model_cfg: ModelConfig, tensor_parallel: int, pipeline_parallel: int,
                 sequence_parallel: bool = False, expert_parallel: int = 1,
                 expert_tensor_parallel: int | None = None) -> None:
    """Refuse a layout this model cannot take, naming the key and the values it can."""
    errors = model_layout_errors(model_cfg, tensor_parallel, pipeline_parallel, sequence_parallel,
                                 expert_parallel=expert_parallel, expert_tensor_parallel=expert_tensor_parallel)
    if errors:
        raise ValueError("; ".join(errors))


def define_router_gemm_without_te() -> None:
    """Megatron 0.16.1's MoE router reads ``moe_utils.te_general_gemm``, a name bound only when Transformer
    Engine imports (a NameError without it, GPU or CPU); bind it to None so the router uses ``torch.mm``."""
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core.transformer.moe import moe_utils

    if not hasattr(moe_utils, "te_general_gemm"):
        moe_utils.te_general_gemm = None


def get_layer_spec(model_cfg: ModelConfig, use_te: bool | None = None):
    """The decoder layer spec: Transformer Engine modules on GPU, local Megatron modules (+ TorchRMSNorm) on CPU."""
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer.identity_op import IdentityOp

    qk_layernorm = get_family(model_cfg.model_type).transformer_config["qk_layernorm"]
    # MoE: one module per expert (SequentialMLP, no grouped GEMM), so parameter names are per expert.
    experts = dict(num_experts=model_cfg.num_experts, moe_grouped_gemm=False)
    if model_cfg.is_moe:
        define_router_gemm_without_te()
    if resolve_use_te(use_te):
        return gpt_layer_specs.get_gpt_layer_with_transformer_engine_spec(qk_layernorm=qk_layernorm, **experts)
    spec = gpt_layer_specs.get_gpt_layer_local_spec(qk_layernorm=qk_layernorm, normalization="RMSNorm", **experts)
    attn = spec.submodules.self_attention
    attn_sub = dataclasses.replace(
        attn.submodules, **{k: TorchRMSNorm for k in ("q_layernorm", "k_layernorm")
                            if getattr(attn.submodules, k) is not IdentityOp})
    layer_sub = dataclasses.replace(spec.submodules, input_layernorm=TorchRMSNorm, pre_mlp_layernorm=TorchRMSNorm,
                                    self_attention=dataclasses.replace(attn, submodules=attn_sub))
    return dataclasses.replace(spec, submodules=layer_sub)


def get_decoder_spec(model_cfg: ModelConfig, config, use_te: bool | None = None):
    """What ``GPTModel`` gets as ``transformer_layer_spec``: the layer spec, or for the local spec a block spec
    whose final norm is :class:`TorchRMSNorm` too (Megatron would pick ``WrappedTorchNorm`` for it)."""
    layer = get_layer_spec(model_cfg, use_te)
    if resolve_use_te(use_te):
        return layer
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core.transformer.spec_utils import ModuleSpec
    from megatron.core.transformer.transformer_block import (TransformerBlock, TransformerBlockSubmodules,
                                                             get_num_layers_to_build)

    num_layers = get_num_layers_to_build(config)
    return ModuleSpec(module=TransformerBlock,
                      submodules=TransformerBlockSubmodules(layer_specs=[layer] * num_layers, layer_norm=TorchRMSNorm))


def build_gpt_model(
    model_cfg: ModelConfig,
    *,
    tensor_parallel: int = 1,
    pipeline_parallel: int = 1,
    params_dtype: torch.dtype = torch.float32,
    use_te: bool | None = None,
    pre_process: bool | None = None,
    post_process: bool | None = None,
    recompute: str | bool = "none",
    sequence_parallel: bool = False,
    deterministic: bool = False,
    expert_parallel: int = 1,
    expert_tensor_parallel: int | None = None,
):
    """A ``GPTModel`` for this rank's pipeline stage (parallel state must already be initialised)."""
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel

    if not parallel_state.model_parallel_is_initialized():
        raise RuntimeError("build_gpt_model needs Megatron's parallel state; call initialize_model_parallel first")
    for name, want, have in (
        ("tensor_parallel", tensor_parallel, parallel_state.get_tensor_model_parallel_world_size()),
        ("pipeline_parallel", pipeline_parallel, parallel_state.get_pipeline_model_parallel_world_size()),
        ("expert_parallel", expert_parallel, parallel_state.get_expert_model_parallel_world_size()),
        ("expert_tensor_parallel", expert_tensor_parallel or tensor_parallel,
         parallel_state.get_expert_tensor_parallel_world_size()),
    ):
        if want != have:
            raise ValueError(f"build_gpt_model({name}={want}) but parallel state was initialised with {have}")
    use_te = resolve_use_te(use_te)
    config = build_transformer_config(
        model_cfg, tensor_parallel=tensor_parallel, pipeline_parallel=pipeline_parallel,
        params_dtype=params_dtype, recompute=recompute, use_te=use_te, sequence_parallel=sequence_parallel,
        deterministic=deterministic, expert_parallel=expert_parallel, expert_tensor_parallel=expert_tensor_parallel,
    )
    if pre_process is None:
        pre_process = parallel_state.is_pipeline_first_stage(ignore_virtual=True)
    if post_process is None:
        post_process = parallel_state.is_pipeline_last_stage(ignore_virtual=True)
    model = GPTModel(
        config=config,
        transformer_layer_spec=get_decoder_spec(model_cfg, config, use_te),
        vocab_size=model_cfg.padded_vocab_size(tensor_parallel),
        max_sequence_length=model_cfg.max_position_embeddings,
        pre_process=pre_process,
        post_process=post_process,
        share_embeddings_and_output_weights=model_cfg.tie_word_embeddings,
        position_embedding_type="rope",
        rotary_base=int(model_cfg.rope_theta),
    )
    apply_rope_scaling(model, model_cfg)
    return model


def apply_rope_scaling(model, model_cfg: ModelConfig) -> None:
    """Give the model's RoPE the inverse frequencies of ``model_cfg.rope_scaling`` (all four parameters).

    Megatron's ``GPTModel(rope_scaling=True, rope_scaling_factor=f)`` would drop ``low_freq_factor``,
    ``high_freq_factor`` and ``original_max_position_embeddings`` (it uses Llama 3.1's values whatever the
    config says); here its ``_apply_scaling`` is called with each of them, on the unscaled frequencies.
    """
    rope = model_cfg.rope_scaling
    if rope is None:
        return
    if rope.rope_type != "llama3":
        raise ValueError(f"model config {model_cfg.name!r}: rope_scaling.rope_type {rope.rope_type!r} has no "
                         f"Megatron implementation here; supported: ['llama3']")
    rotary = model.rotary_pos_emb
    # RotaryEmbedding.forward is lru-cached (class-wide, keyed by instance and length): drop stale entries.
    if hasattr(type(rotary).forward, "cache_clear"):
        type(rotary).forward.cache_clear()
    dim = model_cfg.head_dim
    base = 1.0 / (model_cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.float32,
                                                        device=rotary.inv_freq.device) / dim))
    rotary.inv_freq = rotary._apply_scaling(
        base, factor=rope.factor, low_freq_factor=rope.low_freq_factor, high_freq_factor=rope.high_freq_factor,
        original_max_position_embeddings=rope.original_max_position_embeddings)


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
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core.transformer.module import Float16Module

        return Float16Module(config, model)
    return model


def causal_attention_mask(seq_len: int, device: str | torch.device = "cpu") -> torch.Tensor:
    """[1, 1, s, s] bool, True where attention is masked (a key after the query): GPTModel's convention."""
    return torch.triu(torch.ones(seq_len, seq_len, dtype=torch.bool, device=device), diagonal=1)[None, None]


def initialize_model_parallel(tensor_parallel: int = 1, pipeline_parallel: int = 1, seed: int = 0,
                              expert_parallel: int = 1, expert_tensor_parallel: int | None = None) -> None:
    """Set up Megatron's TP/PP/DP (and expert EP/ETP) groups on the current default process group and seed
    its RNG tracker.

    Seeds as Megatron's training entry does: each pipeline stage gets ``seed + 100 * pp_rank``; the
    tracker's model-parallel stream adds the TP rank, so TP shards are initialised differently.
    """
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import parallel_state, tensor_parallel as mcore_tp

    parallel_state.initialize_model_parallel(
        tensor_model_parallel_size=tensor_parallel, pipeline_model_parallel_size=pipeline_parallel,
        expert_model_parallel_size=expert_parallel, expert_tensor_parallel_size=expert_tensor_parallel,
    )
    stage_seed = seed + 100 * parallel_state.get_pipeline_model_parallel_rank()
    torch.manual_seed(stage_seed)
    mcore_tp.model_parallel_cuda_manual_seed(stage_seed)
