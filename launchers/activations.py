"""The planner's activation terms (``launchers.planner`` adds them to the per-rank parameter arithmetic).

Activations are calibrated against ``megatron-arpo plan --measure`` (``megatron_arpo.fake_cuda.memory_probe``:
one stage at real shapes on fake CUDA under torch's MemTracker; the calibration runs are in
benchmarks/RESULTS.md).
For T tokens of a packed micro-batch, bf16 (2 B), TP t, sequence-parallel factor s (t with SP, else 1),
q = heads*head_dim, kv = kv_heads*head_dim, f = intermediate_size, one layer keeps for its backward:
- TE spec (``actor.use_te`` auto/true: fused norms, fused SwiGLU, flash attention, THD packing):
  ``2 B * T * [4h/s + (2q + 2kv + 3f)/t (+ (q + kv)/t with q/k norms)] + 8 B * T * head_dim`` (RoPE
  tables of the THD path); the same with ``recompute: selective`` (flash attention keeps nothing the
  core-attention recompute would drop); with ``recompute: full`` only the layer input ``2 B * T * h/s``.
- local spec (``use_te: false``): torch's RMSNorm keeps five bf16-equivalents of its input and the
  unfused SwiGLU three, so ``+ 2 B * T * [4 * (2h/s (+ (q + kv)/t)) + 2f/t]``, and without recompute the
  attention scores: ``6 B * rows * s_row^2 * heads/t`` (bf16 scores + fp32 softmax, rows as wide as the
  longest sequence).
On top: the first stage keeps the embedding output (``2 B * T * h``) and every stage the RoPE table
(``12 B * T * head_dim``); 1F1B keeps ``pp - stage`` micro-batches in flight; backward needs a
transient of ``TRANSIENT[spec, recompute]`` one-layer (no-recompute) activations; the last stage's loss
holds ``LOGITS_WORKSET`` (``LOGITS_WORKSET_ENTROPY`` when the loss needs the entropy) fp32 copies of
its ``[T, vocab/t]`` logits.

Two phases, as ``plan --measure`` reports them; a stage's lines are those of the larger. The forward and
backward hold the activations and temporaries above. The optimizer step comes after the last backward: it
holds the optimizer's temporaries, counted on the optimizer line (without TE, torch's foreach Adam makes
one fp32 copy of the shard it steps; Megatron's chained optimizer steps the dense and the expert shard
one after the other, so the larger of the two), and what the backward leaves on the GPU: Megatron's
global memory buffer (``2 B`` times the larger of the sequence-parallel all-gather ``T * h`` and, in the
local spec, the attention scores ``rows * heads/t * s_row^2``), allocated by the first forward and kept.
MoE adds to it each layer's routing state, which the token dispatcher keeps until the next forward
(fp32 probabilities and a bool map ``[T/s, experts]``, int64 token indices ``[T/s * top-k]``), and with
``recompute: full`` the graph of the recomputed router the dispatcher holds, which keeps the layer's
checkpointed input (activations) and its gradient (temporaries), ``2 B * T * h/s`` each per layer; a
stage after the first also keeps the gradient of its received input. The forward/backward holds the
routing state and those gradients too, as its backward leaves them.

A MoE layer's experts see ``rows = top-k * T/s * expert TP`` dispatched tokens (the all-to-all, then the
expert-TP all-gather), e = moe_intermediate_size / expert TP. In place of the dense MLP a layer keeps
``2 B * rows * (ALLTOALL_COPIES * h + 3e)`` (one copy of the dispatched tokens, the experts' fc1 input),
and in the local spec ``+ 2 B * rows * 3e`` (the unfused SwiGLU's two, the routing-probability weighting's
one). The combine holds at once the expert output ``[rows, h]`` and its copy sorted back to rank order
(bf16), with expert TP > 1 also their fp32 cast and its reduce-scatter output (``combine_bytes``); that
moment (with full recompute, on top of the recomputed layer) is the transient when it is the larger.
"""

from __future__ import annotations

from typing import Any

from megatron_arpo.model_config import ModelConfig

# The functions below take the planner's ``PlanInput`` (launchers/planner.py, which imports this module):
# annotated ``Any`` so that this module does not import the planner back.
PlanInput = Any

BF16, FP32 = 2, 4

# Calibrated with `megatron-arpo plan --measure` (benchmarks/RESULTS.md, "planner calibration").
TRANSIENT = {("te", "none"): 0.85, ("te", "selective"): 0.85, ("te", "full"): 2.1,
             ("local", "none"): 0.62, ("local", "selective"): 1.39, ("local", "full"): 1.62}
LOGITS_WORKSET, LOGITS_WORKSET_ENTROPY = 4.2, 6.2
LOCAL_SCORE_BYTES = 6
LAYER_SPECS = ("te", "local")
# MoE, measured (benchmarks/RESULTS.md, "Qwen3-30B-A3B: the all-to-all dispatcher's copies"): a layer keeps
# one bf16 copy of its dispatched tokens [rows, h], the experts' fc1 input; the combine's copies are transient.
ALLTOALL_COPIES = 1


def layer_activation_bytes(cfg: ModelConfig, tokens: int, tp: int, sequence_parallel: bool, *,
                           recompute: str = "none", layer_spec: str = "te", seq_len: int | None = None,
                           etp: int | None = None) -> int:
    """Bytes one layer keeps from its forward to its backward for ``tokens`` tokens (see the module doc)."""
    h, f, d = cfg.hidden_size, cfg.intermediate_size, cfg.head_dim
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    s = tp if sequence_parallel else 1
    if recompute == "full":
        return int(BF16 * tokens * h / s)
    qk = (q + kv) / tp if cfg.qk_layernorm else 0.0
    mlp = 3 * f / tp
    if cfg.is_moe:  # per token: its dispatched rows, each through one expert's share of the expert TP
        rows, e = dispatched_rows(cfg, 1, tp, sequence_parallel, etp), cfg.moe_intermediate_size / (etp or tp)
        mlp = rows * (ALLTOALL_COPIES * h + 3 * e)
        f = 1.5 * rows * e * tp  # the local spec's 2f/tp: the SwiGLU's two and the probability weighting's one
    elems = 4 * h / s + (2 * q + 2 * kv) / tp + mlp + qk
    extra = 0.0
    if layer_spec == "te":
        extra = 8 * tokens * d  # the THD path's per-token RoPE tables of q and k (fp32)
    else:
        elems += 4 * (2 * h / s + qk) + 2 * f / tp
        if recompute == "none":  # attention scores, per row of the packed micro-batch
            row = min(seq_len or tokens, tokens)
            extra = LOCAL_SCORE_BYTES * (tokens // row) * row * row * cfg.num_attention_heads / tp
    return int(BF16 * tokens * elems + extra)


def dispatched_rows(cfg: ModelConfig, tokens: float, tp: int, sequence_parallel: bool, etp: int | None) -> float:
    """Token copies a rank's experts process for ``tokens`` tokens of a micro-batch: top-k per token of the
    rank's sequence-parallel share, all-gathered over the expert TP (a balanced router's counts)."""
    s = tp if sequence_parallel else 1
    return cfg.num_experts_per_tok * tokens / s * (etp or tp)


def combine_bytes(p: PlanInput) -> float:
    """What a MoE layer's combine holds at once (see the module doc): the expert output ``[rows, h]`` and its
    copy sorted back to rank order (bf16), with expert TP > 1 its fp32 cast and the reduce-scatter output."""
    etp = p.etp or p.tp
    per_element = 2 * BF16 + (FP32 * (1 + 1 / etp) if etp > 1 else 0)
    rows = dispatched_rows(p.model, p.micro_batch_tokens, p.tp, p.sequence_parallel, p.etp)
    return rows * p.model.hidden_size * per_element


def moe_leftover_bytes(p: PlanInput, pp_rank: int) -> dict[str, float]:
    """What a stage's MoE dispatchers hold after its backward (see the module doc): the routing state and,
    with full recompute, the recomputed routers' layer inputs (``activations``) and their gradients."""
    cfg, layers = p.model, p.model.num_hidden_layers // p.pp
    if not cfg.is_moe:
        return {"activations": 0.0, "inputs": 0.0, "temporaries": 0.0}
    tokens = p.micro_batch_tokens / (p.tp if p.sequence_parallel else 1)  # the tokens one rank routes
    routing = layers * tokens * (cfg.num_experts * (FP32 + 1) + cfg.num_experts_per_tok * 8)
    layer_input = BF16 * tokens * cfg.hidden_size if p.recompute == "full" else 0.0
    return {"activations": routing, "inputs": layers * layer_input,
            "temporaries": (layers + (pp_rank > 0)) * layer_input}


def global_buffer_bytes(p: PlanInput) -> float:
    """Megatron's global memory buffer ("mpu", bf16): one buffer as large as its largest user, the sequence-
    parallel all-gather of a layer's input or, in the local spec, the attention scores of a micro-batch."""
    T = p.micro_batch_tokens
    gather = T * p.model.hidden_size if p.sequence_parallel and p.tp > 1 else 0
    scores = 0
    if p.layer_spec == "local":
        row = min(p.seq_len or T, T)
        scores = (T // row) * p.model.num_attention_heads // p.tp * row * row
    return BF16 * max(gather, scores)


def step_bytes(p: PlanInput, pp_rank: int, dense_shard: float, expert_shard: float) -> dict[str, float]:
    """What one stage holds at the optimizer step besides its weights, grads and optimizer state (see the
    module doc): ``optimizer`` (the step's temporaries), ``activations`` and ``temporaries`` (left by the
    backward). ``dense_shard`` / ``expert_shard``: the parameters of each optimizer on this rank."""
    moe = moe_leftover_bytes(p, pp_rank)
    return {"optimizer": FP32 * max(dense_shard, expert_shard) if p.layer_spec == "local" else 0.0,
            "activations": global_buffer_bytes(p) + moe["activations"] + moe["inputs"],
            "temporaries": moe["temporaries"]}


def stage_activation_bytes(p: PlanInput, pp_rank: int) -> dict[str, float]:
    """Activation bytes of one stage at its peak: in-flight micro-batches, backward transient, logits."""
    cfg, T = p.model, p.micro_batch_tokens
    layers = cfg.num_hidden_layers // p.pp
    kw = dict(layer_spec=p.layer_spec, seq_len=p.seq_len, etp=p.etp)
    kept_layer = layer_activation_bytes(cfg, T, p.tp, p.sequence_parallel, recompute=p.recompute, **kw)
    one_layer = layer_activation_bytes(cfg, T, p.tp, p.sequence_parallel, recompute="none", **kw)
    fixed = 12 * T * cfg.head_dim + (BF16 * T * cfg.hidden_size if pp_rank == 0 else 0)
    kept = layers * kept_layer + fixed
    in_flight = p.pp - pp_rank  # 1F1B: stage k holds pp - k micro-batches at its peak
    activations = in_flight * kept
    transient = TRANSIENT[p.layer_spec, p.recompute] * one_layer
    if cfg.is_moe:  # a layer's combine, on top of the recomputed layer with full recompute
        transient = max(transient, combine_bytes(p) + (one_layer if p.recompute == "full" else 0))
    if pp_rank == p.pp - 1:  # the loss, still in the forward: fp32 copies of the [T, vocab/tp] logits
        workset = LOGITS_WORKSET_ENTROPY if p.entropy else LOGITS_WORKSET
        logits = workset * FP32 * T * p.model.padded_vocab_size(p.tp) / p.tp
        activations += logits
        transient = max(0.0, transient - logits)
    moe = moe_leftover_bytes(p, pp_rank)  # the layer inputs are the checkpoints already kept
    return {"kept_per_micro_batch": kept, "in_flight": in_flight, "activations": activations + moe["activations"],
            "temporaries": transient + moe["temporaries"]}
