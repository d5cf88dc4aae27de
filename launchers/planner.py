"""Memory planner: does a model fit per GPU with a given TP/PP/DP and rollout-engine TP? Pure arithmetic.

Parameter counts follow the Megatron-Core GPT layout that ``megatron_arpo.actor`` builds (local spec):
per layer ``input_layernorm``, ``linear_qkv`` (+ bias for qwen2), ``q/k_layernorm`` (qwen3),
``linear_proj``, ``pre_mlp_layernorm``, ``linear_fc1`` (gate+up), ``linear_fc2``; the embedding and the
untied ``output_layer`` padded to ``make_vocab_size_divisible_by * TP`` rows; ``final_layernorm``. TP
splits the linear layers and the vocabulary; norms are replicated; PP splits the layers evenly, the
embedding lives on the first stage, the output layer and final norm on the last (a tied model keeps a
copy of the embedding on the last stage when PP > 1, as Megatron does).
Mixture of experts (qwen3_moe): a layer's MLP is the router (replicated) and ``num_experts / EP`` local
experts on each rank, each split by the expert TP (``actor.expert_tensor_parallel``, default TP); the
distributed optimizer shards the expert parameters over the expert-data-parallel group
(``DP x TP / (EP x expert TP)``) and the rest over DP. Activations count the top-k experts a token
visits in place of the dense MLP, plus the copy of the dispatched tokens each layer keeps
(``ALLTOALL_COPIES`` of ``[top-k x T, h]`` bf16 at expert TP = TP). ``active_params`` counts the parameters
one token uses (top-k experts per layer).

Actor memory per GPU (bytes per parameter, Megatron's distributed-optimizer rule, as in
docs/design/fake_cuda.md §3: bf16 params + fp32 grads = 6 + 12/DP):
- bf16 weights 2 B, fp32 gradient buffer 4 B (Megatron accumulates/reduces bf16 grads in fp32),
- fp32 main params + Adam m + v = 12 B, divided by DP with the distributed optimizer.
``megatron-arpo plan --measure`` (``launchers.measure``) measures all of this exactly.

Activations, and the two phases a stage's lines come from (forward/backward, optimizer step):
``launchers.activations``.

Rollout engines (vLLM) per GPU: bf16 weights / engine TP (norms replicated) plus the KV cache for
``concurrency`` sequences of ``max_model_len`` tokens: ``2 (K,V) * layers * ceil(kv_heads/tp) * head_dim *
2 B`` per token. vLLM claims ``rollout.gpu_memory_utilization`` of the GPU whatever it needs (its
reservation), and the need must fit in it. Colocated placement holds the actor's peak *and* the
engines' reservation on the same GPU, unless the actor offloads its state and vLLM sleeps between the
phases (then the peak of the two phases, with the actor's bf16 weights staying for the sync). A phase
fits when it stays under ``(1 - headroom)`` of the GPU after a fixed CUDA context/workspace overhead.
Weight sync per step moves every HF tensor once per engine in bf16.

The weight sync is a phase of its own (`sync_memory`): what the GPU holds when it starts (colocated: the
rollout phase's holdings, with vLLM's KV cache still asleep under sleep + offload) plus the sync
buffer (the largest packed bucket: the actor rank's persistent IPC buffer, or the sender's bucket),
vLLM's clone of that bucket (its IPC and NCCL consumers copy a bucket out before loading it), the NCCL
communicators of the GPU's processes (``NCCL_COMMUNICATOR_GIB`` each, an estimate) and an allocator
fragmentation margin (``fragmentation`` of the rest). The IPC buffer stays between syncs, so a colocated
GPU's phases count it too. Since these lines count the slack the headroom
stands for elsewhere, the sync fits when it stays under the GPU less the fixed overhead.

Separate placement splits the GPUs into an actor pool (``trainer.actor_devices``: DP = pool / (TP x PP))
and an engine pool (``trainer.rollout_devices``: ``rollout_devices // engine TP`` engines by default).
``trainer.mode: off_policy`` adds the rollout buffer (megatron_arpo/rollout/buffer.py), which lives in
the driver's host memory on the head node: ``G x n x (P x 40 B + R x 96 B)`` for G buffered groups
(``rollout.buffer_groups``, null = (K + 1) x ``train_batch_size``), n trajectories a group
(``rollout.n``), P prompt and R response tokens at most (``data.max_prompt_tokens``,
``rollout.response_length``). Per token a ``Trajectory`` keeps CPython lists (8 B a slot) of objects:
the prompt's token ids (an int, 28 B in a 32 B block); the response's ids (int), sampled log-probs (a
float, 24 B in a 32 B block), loss mask and versions (cached small ints: the slot only). The engines'
top-k log-probs are not kept. Every object distinct (a resumed buffer) is the worst case: live branches
share their prefix's objects and a group's trajectories their prompt's ints.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

from launchers.activations import BF16, FP32, LAYER_SPECS, stage_activation_bytes, step_bytes
from megatron_arpo.model_config import ModelConfig, load_model_config
from megatron_arpo.parallel_layout import (derive_data_parallel, engine_tp_errors, expert_world_errors,
                                           model_layout_errors)
from megatron_arpo.cluster.allocation import slurm_size_bytes
from megatron_arpo.config_schema import TrainerSection
from megatron_arpo.rollout.config import RolloutSection
from megatron_arpo.weight_sync.protocol import pack_in_order

GiB = 1024 ** 3

# Usable device memory as the driver reports it (nvidia-smi "Total").
GPU_MEMORY_GIB: Mapping[str, float] = {
    "h100-80g": 81559 / 1024,
    "h200-141g": 143771 / 1024,
    "a100-80g": 81920 / 1024,
}


@dataclass(frozen=True)
class ParamCounts:
    """Parameters of one Megatron rank (or of the whole model when tp = pp = 1, unpadded)."""

    layers: int
    embedding: int
    output_layer: int
    final_norm: int
    per_layer: int
    expert_per_layer: int = 0  # of per_layer: the routed experts' parameters (MoE)

    @property
    def total(self) -> int:
        return self.layers * self.per_layer + self.embedding + self.output_layer + self.final_norm

    @property
    def experts(self) -> int:
        return self.layers * self.expert_per_layer


def layer_tensor_shapes(cfg: ModelConfig, tp: int = 1, ep: int = 1, etp: int | None = None
                        ) -> dict[str, tuple[int, ...]]:
    """Shapes of one transformer layer's tensors on one TP (and EP) rank, Megatron names (local spec)."""
    h, d, f = cfg.hidden_size, cfg.head_dim, cfg.intermediate_size
    qkv = (cfg.num_attention_heads + 2 * cfg.num_key_value_heads) * d
    shapes = {
        "input_layernorm.weight": (h,),
        "self_attention.linear_qkv.weight": (qkv // tp, h),
        "self_attention.linear_proj.weight": (h, cfg.num_attention_heads * d // tp),
        "pre_mlp_layernorm.weight": (h,),
    }
    if cfg.is_moe:
        e, etp = cfg.moe_intermediate_size, etp or tp
        shapes["mlp.router.weight"] = (cfg.num_experts, h)
        for i in range(cfg.num_experts // ep):
            shapes[f"mlp.experts.local_experts.{i}.linear_fc1.weight"] = (2 * e // etp, h)
            shapes[f"mlp.experts.local_experts.{i}.linear_fc2.weight"] = (h, e // etp)
    else:
        shapes["mlp.linear_fc1.weight"] = (2 * f // tp, h)
        shapes["mlp.linear_fc2.weight"] = (h, f // tp)
    if cfg.attention_bias:
        shapes["self_attention.linear_qkv.bias"] = (qkv // tp,)
    if cfg.qk_layernorm:
        shapes["self_attention.q_layernorm.weight"] = (d,)
        shapes["self_attention.k_layernorm.weight"] = (d,)
    return shapes


def check_parallelism(cfg: ModelConfig, tp: int, pp: int, sequence_parallel: bool = False, ep: int = 1,
                      etp: int | None = None) -> None:
    """Raise naming the key Megatron would reject and the values it takes (heads/groups/ffn, layers, SP, EP)."""
    if tp < 1 or pp < 1 or ep < 1:
        raise ValueError(f"actor.tensor_parallel {tp}, actor.pipeline_parallel {pp} and actor.expert_parallel {ep} "
                         f"must be >= 1")
    errors = model_layout_errors(cfg, tp, pp, sequence_parallel, expert_parallel=ep, expert_tensor_parallel=etp)
    if errors:
        raise ValueError("; ".join(errors))


def rank_param_counts(cfg: ModelConfig, tp: int = 1, pp: int = 1, pp_rank: int = 0,
                      padded: bool = True, ep: int = 1, etp: int | None = None) -> ParamCounts:
    """Parameters held by one (tp_rank, pp_rank, ep_rank) of the actor; every such rank holds the same count."""
    check_parallelism(cfg, tp, pp, ep=ep, etp=etp)
    shapes = layer_tensor_shapes(cfg, tp, ep, etp)
    per_layer = sum(math.prod(s) for s in shapes.values())
    expert_per_layer = sum(math.prod(s) for n, s in shapes.items() if ".local_experts." in n)
    vocab = cfg.padded_vocab_size(tp) if padded else cfg.vocab_size
    emb_rows = vocab // tp if padded else vocab
    first, last = pp_rank == 0, pp_rank == pp - 1
    embedding = emb_rows * cfg.hidden_size if first else 0
    if cfg.tie_word_embeddings:
        output = emb_rows * cfg.hidden_size if (last and pp > 1) else 0
    else:
        output = emb_rows * cfg.hidden_size if last else 0
    return ParamCounts(layers=cfg.num_hidden_layers // pp, embedding=embedding, output_layer=output,
                       final_norm=cfg.hidden_size if last else 0, per_layer=per_layer,
                       expert_per_layer=expert_per_layer)


def hf_param_count(cfg: ModelConfig) -> int:
    """Parameters of the HF checkpoint (unpadded vocabulary, tied output not counted twice)."""
    return rank_param_counts(cfg, 1, 1, padded=False).total


def active_param_count(cfg: ModelConfig) -> int:
    """Parameters one token uses: all but the experts it is not routed to (MoE); the total for dense models."""
    counts = rank_param_counts(cfg, 1, 1, padded=False)
    if not cfg.is_moe:
        return counts.total
    return counts.total - counts.experts * (cfg.num_experts - cfg.num_experts_per_tok) // cfg.num_experts


def engine_weight_bytes(cfg: ModelConfig, engine_tp: int) -> int:
    """bf16 weights of one engine GPU: linear layers and vocabulary split by TP, norms replicated."""
    h = cfg.hidden_size
    shapes = layer_tensor_shapes(cfg, 1)
    sharded = sum(math.prod(s) for n, s in shapes.items() if "layernorm" not in n)
    replicated = sum(math.prod(s) for n, s in shapes.items() if "layernorm" in n)
    vocab = cfg.vocab_size * h * (1 if cfg.tie_word_embeddings else 2)
    per_gpu = cfg.num_hidden_layers * (sharded / engine_tp + replicated) + vocab / engine_tp + h
    return int(per_gpu * BF16)


def kv_bytes_per_token(cfg: ModelConfig, engine_tp: int) -> int:
    kv_heads = max(1, math.ceil(cfg.num_key_value_heads / engine_tp))  # replicated when tp > kv heads
    return 2 * cfg.num_hidden_layers * kv_heads * cfg.head_dim * BF16


# Host bytes a buffered trajectory holds per token (see the module docstring): a list slot and the object.
LIST_SLOT, INT_BLOCK, FLOAT_BLOCK = 8, 32, 32  # int 28 B and float 24 B, in pymalloc's 16 B-aligned blocks
BUFFER_BYTES_PER_PROMPT_TOKEN = LIST_SLOT + INT_BLOCK  # prompt_token_ids
# response_ids, response_logprobs, then loss_mask and token_versions (small ints: the slot only)
BUFFER_BYTES_PER_RESPONSE_TOKEN = (LIST_SLOT + INT_BLOCK) + (LIST_SLOT + FLOAT_BLOCK) + 2 * LIST_SLOT


# One NCCL communicator's device memory (channel buffers of its protocols and peers), an estimate: about
# 16-32 channels x 2 peers x ~5 MiB. NVLink SHARP (NCCL_NVLS_ENABLE) can take more.
NCCL_COMMUNICATOR_GIB = 0.25
FRAGMENTATION = 0.05  # caching-allocator slack: a share of what the GPU holds during the sync


def sync_units(cfg: ModelConfig, pp: int, pp_rank: int, dtype_bytes: int = BF16) -> list[tuple[object, int]]:
    """``(unit key, bytes)`` of the HF tensors one pipeline stage sends, in the order the sender packs them
    (``megatron_arpo.actor.hf_live.plan_stage_buckets``): the embedding (with tied embeddings its
    ``lm_head.weight`` copy rides along), each layer tensor keyed by its layer, the final norm, the LM head."""
    layers = cfg.num_hidden_layers // pp
    first, last = pp_rank == 0, pp_rank == pp - 1
    units: list[tuple[object, int]] = []
    vocab = cfg.vocab_size * cfg.hidden_size * dtype_bytes
    if first:
        units.append(("embedding", vocab * (2 if cfg.tie_word_embeddings else 1)))
    for name, shape in layer_tensor_shapes(cfg, 1).items():  # rule by rule, each over the stage's layers
        units += [(pp_rank * layers + i, math.prod(shape) * dtype_bytes) for i in range(layers)]
    if last:
        units.append(("final_norm", cfg.hidden_size * dtype_bytes))
        if not cfg.tie_word_embeddings:
            units.append(("lm_head", vocab))
    return units


def largest_sync_bucket(cfg: ModelConfig, pp: int, bucket_bytes: int, dtype_bytes: int = BF16) -> int:
    """Bytes of the largest packed bucket of any stage: the sync buffer's size."""
    largest = 0
    for stage in range(pp):
        units = sync_units(cfg, pp, stage, dtype_bytes)
        for bucket in pack_in_order(units, bucket_bytes):
            largest = max(largest, sum(units[i][1] for i in bucket))
    return largest


@dataclass
class PlanInput:
    model: ModelConfig
    gpu: str = "h100-80g"
    nodes: int = 1
    gpus_per_node: int = 8
    tp: int = 1
    pp: int = 1
    dp: int | None = None  # null = actor GPUs / (tp*pp)
    ep: int = 1  # actor.expert_parallel (MoE)
    etp: int | None = None  # actor.expert_tensor_parallel; null = tp
    micro_batch_tokens: int = 16384
    seq_len: int | None = None  # longest sequence (prompt + response); rows of the local spec's packing
    recompute: str = "none"  # none | selective | full
    sequence_parallel: bool = False
    distributed_optimizer: bool = True
    layer_spec: str = "te"  # te (actor.use_te auto/true on GPUs) | local (use_te false)
    entropy: bool = False  # the loss computes the entropy (AEPO entropy-aware advantages / balanced clip)
    engine_tp: int = 1
    num_engines: int | None = None  # null = GPUs / engine_tp
    max_model_len: int = 8192
    concurrency: int = 64  # sequences per engine (vLLM max_num_seqs)
    gpu_memory_utilization: float = RolloutSection.gpu_memory_utilization  # vLLM's reservation, a share of the whole GPU
    placement: str = TrainerSection.placement
    sleep_offload: bool = False  # colocated phases release each other's memory (vLLM sleep + actor offload)
    headroom: float = 0.10
    overhead_gib: float = 2.0  # CUDA context, library workspaces
    sync_bucket_mb: int = RolloutSection.sync_bucket_mb
    sync_transport: str = RolloutSection.sync_transport  # auto = ipc colocated, nccl separate
    nccl_communicator_gib: float = NCCL_COMMUNICATOR_GIB
    fragmentation: float = FRAGMENTATION
    actor_devices: int | None = TrainerSection.actor_devices  # separate: the actor pool (trainer.actor_devices); null = every GPU
    rollout_devices: int | None = TrainerSection.rollout_devices  # separate: the engine pool (trainer.rollout_devices); null = every GPU
    mode: str = TrainerSection.mode  # trainer.mode; off_policy counts the rollout buffer in the driver's host memory
    n: int = RolloutSection.n  # rollout.n: trajectories a prompt group holds
    prompt_tokens: int = 1536  # data.max_prompt_tokens
    response_tokens: int = 4096  # rollout.response_length
    train_batch_size: int = TrainerSection.train_batch_size  # prompt groups a step trains
    max_staleness: int = RolloutSection.max_staleness  # rollout.max_staleness (K)
    buffer_groups: int | None = RolloutSection.buffer_groups  # rollout.buffer_groups; null = (K + 1) x train_batch_size
    host_memory_gib: float | None = None  # a node's host memory (launcher.memory_per_node); null = unknown


@dataclass
class Plan:
    inputs: dict
    world: int
    dp: int
    total_params: int  # the HF model's parameters
    params_per_rank: dict  # stage -> count
    worst_stage: int
    actor_gib: dict  # breakdown of the worst stage: params, grads, optimizer, activations, temporaries
    actor_peak_gib: float
    rollout_gib: dict  # weights + KV cache the engine needs, and what vLLM reserves
    rollout_peak_gib: float  # what the engine needs
    rollout_reserved_gib: float
    colocated_peak_gib: float
    budget_gib: float
    fits_actor: bool
    fits_rollout: bool
    fits: bool
    weight_sync_gib_per_engine: float
    weight_sync_gib_total: float
    sync_gib: dict = field(default_factory=dict)  # held, buffer, vllm_clone, nccl, fragmentation (see sync_memory)
    sync_peak_gib: float = 0.0
    fits_sync: bool = True
    suggestions: list = field(default_factory=list)
    active_params: int = 0  # parameters one token uses (MoE: its top-k experts); = total_params if dense
    actor_gpus: int = 0  # the actor pool (every GPU when colocated)
    engine_gpus: int = 0  # the engine pool (every GPU when colocated)
    num_engines: int = 0
    buffer_gib: dict = field(default_factory=dict)  # off_policy: the rollout buffer (see buffer_memory); {} in sync
    fits_host: bool | None = None  # the buffer and the batch in a node's host memory; None: not known
    actor_phase: str = "forward_backward"  # where the worst stage peaks: forward_backward | optimizer_step

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def actor_memory(p: PlanInput, dp: int) -> tuple[dict, dict]:
    """Per-GPU actor bytes for every pipeline stage and the breakdown of the worst one."""
    if p.layer_spec not in LAYER_SPECS:
        raise ValueError(f"layer_spec {p.layer_spec!r}; allowed: {list(LAYER_SPECS)}")
    stages = {}
    expert_dp = dp * p.tp // (p.ep * (p.etp or p.tp)) if p.distributed_optimizer else 1
    for pp_rank in range(p.pp):
        counts = rank_param_counts(p.model, p.tp, p.pp, pp_rank, ep=p.ep, etp=p.etp)
        n = counts.total
        # the distributed optimizer shards expert parameters over the expert-data-parallel group
        dense = (n - counts.experts) / (dp if p.distributed_optimizer else 1)
        experts = counts.experts / max(1, expert_dp)
        held = {"params": BF16 * n, "grads": FP32 * n, "optimizer": 3 * FP32 * (dense + experts)}
        acts = stage_activation_bytes(p, pp_rank)
        step = step_bytes(p, pp_rank, dense, experts)
        phases = {"forward_backward": {**held, "activations": acts["activations"],
                                       "temporaries": acts["temporaries"]},
                  "optimizer_step": {**held, "optimizer": held["optimizer"] + step["optimizer"],
                                     "activations": step["activations"], "temporaries": step["temporaries"]}}
        for lines in phases.values():
            lines["total"] = sum(lines.values())
        phase = max(phases, key=lambda k: phases[k]["total"])  # the forward/backward on a tie
        stages[pp_rank] = {"num_params": n, **phases[phase], "phase": phase, "phases": phases}
    worst = max(stages, key=lambda k: stages[k]["total"])
    return stages, {"stage": worst, **stages[worst]}


def budget_gib(p: PlanInput) -> float:
    return GPU_MEMORY_GIB[p.gpu] * (1 - p.headroom) - p.overhead_gib


def sync_limit_gib(p: PlanInput) -> float:
    """The sync phase's limit: its slack is counted line by line (`sync_memory`), not by the headroom."""
    return GPU_MEMORY_GIB[p.gpu] - p.overhead_gib


def rollout_memory(p: PlanInput) -> dict[str, float]:
    weights = engine_weight_bytes(p.model, p.engine_tp) / GiB
    kv = kv_bytes_per_token(p.model, p.engine_tp) * p.max_model_len * p.concurrency / GiB
    return {"weights": weights, "kv_cache": kv, "total": weights + kv,
            "reserved": p.gpu_memory_utilization * GPU_MEMORY_GIB[p.gpu]}


def colocated_peak(p: PlanInput, actor: dict, rollout: dict) -> float:
    """Actor peak + vLLM's reservation; with sleep + offload, the larger phase (the actor's weights stay).
    Either way the actor rank's IPC buffer stays too (`ipc_buffer_gib`)."""
    actor_gib = actor["total"] / GiB + ipc_buffer_gib(p)
    if p.sleep_offload:
        return max(actor_gib, rollout["reserved"] + actor["params"] / GiB + ipc_buffer_gib(p))
    return actor_gib + rollout["reserved"]


def ipc_buffer_gib(p: PlanInput) -> float:
    """The IPC sync buffer each colocated actor rank keeps from its first sync on (the largest bucket)."""
    if p.placement != "colocated" or sync_transport(p) != "ipc":
        return 0.0
    return largest_sync_bucket(p.model, p.pp, p.sync_bucket_mb * 2**20) / GiB


def pool_gpus(p: PlanInput) -> tuple[int, int]:
    """GPUs of the actor pool and of the engine pool: every GPU each when colocated or when neither pool is
    given; separate with one given, the other takes the rest."""
    world = p.nodes * p.gpus_per_node
    if p.placement != "separate" or (p.actor_devices is None and p.rollout_devices is None):
        return world, world
    return p.actor_devices or world - p.rollout_devices, p.rollout_devices or world - p.actor_devices


def buffer_memory(p: PlanInput) -> dict[str, float]:
    """Host GiB of the off-policy rollout buffer and of the batch being trained (see the module docstring);
    empty in sync mode."""
    if p.mode != "off_policy":
        return {}
    groups = p.buffer_groups or (p.max_staleness + 1) * p.train_batch_size
    per_trajectory = (p.prompt_tokens * BUFFER_BYTES_PER_PROMPT_TOKEN
                      + p.response_tokens * BUFFER_BYTES_PER_RESPONSE_TOKEN)
    buffer = groups * p.n * per_trajectory / GiB
    batch = p.train_batch_size * p.n * per_trajectory / GiB  # taken out of the buffer, held while it trains
    return {"groups": groups, "trajectories": groups * p.n, "bytes_per_trajectory": per_trajectory,
            "buffer": buffer, "batch": batch, "total": buffer + batch}


def sync_transport(p: PlanInput) -> str:
    if p.sync_transport != "auto":
        return p.sync_transport
    return "ipc" if p.placement == "colocated" else "nccl"


def nccl_communicators(p: PlanInput, dp: int, transport: str) -> dict[str, int]:
    """Communicators with a member on one GPU, by owner: the actor rank's Megatron groups in use (TP, DP,
    PP) and the sender group of an IPC sync (the default group), the engine worker's TP group and NCCL
    weight-transfer groups (one per sender: pipeline stages x EP); colocated, both processes share the GPU."""
    actor_world = pool_gpus(p)[0]
    actor = (p.tp > 1) + (dp > 1) + (p.pp > 1) + (transport == "ipc" and actor_world > 1)
    engine = (p.engine_tp > 1) + (p.pp * p.ep if transport == "nccl" else 0)
    return {"actor": int(actor + (transport == "nccl")), "engine": int(engine)}


def sync_memory(p: PlanInput, dp: int, actor: dict, rollout: dict) -> dict[str, float]:
    """GiB one GPU holds during a weight sync, line by line (see the module docstring); ``total`` is the
    colocated GPU's, or with separate placement the larger of the actor's and the engine's GPU."""
    transport = sync_transport(p)
    bucket = largest_sync_bucket(p.model, p.pp, p.sync_bucket_mb * 2**20) / GiB
    comms = nccl_communicators(p, dp, transport)
    nccl = p.nccl_communicator_gib
    if p.placement == "colocated":
        # sleep + offload: the actor keeps its weights, vLLM has woken its weights and not yet its KV cache
        held = (actor["params"] / GiB + rollout["weights"] if p.sleep_offload
                else actor["total"] / GiB + rollout["reserved"])
        lines = {"held": held, "buffer": bucket, "vllm_clone": bucket,
                 "nccl": nccl * (comms["actor"] + comms["engine"])}
    else:  # the larger side: the sender's GPU (its bucket) or an engine GPU (received bucket + its clone)
        sender = actor["total"] / GiB + bucket + nccl * comms["actor"]
        engine = rollout["reserved"] + 2 * bucket + nccl * comms["engine"]
        lines = ({"held": actor["total"] / GiB, "buffer": bucket, "vllm_clone": 0.0, "nccl": nccl * comms["actor"]}
                 if sender >= engine else
                 {"held": rollout["reserved"], "buffer": bucket, "vllm_clone": bucket,
                  "nccl": nccl * comms["engine"]})
    lines["fragmentation"] = p.fragmentation * sum(lines.values())
    lines["total"] = sum(lines.values())
    return lines


def make_plan(p: PlanInput, suggest: bool = True) -> Plan:
    if p.gpu not in GPU_MEMORY_GIB:
        raise ValueError(f"unknown gpu {p.gpu!r}; allowed: {sorted(GPU_MEMORY_GIB)}")
    if p.recompute not in ("none", "selective", "full"):
        raise ValueError(f"actor.recompute {p.recompute!r}; allowed: ['full', 'none', 'selective']")
    check_parallelism(p.model, p.tp, p.pp, p.sequence_parallel, p.ep, p.etp)
    engine_errors = engine_tp_errors(p.model, p.engine_tp)
    if engine_errors:
        raise ValueError("; ".join(engine_errors))
    world = p.nodes * p.gpus_per_node
    actor_gpus, engine_gpus = pool_gpus(p)
    if p.placement == "separate" and (actor_gpus < 1 or engine_gpus < 1 or
                                      (p.actor_devices or p.rollout_devices) and actor_gpus + engine_gpus > world):
        raise ValueError(f"trainer.actor_devices {actor_gpus} + trainer.rollout_devices {engine_gpus}: each pool "
                         f"needs a GPU and both must fit in the {world} GPUs ({p.nodes} nodes x {p.gpus_per_node})")
    dp = derive_data_parallel(p.tp, p.pp, actor_gpus, p.dp)
    if p.dp is None and actor_gpus % (p.tp * p.pp):
        where = (f"the actor pool of {actor_gpus} GPUs (trainer.actor_devices)" if actor_gpus != world else
                 f"{world} GPUs ({p.nodes} nodes x {p.gpus_per_node})")
        raise ValueError(f"{where} is not a multiple of TP*PP = {p.tp * p.pp}; change "
                         f"{'trainer.actor_devices' if actor_gpus != world else 'launcher.nodes/gpus_per_node'} "
                         f"or actor TP/PP")
    expert_errors = expert_world_errors(p.tp, dp, p.ep, p.etp)
    if expert_errors:
        raise ValueError("; ".join(expert_errors))
    stages, worst = actor_memory(p, dp)
    rollout = rollout_memory(p)
    budget = budget_gib(p)
    actor_peak = worst["total"] / GiB
    colocated = colocated_peak(p, worst, rollout)
    num_engines = p.num_engines or max(1, engine_gpus // p.engine_tp)
    if p.placement == "separate" and num_engines * p.engine_tp > engine_gpus:
        raise ValueError(f"rollout.num_engines x rollout.tensor_parallel = {num_engines * p.engine_tp} exceeds the "
                         f"engine pool of {engine_gpus} GPUs (trainer.rollout_devices)")
    buffer = buffer_memory(p)
    fits_host = None
    if buffer and p.host_memory_gib:  # the rest of the node serves Ray and the processes: the headroom
        fits_host = buffer["total"] <= (1 - p.headroom) * p.host_memory_gib
    moved = hf_param_count(p.model) * BF16 / GiB
    sync = sync_memory(p, dp, worst, rollout)
    fits_actor = actor_peak <= budget
    fits_rollout = rollout["total"] <= rollout["reserved"] <= budget + p.overhead_gib
    fits_sync = sync["total"] <= sync_limit_gib(p)
    fits = fits_rollout and fits_sync and (colocated <= budget if p.placement == "colocated" else fits_actor)
    fits = fits and fits_host is not False
    plan = Plan(inputs={k: v for k, v in dataclasses.asdict(p).items() if k != "model"} | {"model": p.model.name},
                world=world, dp=dp, total_params=hf_param_count(p.model),
                params_per_rank={k: s["num_params"] for k, s in stages.items()}, worst_stage=worst["stage"],
                actor_gib={k: worst[k] / GiB for k in ("params", "grads", "optimizer", "activations", "temporaries")},
                actor_peak_gib=actor_peak, rollout_gib=rollout, rollout_peak_gib=rollout["total"],
                rollout_reserved_gib=rollout["reserved"], colocated_peak_gib=colocated, budget_gib=budget,
                fits_actor=fits_actor, fits_rollout=fits_rollout, fits=fits,
                weight_sync_gib_per_engine=moved, weight_sync_gib_total=moved * num_engines,
                sync_gib=sync, sync_peak_gib=sync["total"], fits_sync=fits_sync,
                active_params=active_param_count(p.model), actor_gpus=actor_gpus, engine_gpus=engine_gpus,
                num_engines=num_engines, buffer_gib=buffer, fits_host=fits_host, actor_phase=worst["phase"])
    if suggest:
        plan.suggestions = suggest_layouts(p)
    return plan


def suggest_layouts(p: PlanInput, limit: int = 5) -> list[dict]:
    """Smallest model-parallel layouts (actor TP x PP, then engine TP) that fit on this many GPUs (the actor's
    layouts over the actor pool)."""
    world = pool_gpus(p)[0]
    tps = [t for t in (1, 2, 4, 8) if t <= p.gpus_per_node]
    budget = budget_gib(p)
    engines = []
    for etp in tps:
        if engine_tp_errors(p.model, etp):  # the config would refuse it
            continue
        q = dataclasses.replace(p, engine_tp=etp)
        need = rollout_memory(q)["total"]
        if need <= budget:
            engines.append((etp, need))
    actor = []
    recomputes = [p.recompute] + (["full"] if p.recompute != "full" else [])
    for rank_order, recompute in enumerate(recomputes):
        for tp in tps:
            for pp in range(1, p.model.num_hidden_layers + 1):
                if tp * pp > world or world % (tp * pp):
                    continue
                try:
                    check_parallelism(p.model, tp, pp, p.sequence_parallel and tp > 1, p.ep, p.etp)
                except ValueError:
                    continue
                if expert_world_errors(tp, derive_data_parallel(tp, pp, world), p.ep, p.etp):
                    continue
                q = dataclasses.replace(p, tp=tp, pp=pp, dp=None, recompute=recompute,
                                        sequence_parallel=p.sequence_parallel and tp > 1)
                _, worst = actor_memory(q, derive_data_parallel(tp, pp, world))
                gib = worst["total"] / GiB
                # colocated: the engine's reservation must fit beside the actor's peak
                buffer = ipc_buffer_gib(q)
                room = budget - gib - buffer if p.placement == "colocated" and not p.sleep_offload else budget - buffer
                fitting = [(etp, need) for etp, need in engines  # at the utilization suggested below
                           if _utilization(p, need) * GPU_MEMORY_GIB[p.gpu] <= room]
                # ... and the weight sync on top of both, with the utilization suggested below
                fitting = [(etp, need) for etp, need in fitting if _sync_fits(q, etp, need, worst)]
                if gib + buffer <= budget and fitting:
                    actor.append((rank_order, tp * pp, tp, pp, recompute, gib, fitting[0]))
    out = []
    for _, _, tp, pp, recompute, gib, (etp, need) in sorted(actor, key=lambda a: a[:5])[:limit]:
        out.append({"actor_tp": tp, "actor_pp": pp, "recompute": recompute, "actor_gib": round(gib, 1),
                    "engine_tp": etp, "engine_gib": round(need, 1),
                    "gpu_memory_utilization": _utilization(p, need)})
    return out


def _sync_fits(q: PlanInput, engine_tp: int, need_gib: float, worst: dict) -> bool:
    q = dataclasses.replace(q, engine_tp=engine_tp, gpu_memory_utilization=_utilization(q, need_gib))
    dp = derive_data_parallel(q.tp, q.pp, pool_gpus(q)[0])
    return sync_memory(q, dp, worst, rollout_memory(q))["total"] <= sync_limit_gib(q)


def _utilization(p: PlanInput, need_gib: float) -> float:
    """The smallest rollout.gpu_memory_utilization (in hundredths) that holds ``need_gib``."""
    return math.ceil(need_gib / GPU_MEMORY_GIB[p.gpu] * 100) / 100


def _entropy_in_loss(algorithm: Mapping[str, Any]) -> bool:
    return bool(algorithm.get("entropy_aware_advantage") or algorithm.get("entropy_balanced_clip"))


def plan_input_from_config(cfg: Mapping[str, Any] | Any, model: str | None = None, gpu: str = "h100-80g",
                           nodes: int | None = None, gpus_per_node: int | None = None, tp: int | None = None,
                           pp: int | None = None, engine_tp: int | None = None) -> PlanInput:
    """The planner's inputs from an experiment config (raw YAML mapping or ``ExperimentConfig``) + overrides."""
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        cfg = dataclasses.asdict(cfg)
    cfg = dict(cfg or {})
    sec = {k: dict(cfg.get(k) or {}) for k in ("model", "actor", "rollout", "data", "trainer", "launcher",
                                                "algorithm")}
    model_name = model or sec["model"].get("config")
    if not model_name:
        raise ValueError("give --model-config NAME or a --config whose model.config names a model")
    mcfg = load_model_config(model_name)
    actor, rollout, launcher, trainer = sec["actor"], sec["rollout"], sec["launcher"], sec["trainer"]
    prompt_tokens = sec["data"].get("max_prompt_tokens", PlanInput.prompt_tokens)
    response_tokens = rollout.get("response_length", PlanInput.response_tokens)
    seq_len = prompt_tokens + response_tokens
    max_len = rollout.get("max_model_len") or seq_len
    use_te = str(actor.get("use_te", "auto")).lower()
    host_bytes = slurm_size_bytes(launcher.get("memory_per_node"))
    host_gib = host_bytes / GiB if host_bytes is not None else None
    return PlanInput(
        model=mcfg, gpu=gpu, nodes=nodes or launcher.get("nodes", 1),
        gpus_per_node=gpus_per_node or launcher.get("gpus_per_node", 8) or 8,
        tp=tp or actor.get("tensor_parallel") or mcfg.defaults.actor_tensor_parallel,
        pp=pp or actor.get("pipeline_parallel") or mcfg.defaults.actor_pipeline_parallel,
        dp=actor.get("data_parallel"), ep=actor.get("expert_parallel", 1),
        etp=actor.get("expert_tensor_parallel"), micro_batch_tokens=actor.get("micro_batch_tokens", 16384),
        seq_len=seq_len, recompute=actor.get("recompute", "none"),
        sequence_parallel=actor.get("sequence_parallel", False),
        distributed_optimizer=actor.get("use_distributed_optimizer", True),
        layer_spec="local" if use_te == "false" else "te", entropy=_entropy_in_loss(sec["algorithm"]),
        engine_tp=engine_tp or rollout.get("tensor_parallel") or mcfg.defaults.rollout_tensor_parallel,
        num_engines=rollout.get("num_engines"), max_model_len=max_len,
        concurrency=rollout.get("max_num_seqs") or 64,
        gpu_memory_utilization=rollout.get("gpu_memory_utilization", 0.6),
        placement=trainer.get("placement", "colocated"),
        sync_bucket_mb=rollout.get("sync_bucket_mb", RolloutSection.sync_bucket_mb),
        sync_transport=rollout.get("sync_transport", RolloutSection.sync_transport),
        # Colocated phases that release each other's memory need both switches (see the module doc).
        sleep_offload=bool(rollout.get("enable_sleep_mode") and actor.get("offload")),
        actor_devices=trainer.get("actor_devices"), rollout_devices=trainer.get("rollout_devices"),
        mode=trainer.get("mode", "sync"), n=rollout.get("n", PlanInput.n), prompt_tokens=prompt_tokens,
        response_tokens=response_tokens,
        train_batch_size=trainer.get("train_batch_size", PlanInput.train_batch_size),
        max_staleness=rollout.get("max_staleness", RolloutSection.max_staleness),
        buffer_groups=rollout.get("buffer_groups"), host_memory_gib=host_gib)


def plan_from_config(cfg: Mapping[str, Any] | Any, **overrides) -> Plan:
    """A plan from an experiment config plus CLI overrides (see :func:`plan_input_from_config`)."""
    return make_plan(plan_input_from_config(cfg, **overrides))


def format_sync(plan: Plan) -> list[str]:
    """The weight-sync phase of a GPU, one line per item."""
    i, g = plan.inputs, plan.sync_gib
    transport = i["sync_transport"] if i["sync_transport"] != "auto" else \
        ("ipc" if i["placement"] == "colocated" else "nccl")
    ok = {True: "fits", False: "DOES NOT FIT"}
    return [f"weight sync ({transport}, buckets of {i['sync_bucket_mb']} MiB) on one GPU:",
            f"  held when it starts: {g['held']:.1f} GiB",
            f"  sync buffer (largest bucket): {g['buffer']:.2f} GiB",
            f"  vLLM's clone of a bucket: {g['vllm_clone']:.2f} GiB",
            f"  NCCL communicators: {g['nccl']:.2f} GiB",
            f"  fragmentation margin ({i['fragmentation']:.0%}): {g['fragmentation']:.1f} GiB",
            f"  sync peak: {plan.sync_peak_gib:.1f} GiB of {GPU_MEMORY_GIB[i['gpu']] - i['overhead_gib']:.1f} GiB "
            f"(the GPU less the {i['overhead_gib']} GiB overhead) -> {ok[plan.fits_sync]}"]


def format_pools(plan: Plan) -> list[str]:
    """Separate placement: which GPUs the actor and the engines own (nothing when colocated)."""
    i = plan.inputs
    if i["placement"] != "separate":
        return []
    idle = plan.world - plan.actor_gpus - plan.engine_gpus
    return [f"GPU pools (separate): actor {plan.actor_gpus} GPUs (TP {i['tp']} x PP {i['pp']} x DP {plan.dp}), "
            f"engines {plan.engine_gpus} GPUs ({plan.num_engines} engines x TP {i['engine_tp']})"
            + (f", {idle} GPUs unused" if idle > 0 else "")]


def format_buffer(plan: Plan) -> list[str]:
    """Off-policy mode: the rollout buffer in the driver's host memory (nothing in sync mode)."""
    b, i = plan.buffer_gib, plan.inputs
    if not b:
        return []
    default = "" if i["buffer_groups"] else f" (({i['max_staleness']} + 1) x {i['train_batch_size']})"
    lines = [f"rollout buffer (off_policy, the driver's host memory on the head node): {b['groups']} groups"
             f"{default} x {i['n']} trajectories x ({i['prompt_tokens']} prompt x {BUFFER_BYTES_PER_PROMPT_TOKEN} B "
             f"+ {i['response_tokens']} response tokens x {BUFFER_BYTES_PER_RESPONSE_TOKEN} B) = "
             f"{b['buffer']:.1f} GiB",
             f"  with the batch being trained ({i['train_batch_size']} groups, held in sync mode too): "
             f"{b['total']:.1f} GiB"]
    if plan.fits_host is None:
        lines[-1] += "; the node's memory is not in the config (launcher.memory_per_node): not checked"
    else:
        ok = "fits" if plan.fits_host else "DOES NOT FIT"
        lines[-1] += (f" of the node's {i['host_memory_gib']:.0f} GiB (launcher.memory_per_node, "
                      f"{i['headroom']:.0%} headroom) -> {ok}")
    return lines


def format_plan(plan: Plan) -> str:
    i = plan.inputs
    ok = {True: "fits", False: "DOES NOT FIT"}
    a, r = plan.actor_gib, plan.rollout_gib
    step = " (at the optimizer step)" if plan.actor_phase == "optimizer_step" else ""
    if i["placement"] == "colocated":
        mode = "phases swap (vLLM sleep + actor offload)" if i["sleep_offload"] else \
            "actor peak + vLLM reservation on every GPU"
        phase = f"colocated ({mode}): {plan.colocated_peak_gib:.1f} GiB -> {ok[plan.fits]}"
    else:
        phase = f"separate: actor {plan.actor_peak_gib:.1f} GiB, rollout {plan.rollout_reserved_gib:.1f} GiB -> {ok[plan.fits]}"
    lines = [
        f"model {i['model']} ({plan.total_params:,} parameters"
        + (f", {plan.active_params:,} active per token" if plan.active_params != plan.total_params else "")
        + f") on {i['nodes']} x {i['gpus_per_node']} {i['gpu']} "
        f"(budget {plan.budget_gib:.1f} GiB/GPU after {i['headroom']:.0%} headroom and {i['overhead_gib']} GiB overhead)",
        *format_pools(plan),
        f"actor: TP={i['tp']} PP={i['pp']} DP={plan.dp}"
        + (f" EP={i['ep']} expert TP={i['etp'] or i['tp']}" if i['ep'] > 1 or i['etp'] else "")
        + f", distributed optimizer {i['distributed_optimizer']}, "
        f"recompute {i['recompute']}, SP {i['sequence_parallel']}, {i['layer_spec']} layer spec, "
        f"{i['micro_batch_tokens']} tokens/micro-batch",
        "  params per GPU by stage: " + ", ".join(f"pp{k}={v:,}" for k, v in plan.params_per_rank.items()),
        f"  worst stage pp{plan.worst_stage}{step}: params {a['params']:.1f} + grads {a['grads']:.1f} + optimizer "
        f"{a['optimizer']:.1f} + activations {a['activations']:.1f} + temporaries {a['temporaries']:.1f} = "
        f"{plan.actor_peak_gib:.1f} GiB -> {ok[plan.fits_actor]}",
        f"rollout: engine TP={i['engine_tp']}, {i['concurrency']} seqs x {i['max_model_len']} tokens: weights "
        f"{r['weights']:.1f} + KV cache {r['kv_cache']:.1f} = {plan.rollout_peak_gib:.1f} GiB in vLLM's "
        f"{plan.rollout_reserved_gib:.1f} GiB (gpu_memory_utilization {i['gpu_memory_utilization']}) -> "
        f"{ok[plan.fits_rollout]}",
        phase,
        f"weight sync per step: {plan.weight_sync_gib_per_engine:.1f} GiB per engine, "
        f"{plan.weight_sync_gib_total:.1f} GiB to all engines",
        *format_sync(plan),
        *format_buffer(plan),
    ]
    if plan.suggestions:
        lines.append("layouts that fit (actor TP x PP, engine TP, rollout.gpu_memory_utilization):")
        lines += [f"  TP={s['actor_tp']} PP={s['actor_pp']} recompute={s['recompute']} ({s['actor_gib']} GiB), "
                  f"engine TP={s['engine_tp']} ({s['engine_gib']} GiB, utilization >= {s['gpu_memory_utilization']})"
                  for s in plan.suggestions]
    else:
        lines.append("no layout fits on this many GPUs: add nodes, enable recompute or lower micro_batch_tokens")
    return "\n".join(lines)
