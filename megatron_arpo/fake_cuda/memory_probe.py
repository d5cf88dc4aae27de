"""Measure one actor rank's GPU memory at real shapes, on fake CUDA: what ``megatron-arpo plan --measure`` runs.

One pipeline stage of an experiment's layout is built exactly as the actor builds it
(:class:`~megatron_arpo.actor.worker.MegatronActorWorker`: bf16 GPTModel on the device under
``Float16Module``, Megatron DDP with fp32 grad buffers, the distributed optimizer) on fake GPU tensors
(``megatron_arpo.fake_cuda.harness``), and runs one PPO optimizer step (``worker.update``) over one full
micro-batch: sequences of the recipe's longest length packed to ``actor.micro_batch_tokens``. The 1F1B
schedule keeps ``pp - stage`` micro-batches in flight on a stage: the activations one micro-batch keeps
from the end of its forward to its backward are measured too, and the extra in-flight ones are added
to the peak (MemTracker follows one forward per module per run). Nothing is allocated: fake tensors have shapes, not storage, so a 32B stage takes
about 0.5 GB of host memory.

Memory is counted with torch's ``MemTracker`` (``torch.distributed._tools.mem_tracker``, as torchtitan's
memory estimator uses it), which follows every tensor storage created under it and classifies it by
what was running: module forward (activations), backward (temporaries: activation gradients and
everything freed within backward), optimizer step (optimizer state). Storages created before it
(parameters, grad buffers, fp32 main parameters) are registered with it. Reported per rank, at the
peak: ``params`` (bf16 weights), ``grads`` (DDP's fp32 grad buffers), ``optimizer`` (fp32 main parameters
and Adam moments of this DP shard, plus step temporaries), ``activations``, ``temporaries``.

Two differences from a GPU run, both stated in the output: the local layer spec runs (Transformer Engine
cannot be installed without CUDA), whose unfused attention keeps ``s x s`` scores; and torch's Adam is
forced to its ``foreach`` implementation, which it picks on a GPU but not for fake tensors.

Run it as ``python -m megatron_arpo.fake_cuda.memory_probe SPEC.json`` in a fresh process (the harness
changes process-wide torch state); it prints one JSON line. SPEC: ``{"config": <experiment config
mapping>, "stage": int}``.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import sys
import time
from typing import Any

from megatron_arpo.config import build_config, resolved_model

logger = logging.getLogger(__name__)

GiB = 1024 ** 3


def probe_batch(seq_len: int, micro_batch_tokens: int, num_micro_batches: int, vocab_size: int) -> dict:
    """Sequences of ``seq_len`` filling ``num_micro_batches`` micro-batches of ``micro_batch_tokens``."""
    per_micro = max(1, micro_batch_tokens // seq_len)
    n = per_micro * num_micro_batches
    seqs = [[(7 * i + t) % (vocab_size - 1) + 1 for t in range(seq_len)] for i in range(n)]
    return {"input_ids": seqs, "loss_mask": [[0] + [1] * (seq_len - 1) for _ in seqs],
            "advantages": [1.0 if i % 2 else -1.0 for i in range(n)],
            "old_logprobs": [[-1.0] * seq_len for _ in seqs], "ref_logprobs": [[-1.0] * seq_len for _ in seqs],
            "group_ids": [0] * n, "num_mini_batches": 1}


def _storage_bytes(tensors) -> int:
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        key = storage._cdata  # the StorageImpl: views of one buffer count once
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


def _flash_attention_classes():
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch
    from megatron.core.transformer.module import MegatronModule

    class FlashFunction(torch.autograd.Function):
        """aten's variable-length flash attention (causal, GQA); its fake kernels allocate what the CUDA
        kernels do: the output and fp32 log-sum-exp forward, q/k/v gradients backward."""

        @staticmethod
        def forward(ctx, q, k, v, cu_seqlens, max_len: int, scale: float):
            out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
                q, k, v, cu_seqlens, cu_seqlens, max_len, max_len, 0.0, True, False, scale=scale)
            ctx.save_for_backward(q, k, v, out, lse, cu_seqlens)
            ctx.extra = (max_len, scale, seed, offset)
            return out

        @staticmethod
        def backward(ctx, grad):
            q, k, v, out, lse, cu = ctx.saved_tensors
            max_len, scale, seed, offset = ctx.extra
            dq, dk, dv = torch.ops.aten._flash_attention_backward(
                grad, q, k, v, out, lse, cu, cu, max_len, max_len, 0.0, True, seed, offset, scale=scale)
            return dq, dk, dv, None, None, None

    class FlashCoreAttention(MegatronModule):
        """Stand-in for Transformer Engine's fused attention in the local spec: O(s) memory per head."""

        def __init__(self, config, layer_number, attn_mask_type, attention_type, attention_dropout=None,
                     softmax_scale=None, cp_comm_type=None, pg_collection=None):
            super().__init__(config=config)
            self.scale = softmax_scale or config.kv_channels ** -0.5

        def forward(self, query, key, value, attention_mask, attn_mask_type=None, attention_bias=None,
                    packed_seq_params=None):
            if packed_seq_params is not None:  # THD: [t, heads/tp, head_dim], sequences given by cu_seqlens
                out = FlashFunction.apply(query, key, value, packed_seq_params.cu_seqlens_q_padded,
                                          packed_seq_params.max_seqlen_q, self.scale)
                return out.reshape(out.shape[0], -1)
            s, b, heads, dim = query.shape  # [s, b, heads/tp, head_dim]; key/value [s, b, groups/tp, head_dim]
            flat = [x.transpose(0, 1).reshape(b * s, x.shape[2], dim) for x in (query, key, value)]
            cu = torch.arange(0, (b + 1) * s, s, dtype=torch.int32, device=query.device)  # one sequence per row
            out = FlashFunction.apply(*flat, cu, s, self.scale)  # [b*s, heads, dim]
            return out.reshape(b, s, heads * dim).transpose(0, 1).contiguous()

    return FlashCoreAttention


def _fused_rms_norm_class():
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch

    class FusedRMSNormFunction(torch.autograd.Function):
        """RMSNorm keeping what fused kernels (TE, apex) keep for backward: the input and fp32 1/rms."""

        @staticmethod
        def forward(ctx, x, weight, eps: float):
            rstd = torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
            ctx.save_for_backward(x, weight, rstd)
            return (x.float() * rstd).to(x.dtype) * weight

        @staticmethod
        def backward(ctx, grad):
            x, weight, rstd = ctx.saved_tensors
            normed = x.float() * rstd
            g = grad.float() * weight.float()
            grad_x = rstd * (g - normed * (g * normed).mean(-1, keepdim=True))
            grad_w = (grad.float() * normed).reshape(-1, x.shape[-1]).sum(0)
            return grad_x.to(x.dtype), grad_w.to(weight.dtype), None

    class FusedRMSNorm(torch.nn.Module):
        def __init__(self, config, hidden_size: int, eps: float = 1e-5, **kwargs):
            super().__init__()
            self.eps = eps
            self.weight = torch.nn.Parameter(torch.ones(hidden_size))
            self.weight.sequence_parallel = bool(config.sequence_parallel)

        def forward(self, x):
            return FusedRMSNormFunction.apply(x, self.weight, self.eps)

    return FusedRMSNorm


def _use_fused_modules(patches: list) -> None:
    """Build the local spec with stand-ins for the TE spec's fused modules (this process only): the flash
    core attention, and RMSNorm keeping only its input and 1/rms (the fused SwiGLU is Megatron's own,
    switched on through ``bias_activation_fusion`` by the caller)."""
    # deferred: pulls in torch (heavy; this module imports without it)
    from megatron_arpo.actor import model_builder

    original = model_builder.get_layer_spec
    flash = _flash_attention_classes()
    original_norm = model_builder.TorchRMSNorm
    model_builder.TorchRMSNorm = _fused_rms_norm_class()
    patches.append(lambda: setattr(model_builder, "TorchRMSNorm", original_norm))

    def get_layer_spec(model_cfg, use_te=None):
        spec = original(model_cfg, use_te)
        attn = spec.submodules.self_attention
        attn_sub = dataclasses.replace(attn.submodules, core_attention=flash)
        return dataclasses.replace(spec, submodules=dataclasses.replace(
            spec.submodules, self_attention=dataclasses.replace(attn, submodules=attn_sub)))

    model_builder.get_layer_spec = get_layer_spec
    patches.append(lambda: setattr(model_builder, "get_layer_spec", original))


def _tracker():
    # deferred: pulls in torch (heavy; this module imports without it)
    from torch.distributed._tools.mem_tracker import MemTracker

    class Tracker(MemTracker):
        def _update_peak_stats(self, peak_state) -> None:
            # Only the rank's peak: MemTracker also refreshes every active module's local peak on every op,
            # which is quadratic in the number of layers (3 minutes for a 32-layer stage).
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap["Total"]:
                    self._peak_mem[dev] = snap["Total"]
                    self._peak_mem_snap[dev] = dict(snap)

        def _track_module_params_and_buffers(self, module, install_grad_hooks=True):
            # Megatron's DDP keeps its param/grad buffers in a list attribute named ``buffers``, which
            # shadows nn.Module.buffers() that MemTracker calls on every module it sees run.
            shadow = vars(module).pop("buffers", None)
            try:
                return super()._track_module_params_and_buffers(module, install_grad_hooks)
            finally:
                if shadow is not None:
                    vars(module)["buffers"] = shadow

    return Tracker()


def _shared_buffer_activations(tracker) -> int:
    """Bytes of Megatron's global memory buffers that ``tracker`` counts as activations. The first forward
    allocates them (the sequence-parallel all-gather's input, the local spec's attention scores) and every
    later micro-batch reuses them: they are held once, not once per micro-batch in flight."""
    # deferred: pulls in megatron-core and torch (heavy; this module imports without them)
    from megatron.core import parallel_state
    from torch.distributed._tools.mem_tracker import _MemRefType

    buffers = getattr(parallel_state, "_GLOBAL_MEMORY_BUFFER", None)
    seen, total = set(), 0
    for t in (buffers.buffer.values() if buffers is not None else ()):
        storage = t.untyped_storage()
        winfo, _ = tracker._WINFO.get(storage, (None, None))
        if winfo is not None and winfo.reftype == _MemRefType.ACT and storage._cdata not in seen:
            seen.add(storage._cdata)
            total += winfo.mem_consumed
    return total


def tracked_update(worker, batch: dict, device) -> dict[str, Any]:
    """One ``worker.update(batch)`` under the tracker, on fake or real CUDA: MemTracker snapshots (bytes by
    category) at the peak before the optimizer step (``train_peak``) and at the overall peak (``peak``), the
    activations one micro-batch keeps at the end of its forward (``kept``; Megatron's global memory buffers,
    held once whatever the number of micro-batches in flight, left out), and the storage bytes of the grad
    buffers and the fp32 main parameters (created before the tracker, so registered with it)."""
    # deferred: pulls in torch (heavy; this module imports without it)
    from torch.distributed._tools.mem_tracker import _ModState
    from torch.optim.optimizer import register_optimizer_step_pre_hook

    inner = [getattr(o, "optimizer", o) for o in getattr(worker.optimizer, "chained_optimizers", [worker.optimizer])]
    ddp = worker.ddp_model
    grad_buffers = [b.grad_data for b in ddp.buffers + ddp.expert_parallel_buffers]
    main_params = [p for opt in inner for g in opt.param_groups for p in g["params"]]
    tracker = _tracker()
    tracker.track_external(worker.model, *grad_buffers, *main_params, *inner)
    before_step: dict = {}

    def snapshot_before_step(optimizer, args, kwargs):
        before_step.setdefault("peak", tracker.get_tracker_snapshot("peak"))

    def shared_after_forward(module, args, output):
        before_step.setdefault("shared", _shared_buffer_activations(tracker))

    hook = register_optimizer_step_pre_hook(snapshot_before_step)
    forward_hook = worker.chunk.register_forward_hook(shared_after_forward)
    try:
        with tracker:
            worker.update(batch)
    finally:
        hook.remove()
        forward_hook.remove()
    # What one micro-batch keeps from its forward until its backward: the activations at the end of the
    # stage's forward. 1F1B holds in_flight of them while the first backward of this stage runs.
    after_fw = tracker.memory_tracking[worker.chunk].snapshots[_ModState.POST_FW][0][device]
    return {"train_peak": before_step["peak"][device], "peak": tracker.get_tracker_snapshot("peak")[device],
            "kept": after_fw.get("Activation", 0) - before_step.get("shared", 0),
            "grads": _storage_bytes(grad_buffers),
            "main": _storage_bytes(main_params)}


def breakdown(snap: dict, grads: int, main: int, extra: int = 0) -> dict[str, int]:
    """A MemTracker snapshot as the planner's lines (``extra``: activations of further in-flight micro-batches)."""
    out = {"params": snap.get("Parameter", 0) + snap.get("Buffer", 0), "grads": grads,
           "optimizer": snap.get("Optstate", 0) + main,
           "activations": snap.get("Activation", 0) + extra, "temporaries": snap.get("Temp", 0)}
    out["other"] = snap["Total"] + extra - sum(out.values())
    return out


def measure_stage(cfg, stage: int) -> dict[str, Any]:
    """Peak memory of global rank ``stage * tp * dp`` (tp 0, dp 0 of ``stage``); call in a fresh process."""
    # deferred: pulls in torch (heavy; this module imports without it)
    import torch

    from megatron_arpo.fake_cuda.harness import fake_cuda

    actor, model_cfg = cfg.actor, resolved_model(cfg)
    tp, pp, dp, world = cfg.layout.tp, cfg.layout.pp, cfg.layout.dp, cfg.layout.world_size
    if not 0 <= stage < pp:
        raise ValueError(f"stage {stage} is outside the {pp} pipeline stages")
    rank = stage * tp * dp
    seq_len = min(cfg.max_sequence_tokens, actor.micro_batch_tokens)
    in_flight = pp - stage
    # On a GPU, use_te auto/true is the TE spec with fused (flash) attention: the local spec runs here with a
    # flash stand-in for its core attention. use_te false is the local spec as it is (s x s scores).
    spec = "local" if actor.use_te == "false" else "te-like"
    # One mini-batch of exactly the probe's sequences on this DP rank; no HF weights (fake tensors).
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hf_checkpoint=None),
                              actor=dataclasses.replace(actor, mini_batch_size=1, ppo_epochs=1, use_te="false"))
    undo: list = []
    if spec == "te-like":
        _use_fused_modules(undo)
    start = time.perf_counter()
    with fake_cuda(world, rank) as session:
        # deferred: pulls in numpy, torch (heavy; this module imports without it)
        from megatron_arpo.actor.checkpoint import init_empty_optimizer_state
        from megatron_arpo.actor.worker import MegatronActorWorker

        worker = MegatronActorWorker(cfg, rank, world, model_cfg=model_cfg)
        if stage != pp - 1:  # the update's metrics come from the last stage, which is not run here
            pp_ranks = [s * tp * dp for s in range(pp)]
            session.add_peer_message(pp_ranks[-1], pp_ranks, [{}])
        worker.init_model(total_steps=10)
        inner = [getattr(o, "optimizer", o) for o in getattr(worker.optimizer, "chained_optimizers",
                                                             [worker.optimizer])]
        # The optimizer as it runs on the GPU: with Transformer Engine installed Megatron uses TE's FusedAdam,
        # which updates in place (single-tensor Adam's per-tensor temporaries are the closest here); without
        # it, torch's Adam in the foreach implementation torch picks for CUDA tensors, whose temporaries span
        # the whole shard.
        for opt in inner:
            for group in opt.param_groups:
                group["foreach"] = spec == "local"
        # Adam's moments exist from the first step on; a probe of the first step would otherwise miss them.
        init_empty_optimizer_state(worker.optimizer)
        batch = probe_batch(seq_len, actor.micro_batch_tokens, 1, model_cfg.vocab_size)
        if spec == "te-like":
            # Megatron's fused SwiGLU (what the TE spec's config turns on) keeps only the fc1 output; the
            # worker feeds TE's THD layout (one packed row, cu_seqlens, no dense mask) to the stand-ins.
            worker.model.config.bias_activation_fusion = True
            worker.use_te, worker.rope = True, None
        built_s = time.perf_counter() - start
        tracked = tracked_update(worker, batch, torch.device("cuda", session.local_rank))
        train_peak, peak, kept_per_micro_batch = tracked["train_peak"], tracked["peak"], tracked["kept"]
        grads, main = tracked["grads"], tracked["main"]
        num_params = sum(p.numel() for p in worker.model.parameters())
        micro_batches = len(worker._plan([seq_len] * len(batch["input_ids"]), actor.micro_batch_tokens))
        assert micro_batches == 1, micro_batches
        worker.shutdown()
    for fn in undo:
        fn()
    extra_in_flight = (in_flight - 1) * kept_per_micro_batch

    # The forward/backward peak holds the in-flight micro-batches; the optimizer step comes after the last
    # backward, with every micro-batch's activations released.
    phases = {"forward_backward": breakdown(train_peak, grads, main, extra_in_flight),
              "optimizer_step": breakdown(peak, grads, main) if peak["Total"] > train_peak["Total"] else None}
    phase = max((k for k, p in phases.items() if p), key=lambda k: sum(phases[k].values()))
    worst = phases[phase]
    total = sum(worst.values())
    return {"stage": stage, "rank": rank, "world": world, "tp": tp, "pp": pp, "dp": dp,
            "num_params": num_params, "seq_len": seq_len, "micro_batch_tokens": actor.micro_batch_tokens,
            "micro_batches": micro_batches, "in_flight": in_flight, "kept_per_micro_batch": kept_per_micro_batch, "sequence_parallel": actor.sequence_parallel,
            "recompute": actor.recompute, "layer_spec": spec,
            "peak_bytes": total, "phase": phase, "breakdown_bytes": worst, "phases_bytes": phases,
            "build_s": round(built_s, 1), "run_s": round(time.perf_counter() - start - built_s, 1)}


def main(argv: list[str]) -> int:
    # Megatron compiles its fused kernels with torch.compile; on fake tensors they run eagerly.
    os.environ.setdefault("TORCHDYNAMO_DISABLE", "1")
    # deferred: pulls in torch (heavy; this module imports without it)
    from megatron_arpo.fake_cuda.harness import FakeCudaUnavailable

    spec = json.loads(open(argv[0]).read())
    cfg = build_config(spec["config"])
    try:
        result = measure_stage(cfg, int(spec["stage"]))
    except FakeCudaUnavailable as exc:
        result = {"unavailable": str(exc)}
    print("MEASURED " + json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    logging.basicConfig(level=logging.WARNING)
    sys.exit(main(sys.argv[1:]))
