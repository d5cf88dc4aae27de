"""One Megatron rank of the actor group: a plain class (no Ray) that the cluster layer wraps per rank.

``MegatronActorWorker(cfg, rank, world_size, master_addr, master_port, role)`` joins the default process
group (gloo on CPU, NCCL on GPU) unless one exists, builds Megatron's TP/PP/DP groups from
``cfg.actor`` (DP = world / (TP x PP)), and then serves:

- ``init_model(hf_dir=None, load_dir=None, total_steps=None)``: GPTModel for this stage from the model
  config (local spec on CPU, TE on GPU), HF weights through the conversion tables, and for the policy
  Megatron DDP + optimizer + LR schedule; ``load_dir`` resumes from a checkpoint (returns its extra state).
- ``compute_log_probs(batch, with_entropy=False)`` -> ``{"logprobs": [tensor per sequence], "entropy": [...],
  "padding_fraction": float}``, token-aligned: value ``t`` is log p(token t | tokens < t) and the entropy
  of that predictive distribution (after ``rollout.temperature``); value 0 is 0. Every rank of a DP
  replica returns the same result (broadcast from the last pipeline stage).
- ``role="reference"``: same model, frozen, no DDP/optimizer (log-probs and export only).
- ``update(batch)`` -> metrics (PPO over mini-batches x ``actor.ppo_epochs``); ``sft_step(batch)`` -> metrics.
- ``save(dir, extra_state, step=None)``, ``load(dir)`` -> extra state (see ``megatron_arpo.actor.checkpoint``).
- ``reserve_weight_sync`` / ``open_weight_sync`` / ``send_weights(sync_id, ...)`` /
  ``close_weight_sync``: this rank's part of the weight sync to the rollout engines (each pipeline
  stage's sender streams its layers; ``megatron_arpo.actor.sync_sender``).
- ``iter_weight_buckets(bucket_bytes)``: the whole model's HF tensors, bucket by bucket, on every rank
  of a DP replica (HF checkpoint export).
- ``offload_state()`` / ``onload_state()`` (policy): grad buffers freed and optimizer state moved to the
  host between updates, and back (``megatron_arpo.actor.offload``; colocated ``actor.offload``). An
  update refuses to run offloaded; a save or load onloads for its duration.
- ``shutdown()``.

Batches are plain data, one shard per DP rank (:func:`megatron_arpo.actor.packing.split_for_data_parallel`);
all ranks of one DP replica (its TP x PP ranks) must receive the same shard. Keys, one entry per sequence:
``input_ids`` (token-id lists), ``loss_mask`` (token-aligned 0/1; 1 = trained), ``advantages`` (a float
or token-aligned values), ``old_logprobs`` and, when ``algorithm.kl.coef > 0``, ``ref_logprobs``
(token-aligned, as ``compute_log_probs`` returns them), in off-policy mode ``behav_weights`` (token-aligned
factors on each token's loss, ``megatron_arpo.algo.off_policy``), optionally ``group_ids`` (PPO mini-batches hold
``actor.mini_batch_size`` groups) or the ``mini_batch``/``num_mini_batches`` entries the split adds.
With ``actor.moe_routing_replay`` (MoE) the passes also take ``routed_experts`` (per sequence,
``[tokens, layers, topk]`` expert ids, -1 = not recorded) and force them (``megatron_arpo.actor.routing_replay``);
``compute_log_probs(batch, record_routing=True)`` returns the actor's own routing under that key.

Only rank-local state lives here; collectives are inside the methods, so every rank of the group must
call the same methods in the same order.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import os
import time
from functools import partial
from typing import Any, Iterator

import torch
import torch.distributed as dist

from megatron_arpo.actor import model_builder, packing, routing_replay
from megatron_arpo.actor.hf_export import write_hf_checkpoint
from megatron_arpo.actor.hf_live import export_hf_buckets, load_hf_into_megatron
from megatron_arpo.actor.logprobs import build_micro_batch, install_position_rope
from megatron_arpo.actor.model_builder import initialize_model_parallel
from megatron_arpo.actor.offload import StateOffloader
from megatron_arpo.actor.optimizer import build_optimizer, current_lr, settings_from_actor
from megatron_arpo.actor.sync_sender import ActorSync
from megatron_arpo.actor.training import (VocabInfo, collective_device, entropy_moments_pass,
                                          logprob_loss, ppo_loss, run_schedule, sft_loss, train_micro_batches)
from megatron_arpo.algo.losses import entropy_stats_from_moments
from megatron_arpo.config import resolved_model
from megatron_arpo.config_schema import AlgorithmSection
from megatron_arpo import determinism
from megatron_arpo.device.cpu_compat import apply_cpu_compat

logger = logging.getLogger(__name__)

ROLES = ("policy", "reference")
DEFAULT_EXPORT_BUCKET_BYTES = 512 * 2**20
MAX_AGREED_MICRO_BATCHES = 1024  # EP > 1: micro-batches per pass the schedule agreement carries (one all-reduce)
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def _as_list(values) -> list:
    return values.tolist() if isinstance(values, torch.Tensor) else list(values)


class MegatronActorWorker:
    def __init__(self, cfg, rank: int, world_size: int, master_addr: str = "127.0.0.1", master_port: int = 29500,
                 role: str = "policy", *, model_cfg=None, packing_mode: str = "packed", row_tokens: int | None = None,
                 timeout_s: float = 1800.0):
        if role not in ROLES:
            raise ValueError(f"role {role!r} is not supported; allowed: {ROLES}")

        self.cfg, self.role = cfg, role
        self.actor = cfg.actor
        # Before NCCL, cuBLAS or Transformer Engine start: they read the variables when they do.
        self.deterministic = determinism.enabled(cfg)
        determinism.apply_actor_settings(self.deterministic)
        if model_cfg is None:
            model_cfg = resolved_model(cfg)
        self.model_cfg = model_cfg
        self.parallel = cfg.layout.for_world(world_size, self.actor.data_parallel)
        self.tp, self.pp, self.dp = self.parallel.tp, self.parallel.pp, self.parallel.dp
        self.packing_mode, self.row_tokens = packing_mode, row_tokens
        self._owns_process_group = False
        if not dist.is_initialized():
            os.environ.setdefault("MASTER_ADDR", str(master_addr))
            os.environ.setdefault("MASTER_PORT", str(master_port))
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            dist.init_process_group(backend, init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                    world_size=world_size, timeout=datetime.timedelta(seconds=timeout_s))
            self._owns_process_group = True
        elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
            raise RuntimeError(f"a process group exists with rank {dist.get_rank()}/{dist.get_world_size()}, "
                               f"but this worker is rank {rank}/{world_size}")
        if torch.cuda.is_available():
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank % torch.cuda.device_count())))
        apply_cpu_compat()
        initialize_model_parallel(self.tp, self.pp, seed=self.actor.seed, expert_parallel=self.parallel.ep,
                                  expert_tensor_parallel=self.parallel.etp)
        self.rank, self.world_size = rank, world_size
        self.step = 0
        self.model = self.ddp_model = self.chunk = self.optimizer = self.scheduler = self.rope = None
        self.offloader = None
        self.hf_dir = None
        rollout = getattr(cfg, "rollout", None)
        self.temperature = float(getattr(rollout, "temperature", 1.0)) if rollout is not None else 1.0
        algorithm = getattr(cfg, "algorithm", None)
        # The loss reads the algorithm section as the config defines it (clip, dual clip, AEPO, KL).
        self.loss_settings = algorithm if algorithm is not None else AlgorithmSection()

    # ------------------------------------------------------------------------------------------ setup
    def init_model(self, hf_dir: str | None = None, load_dir: str | None = None, total_steps: int | None = None,
                   optim_settings=None) -> dict | None:
        """Build this rank's stage; load HF weights (``hf_dir`` or ``model.hf_checkpoint``) or a checkpoint.

        ``total_steps`` (optimizer steps of the run) is needed by the cosine schedule; by default it is
        derived from ``trainer.total_steps``. ``optim_settings`` overrides the optimizer settings (SFT).
        """
        self._compat()
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core import parallel_state
        from megatron.core.distributed import (DistributedDataParallel, DistributedDataParallelConfig,
                                               finalize_model_grads)

        budget = max(self.actor.micro_batch_tokens, self.actor.logprob_micro_batch_tokens or 0)
        self.use_te = model_builder.resolve_use_te(self.actor.use_te_flag, micro_batch_tokens=budget)
        if self.use_te and self.parallel.ep > 1:  # at start-up, not at the first pass (_agree_plans)
            raise NotImplementedError("packed THD micro-batches (Transformer Engine) at actor.expert_parallel > 1 "
                                      "are not padded to the expert-parallel group's micro-batch schedule yet; set "
                                      "actor.use_te: false")
        self.params_dtype = _DTYPES[self.actor.params_dtype]
        model = model_builder.build_gpt_model(
            self.model_cfg, tensor_parallel=self.tp, pipeline_parallel=self.pp, params_dtype=self.params_dtype,
            use_te=self.use_te, recompute=self.actor.recompute, sequence_parallel=self.actor.sequence_parallel,
            deterministic=self.deterministic, expert_parallel=self.parallel.ep,
            expert_tensor_parallel=self.parallel.etp)
        model.config.variable_seq_lengths = True  # packed micro-batches differ in shape (PP p2p sends shapes)
        self.rope = None if self.use_te else install_position_rope(model)
        if self.model_cfg.is_moe:  # hooks idle (plain routing) unless a pass sets or records routing
            routing_replay.install(model)
        self.model = model  # the bare GPTModel: HF load, checkpoints, export
        placed = model_builder.place_model(model, model.config)  # on the GPU, Float16Module for bf16
        hf_dir = hf_dir or getattr(getattr(self.cfg, "model", None), "hf_checkpoint", None)
        self.hf_dir = hf_dir
        if hf_dir and load_dir is None:
            load_hf_into_megatron(model, self.model_cfg, hf_dir, self.tp_rank, self.tp, self.pp_rank, self.pp,
                                  ep_rank=parallel_state.get_expert_model_parallel_rank(), ep_size=self.parallel.ep,
                                  etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
                                  etp_size=self.parallel.expert_tp)
        if self.role == "reference":
            for param in model.parameters():
                param.requires_grad_(False)
            self.chunk = placed
        else:
            ddp = DistributedDataParallel(
                config=model.config, module=placed,
                ddp_config=DistributedDataParallelConfig(
                    use_distributed_optimizer=self.actor.use_distributed_optimizer, grad_reduce_in_fp32=True,
                    overlap_grad_reduce=False))
            model.config.finalize_model_grads_func = finalize_model_grads
            model.config.no_sync_func = ddp.no_sync
            self.ddp_model = self.chunk = ddp
            if optim_settings is None:
                optim_settings = settings_from_actor(self.actor, total_steps or self._derived_total_steps())
            self.optimizer, self.scheduler = build_optimizer([ddp], optim_settings, self.params_dtype)
            model.config.grad_scale_func = self.optimizer.scale_loss

            self.offloader = StateOffloader([ddp], self.optimizer, model.parameters(), collective_device())
        padded = self.model_cfg.padded_vocab_size(self.tp)
        self.vocab = VocabInfo(vocab_start=self.tp_rank * (padded // self.tp), vocab_size=self.model_cfg.vocab_size,
                               tp_group=parallel_state.get_tensor_model_parallel_group(),
                               temperature=self.temperature)
        if load_dir is not None:
            return self.load(load_dir)
        return None

    def _derived_total_steps(self) -> int | None:
        trainer = getattr(self.cfg, "trainer", None)
        if trainer is None or trainer.total_steps is None:
            return None
        per_step = max(trainer.train_batch_size // self.actor.mini_batch_size, 1)
        return trainer.total_steps * per_step * self.actor.ppo_epochs

    @staticmethod
    def _compat() -> None:
        # The CPU compat mode is per thread; a threaded actor may call from another thread.
        apply_cpu_compat()

    @property
    def tp_rank(self) -> int:
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core import parallel_state

        return parallel_state.get_tensor_model_parallel_rank()

    @property
    def pp_rank(self) -> int:
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core import parallel_state

        return parallel_state.get_pipeline_model_parallel_rank()

    @property
    def dp_rank(self) -> int:
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core import parallel_state

        return parallel_state.get_data_parallel_rank()

    @property
    def streams_hf_weights(self) -> bool:
        """Whether this rank takes part in the HF weight stream (HF export, weight sync to gloo/nccl engines).

        Data-parallel replica 0, and with expert parallelism the replicas that hold the other experts
        (expert-data-parallel rank 0: each sends its own experts in the weight sync, and shares them over the EP
        group in the HF export; ``hf_live.stage_hf_buckets``).
        """
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core import parallel_state

        if self.parallel.ep == 1:
            return self.dp_rank == 0
        if self.parallel.expert_tp != self.tp:
            raise NotImplementedError(
                f"streaming HF weights (weight sync, HF export) with actor.expert_parallel {self.parallel.ep} needs "
                f"the experts split like the other layers: set actor.expert_tensor_parallel to "
                f"actor.tensor_parallel ({self.tp}) or null, not {self.parallel.expert_tp}")
        return parallel_state.get_expert_data_parallel_rank() == 0

    @property
    def is_last_stage(self) -> bool:
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core import parallel_state

        return parallel_state.is_pipeline_last_stage(ignore_virtual=True)

    def _require(self, policy: bool = False) -> None:
        if self.model is None:
            raise RuntimeError("call init_model() before using the worker")
        if policy and self.role != "policy":
            raise RuntimeError(f"this worker has role {self.role!r}; training and saving need role 'policy'")

    def _require_resident(self, what: str) -> None:
        if self.offloader is not None and self.offloader.offloaded:
            raise RuntimeError(f"rank {self.rank}: {what} with the optimizer state offloaded; call onload_state() "
                               f"first (the colocated phase switch, megatron_arpo.trainer.phases, does it)")

    def offload_state(self) -> dict[str, float]:
        """Grad buffers freed, optimizer state to the host (``megatron_arpo.actor.offload``); the weights stay."""
        self._compat()
        self._require()
        return self.offloader.offload() if self.offloader is not None else {}

    def onload_state(self) -> dict[str, float]:
        self._compat()
        self._require()
        return self.offloader.onload() if self.offloader is not None else {}

    def offloaded_bytes(self) -> dict[str, int]:
        """What the grad buffers and the optimizer state hold on the device now."""
        return self.offloader.resident_bytes() if self.offloader is not None else {}

    @property
    def _pad_multiple(self) -> int:
        # Sequence parallelism splits every row over the TP ranks: rows must divide evenly, and only then.
        return self.tp if self.model.config.sequence_parallel else 1

    def _plan(self, lengths: list[int], budget: int) -> list[packing.MicroBatchPlan]:
        # THD flattens a micro-batch into one row anyway: no reason to cut rows.
        row_tokens = budget if self.use_te else self.row_tokens
        return packing.plan_micro_batches(lengths, budget, row_tokens=row_tokens, mode=self.packing_mode,
                                          pad_to_multiple=self._pad_multiple)

    def _agree_plans(self, plans: list[packing.MicroBatchPlan]) -> list[packing.MicroBatchPlan]:
        """At expert parallelism > 1: the plans padded to the schedule the expert-parallel group agrees on.

        The MoE token dispatcher's collectives span the data-parallel replicas of an EP group (the
        all-gather dispatcher needs the same token count on every rank; any dispatcher needs every rank to
        run the same number of forwards). One all-reduce MAX over the stage's expert TP x EP group gives
        the number of micro-batches and each one's ``(rows, row_length)``; the padding rows and micro-
        batches hold no target, so they add nothing to the loss, the log-probs or the metrics. Dense
        models (EP 1) keep their own plans.
        """
        if self.parallel.ep == 1:
            return plans
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core import parallel_state

        group = parallel_state.get_expert_tensor_and_model_parallel_group()  # no TE here: refused at init
        limit = 1 + 2 * MAX_AGREED_MICRO_BATCHES
        if len(plans) > MAX_AGREED_MICRO_BATCHES:
            raise ValueError(f"{len(plans)} micro-batches on one rank; at expert_parallel > 1 at most "
                             f"{MAX_AGREED_MICRO_BATCHES} are supported: raise actor.micro_batch_tokens")
        vec = torch.zeros(limit, dtype=torch.long)
        vec[0] = len(plans)
        for i, plan in enumerate(plans):
            vec[1 + 2 * i], vec[2 + 2 * i] = len(plan.rows), plan.row_length
        vec = vec.to(collective_device())
        dist.all_reduce(vec, op=dist.ReduceOp.MAX, group=group)
        vec = vec.cpu()
        count = int(vec[0])
        shapes = [(int(vec[1 + 2 * i]), int(vec[2 + 2 * i])) for i in range(count)]
        return packing.pad_plans(plans, shapes)

    def _micro_batches(self, plans, seqs, extras=None, routing=None) -> list:
        mbs = [build_micro_batch(p, seqs, extras, use_thd=self.use_te, pad_to_multiple=self._pad_multiple)
               for p in plans]
        if routing is not None:
            shape = (self.model_cfg.num_hidden_layers, self.model_cfg.num_experts_per_tok)
            for mb in mbs:
                mb.routing = routing_replay.gather_routing(mb.plan, routing, *shape)
        return mbs

    def _replayed_routing(self, batch: dict, indices=None) -> list | None:
        """The batch's recorded experts when ``actor.moe_routing_replay`` is on (required then), else None."""
        if not getattr(self.actor, "moe_routing_replay", False):
            return None
        if batch.get("routed_experts") is None:
            raise ValueError("actor.moe_routing_replay is on but the batch has no routed_experts (each token's "
                             "experts recorded by the rollout engine); pass them, or set actor.moe_routing_replay: false")
        routed = batch["routed_experts"]
        return list(routed) if indices is None else [routed[i] for i in indices]

    # ------------------------------------------------------------------------------------- log-probs
    def compute_log_probs(self, batch: dict, with_entropy: bool = False, record_routing: bool = False) -> dict[str, Any]:
        self._compat()
        self._require()
        if record_routing and (not self.model_cfg.is_moe or self.pp > 1 or self.actor.sequence_parallel):
            raise ValueError("record_routing needs an MoE model at actor.pipeline_parallel 1 without "
                             "actor.sequence_parallel (each rank must route every token of every layer)")
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core import parallel_state

        seqs = [_as_list(s) for s in batch["input_ids"]]
        lengths = [len(s) for s in seqs]
        budget = self.actor.logprob_micro_batch_tokens or self.actor.micro_batch_tokens
        plans = self._plan(lengths, budget)
        mbs = self._micro_batches(self._agree_plans(plans), seqs, routing=self._replayed_routing(batch))
        if record_routing:
            routing_replay.record_routing(self.model)
        with torch.no_grad():
            reduced = run_schedule([self.chunk], mbs, partial(logprob_loss, self.vocab, with_entropy),
                                   forward_only=True, rope=self.rope)
        keys = ["logp"] + (["entropy"] if with_entropy else [])
        total = sum(lengths)
        flat = torch.zeros(len(keys), total, dtype=torch.float32)
        if self.is_last_stage:
            starts = [0]
            for n in lengths:
                starts.append(starts[-1] + n)
            for plan, out in zip(plans, reduced):  # agreed padding micro-batches (EP > 1) come last: dropped
                for k, key in enumerate(keys):
                    for idx, vals in packing.unpack_token_values(plan, out[key]).items():
                        flat[k, starts[idx]:starts[idx + 1]] = vals
        if self.pp > 1:
            flat = flat.to(collective_device())
            dist.broadcast(flat, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                           group=parallel_state.get_pipeline_model_parallel_group())
            flat = flat.cpu()  # results leave the worker as host tensors
        result: dict[str, Any] = {"padding_fraction": packing.padding_fraction(plans)}
        if record_routing:
            recorded: dict[int, torch.Tensor] = {}
            for i, mb in enumerate(mbs):  # agreed padding micro-batches (EP > 1) hold no sequence
                rows = routing_replay.recorded_routing(self.model, i, *mb.tokens.shape)
                recorded.update(routing_replay.split_recorded(mb.plan, rows))
            routing_replay.stop_recording(self.model)
            result["routed_experts"] = [recorded[i] for i in range(len(seqs))]
        names = {"logp": "logprobs", "entropy": "entropy"}
        for k, key in enumerate(keys):
            result[names[key]] = list(flat[k].split(lengths))
        return result

    # ------------------------------------------------------------------------------------------ PPO
    def update(self, batch: dict) -> dict[str, float]:
        """PPO/ARPO/AEPO update over this rank's shard: ``actor.ppo_epochs`` x mini-batches optimizer steps."""
        self._compat()
        self._require(policy=True)
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core import parallel_state

        self._require_resident("update")
        s = self.loss_settings
        need = ["input_ids", "loss_mask", "advantages", "old_logprobs"] + (["ref_logprobs"] if s.kl.coef > 0 else [])
        missing = [k for k in need if k not in batch]
        if missing:
            raise ValueError(f"update batch lacks {missing}; old_logprobs (and ref_logprobs when algorithm.kl.coef > 0) "
                             f"come from compute_log_probs before the update")
        seqs = [_as_list(x) for x in batch["input_ids"]]
        masks = [torch.as_tensor(_as_list(m), dtype=torch.float32) for m in batch["loss_mask"]]
        for i, (seq, mask) in enumerate(zip(seqs, masks)):
            if mask.numel() != len(seq):
                raise ValueError(f"sequence {i}: loss_mask has {mask.numel()} entries for {len(seq)} tokens")
            mask[0] = 0.0  # token 0 has no prediction
        weights = [m / m.sum().clamp(min=1.0) if s.aggregation == "seq-mean-token-mean" else m for m in masks]
        mini = packing.assign_mini_batches(batch, self.actor.mini_batch_size)
        num_mini = int(batch.get("num_mini_batches", max(mini) + 1))
        dp_group = parallel_state.get_data_parallel_group()
        per_step, grad_norms, padding, tokens = [], [], [], 0
        start = time.perf_counter()
        for _ in range(self.actor.ppo_epochs):
            for m in range(num_mini):
                idx = [i for i, b in enumerate(mini) if b == m]
                if not idx:
                    raise ValueError(f"this rank has no sequence in mini-batch {m}; split the batch with "
                                     f"split_for_data_parallel so every rank gets part of every mini-batch")
                count = sum(float(masks[i].sum()) for i in idx) if s.aggregation == "token-mean" else float(len(idx))
                local = torch.tensor([count, sum(len(seqs[i]) for i in idx), sum(float(masks[i].sum()) for i in idx)],
                                     dtype=torch.float64, device=collective_device())
                dist.all_reduce(local, group=dp_group)
                norm_total = max(float(local[0]), 1.0)
                tokens += int(local[1])
                sub = [seqs[i] for i in idx]
                extras = {"loss_mask": [masks[i] for i in idx], "loss_weight": [weights[i] for i in idx],
                          "advantages": [batch["advantages"][i] for i in idx],
                          "old_logprobs": [batch["old_logprobs"][i] for i in idx]}
                if s.kl.coef > 0:
                    extras["ref_logprobs"] = [batch["ref_logprobs"][i] for i in idx]
                if "behav_weights" in batch:  # trainer.mode: off_policy (megatron_arpo/algo/off_policy.py)
                    extras["behav_weights"] = [batch["behav_weights"][i] for i in idx]
                plans = self._plan([len(x) for x in sub], self.actor.micro_batch_tokens)
                padding.append((sum(p.num_slots for p in plans), sum(p.num_tokens for p in plans)))
                mbs = self._micro_batches(self._agree_plans(plans), sub, extras, self._replayed_routing(batch, idx))
                stats = None
                if s.entropy_aware_advantage:
                    moments = entropy_moments_pass([self.chunk], mbs, self.vocab, self.rope, dp_group)
                    stats = entropy_stats_from_moments(moments) if moments is not None else None
                normalizer = norm_total / (self.dp * len(mbs))
                loss_fn = partial(ppo_loss, s, self.vocab, normalizer, stats, False)
                sums, grad_norm, _ = train_micro_batches(self.ddp_model, self.optimizer, self.scheduler, mbs,
                                                         loss_fn, self.rope)
                grad_norms.append(grad_norm)
                if self.is_last_stage:
                    per_step.append(self._reduce_step_sums(sums, norm_total, float(local[2]), dp_group))
        elapsed = time.perf_counter() - start
        self.step += 1
        metrics = self._broadcast_metrics(self._summarise(per_step) if self.is_last_stage else None)
        slots, real = (sum(x) for x in zip(*padding))
        metrics.update(grad_norm=sum(grad_norms) / len(grad_norms), grad_norm_max=max(grad_norms),
                       lr=self._lr(), padding_fraction=1.0 - real / slots, tokens=float(tokens),
                       tokens_per_s=tokens / elapsed if elapsed > 0 else float("nan"),
                       num_optimizer_steps=float(len(grad_norms)))
        return metrics

    def _reduce_step_sums(self, sums, norm_total, num_tokens, dp_group) -> dict[str, float]:
        keys = sorted(sums)
        vec = torch.stack([sums[k] for k in keys]).double().to(collective_device())
        dist.all_reduce(vec, group=dp_group)
        total = dict(zip(keys, vec.tolist()))
        weight = max(total.get("weight", 0.0), 1e-12)
        out = {"loss": total["loss"] / norm_total, "pg_loss": total["pg_loss"] / norm_total}
        if "kl" in total:
            out["kl_loss"] = total["kl"] / norm_total
        for key in ("clip_frac", "low_clip_frac", "high_clip_frac", "dual_clip_frac", "approx_kl"):
            out[key] = total[key] / weight
        if "entropy" in total:
            out["entropy"] = total["entropy"] / max(num_tokens, 1.0)
        out["loss_tokens"] = num_tokens
        return out

    @staticmethod
    def _summarise(per_step: list[dict[str, float]]) -> dict[str, float]:
        """Mean over the optimizer steps of one update; trained tokens summed."""
        out = {k: sum(d[k] for d in per_step) / len(per_step) for k in per_step[0] if k != "loss_tokens"}
        out["loss_tokens"] = sum(d["loss_tokens"] for d in per_step)
        out["loss_last"] = per_step[-1]["loss"]
        return out

    def _broadcast_metrics(self, metrics: dict | None) -> dict:
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core import parallel_state

        if self.pp == 1:
            return dict(metrics)
        box = [metrics]
        dist.broadcast_object_list(box, src=parallel_state.get_pipeline_model_parallel_last_rank(),
                                   group=parallel_state.get_pipeline_model_parallel_group())
        return dict(box[0])

    def _lr(self) -> float:
        return current_lr(self.optimizer)

    # ------------------------------------------------------------------------------------------ SFT
    def sft_step(self, batch: dict) -> dict[str, float]:
        """One optimizer step of token-mean NLL over the loss-masked tokens of the (global) batch."""
        self._compat()
        self._require(policy=True)
        self._require_resident("sft_step")
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core import parallel_state

        seqs = [_as_list(x) for x in batch["input_ids"]]
        masks = []
        for i, m in enumerate(batch["loss_mask"]):
            mask = torch.as_tensor(_as_list(m), dtype=torch.float32)
            if mask.numel() != len(seqs[i]):
                raise ValueError(f"sequence {i}: loss_mask has {mask.numel()} entries for {len(seqs[i])} tokens")
            mask[0] = 0.0
            masks.append(mask)
        dp_group = parallel_state.get_data_parallel_group()
        local = torch.tensor([sum(float(m.sum()) for m in masks), sum(len(x) for x in seqs)], dtype=torch.float64,
                             device=collective_device())
        dist.all_reduce(local, group=dp_group)
        num_tokens = max(float(local[0]), 1.0)
        plans = self._plan([len(x) for x in seqs], self.actor.micro_batch_tokens)
        mbs = self._micro_batches(self._agree_plans(plans), seqs, {"loss_mask": masks})
        start = time.perf_counter()
        sums, grad_norm, _ = train_micro_batches(self.ddp_model, self.optimizer, self.scheduler, mbs,
                                                 partial(sft_loss, self.vocab, num_tokens / (self.dp * len(mbs))),
                                                 self.rope)
        elapsed = time.perf_counter() - start
        metrics = None
        if self.is_last_stage:
            vec = torch.stack([sums["loss"], sums["tokens"]]).double().to(collective_device())
            dist.all_reduce(vec, group=dp_group)
            metrics = {"loss": float(vec[0]) / num_tokens, "loss_tokens": float(vec[1])}
        metrics = self._broadcast_metrics(metrics)
        self.step += 1
        metrics.update(grad_norm=grad_norm, lr=self._lr(), padding_fraction=packing.padding_fraction(plans),
                       tokens=float(local[1]), tokens_per_s=float(local[1]) / elapsed if elapsed > 0 else float("nan"))
        return metrics

    # ----------------------------------------------------------------------------------- checkpoints
    def _layout(self) -> dict[str, int]:
        return {"tp": self.tp, "pp": self.pp, "dp": self.dp}

    def save(self, dir: str, extra_state: dict | None = None, step: int | None = None,
             keep_last: int | None = None, export_hf: bool | None = None) -> str:
        """Checkpoint into ``dir/step-N`` (N = ``step`` or the number of updates so far); collective."""
        self._compat()
        self._require(policy=True)
        # deferred: pulls in numpy (heavy; this module imports without it)
        from megatron_arpo.actor.checkpoint import save_checkpoint

        trainer = getattr(self.cfg, "trainer", None)
        if keep_last is None:
            keep_last = trainer.keep_last if trainer is not None else None
        if export_hf is None:
            export_hf = bool(trainer.export_hf_on_save) if trainer is not None else False
        ck = self.actor.checkpoint
        with self._resident():
            path = save_checkpoint(
                dir, self.step if step is None else step, model=self.model,
                optimizer=self.optimizer if ck.save_optimizer else None, scheduler=self.scheduler,
                model_cfg=self.model_cfg, layout=self._layout(), extra_state=extra_state, keep_last=keep_last,
                tokenizer_dir=self._tokenizer_dir(), fully_parallel=ck.fully_parallel_save,
                hf_writer=self.write_hf_checkpoint if export_hf else None)
        return str(path)

    @contextlib.contextmanager
    def _resident(self) -> Iterator[None]:
        """The optimizer state on the device for a save/load, offloaded again after if it was."""
        was_offloaded = self.offloader is not None and self.offloader.offloaded
        if was_offloaded:
            self.offloader.onload()
        try:
            yield
        finally:
            if was_offloaded:
                self.offloader.offload()

    def load(self, dir: str) -> dict:
        """Restore from a checkpoint root / ``step-N`` / Megatron checkpoint; returns its extra state + ``step``."""
        self._compat()
        self._require()
        # deferred: pulls in numpy (heavy; this module imports without it)
        from megatron_arpo.actor.checkpoint import load_checkpoint

        with self._resident():
            info = load_checkpoint(dir, model=self.model, optimizer=self.optimizer, scheduler=self.scheduler,
                                   layout=self._layout(), load_optimizer=self.actor.checkpoint.load_optimizer)
        self.step = info["step"]
        return {"step": info["step"], **info["extra"]}

    def _tokenizer_dir(self) -> str | None:
        model_section = getattr(self.cfg, "model", None)
        return getattr(model_section, "tokenizer", None) or self.hf_dir

    # -------------------------------------------------------------------------------------- export
    def iter_weight_buckets(self, bucket_bytes: int = DEFAULT_EXPORT_BUCKET_BYTES) -> Iterator[list]:
        """Buckets of ``(hf_name, full tensor)`` (collective over this DP replica's TP x PP ranks).

        The tensors are views of one packed buffer per bucket (``megatron_arpo.actor.hf_live.export_hf_buckets``), valid
        until the next bucket. Nothing is cached between calls.
        """
        for _, named in export_hf_buckets(self.model, self.model_cfg, bucket_bytes):
            yield named

    # --------------------------------------------------------------------------------- weight sync
    # The driver (ActorGroup.sync_weights) calls these on every rank; see megatron_arpo.actor.sync_sender.
    def reserve_weight_sync(self, transport: str):
        self._compat()
        self._require()
        return self._sync_state().reserve(transport)

    def open_weight_sync(self, engines, world_size: int, timeout_s: float) -> None:
        self._compat()
        self._sync_state().open(engines, world_size, timeout_s)

    def send_weights(self, sync_id: int, bucket_bytes: int, verify_fraction: float = 0.0) -> dict:
        """This rank's part of one weight sync: a stage sender's report, ``{}`` on the other ranks."""
        self._compat()
        self._require()
        return self._sync_state().send(sync_id, bucket_bytes, verify_fraction)

    def close_weight_sync(self) -> None:
        if getattr(self, "_sync", None) is not None:
            self._sync.close()

    def _sync_state(self):
        if getattr(self, "_sync", None) is None:
            self._sync = ActorSync(self)
        return self._sync

    def write_hf_checkpoint(self, out_dir) -> None:
        """Write an HF checkpoint (safetensors, config, tokenizer) of the current weights; collective."""
        write_hf_checkpoint(self, out_dir)

    def shutdown(self) -> None:
        # deferred: pulls in megatron-core (heavy; this module imports without it)
        from megatron.core import parallel_state

        self.close_weight_sync()
        self.model = self.ddp_model = self.chunk = self.optimizer = self.scheduler = self.offloader = None
        if parallel_state.model_parallel_is_initialized():
            parallel_state.destroy_model_parallel()
        if self._owns_process_group and dist.is_initialized():
            dist.destroy_process_group()
