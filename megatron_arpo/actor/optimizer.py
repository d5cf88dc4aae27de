"""Megatron's optimizer and LR schedule from the experiment config.

- Optimizer: ``get_megatron_optimizer`` with an ``OptimizerConfig`` (Adam with decoupled weight decay =
  AdamW, global grad-norm clipping, optionally the distributed optimizer that shards the fp32 state over
  data-parallel ranks). As Megatron does by default, biases and 1-D parameters (norm weights) get no
  weight decay; the ARPO reference (verl/FSDP AdamW) decays every parameter.
- Schedule: Megatron's ``OptimizerParamScheduler`` with linear warmup from 0 over ``warmup_steps`` and then
  ``constant`` or ``cosine`` decay to ``min_lr`` at ``decay_steps``.

Step convention: the scheduler is advanced *before* each optimizer step, so optimizer step ``k`` (1-based)
uses the LR of scheduler step ``k``: with warmup W the first step already has lr/W (Megatron's own loop
advances after the step, which spends the first update at LR 0), and the cosine reaches ``min_lr`` on the
last step.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

LR_SCHEDULES = ("constant", "cosine")


@dataclass(frozen=True)
class OptimSettings:
    lr: float
    min_lr: float
    schedule: str
    warmup_steps: int
    decay_steps: int | None  # needed by cosine; the number of optimizer steps of the whole run
    weight_decay: float
    adam_beta1: float
    adam_beta2: float
    adam_eps: float
    clip_grad: float
    use_distributed_optimizer: bool

    def __post_init__(self):
        if self.schedule not in LR_SCHEDULES:
            raise ValueError(f"lr schedule {self.schedule!r} is not supported; allowed: {LR_SCHEDULES}")
        if self.schedule == "cosine" and not self.decay_steps:
            raise ValueError("the cosine LR schedule needs the run's number of optimizer steps; set "
                             "trainer.total_steps (RL) or pass total_steps to init_model")
        if self.decay_steps is not None and self.warmup_steps >= self.decay_steps and self.schedule == "cosine":
            raise ValueError(f"lr_warmup_steps {self.warmup_steps} must be below the {self.decay_steps} optimizer "
                             f"steps of the run")


def settings_from_actor(actor, decay_steps: int | None = None) -> OptimSettings:
    """RL settings from ``actor.optimizer`` (an ``OptimizerSection``) and ``actor.use_distributed_optimizer``."""
    o = actor.optimizer
    return OptimSettings(lr=o.lr, min_lr=o.min_lr, schedule=o.lr_schedule, warmup_steps=o.lr_warmup_steps,
                         decay_steps=decay_steps, weight_decay=o.weight_decay, adam_beta1=o.adam_beta1,
                         adam_beta2=o.adam_beta2, adam_eps=o.adam_eps, clip_grad=o.clip_grad,
                         use_distributed_optimizer=actor.use_distributed_optimizer)


def settings_for_sft(actor, sft, total_steps: int) -> OptimSettings:
    """SFT: LR, floor, schedule and warmup fraction from ``sft``; Adam/clip/decay from ``actor.optimizer``."""
    o = actor.optimizer
    warmup = int(sft.warmup_fraction * total_steps)
    return OptimSettings(lr=sft.lr, min_lr=sft.min_lr, schedule=sft.lr_schedule,
                         warmup_steps=min(warmup, max(total_steps - 1, 0)),
                         decay_steps=max(total_steps, 1), weight_decay=o.weight_decay,
                         adam_beta1=o.adam_beta1, adam_beta2=o.adam_beta2, adam_eps=o.adam_eps,
                         clip_grad=o.clip_grad, use_distributed_optimizer=actor.use_distributed_optimizer)


def build_optimizer(model_chunks: list, settings: OptimSettings, params_dtype: torch.dtype):
    """``(optimizer, scheduler)`` for the DDP-wrapped model chunks of this rank."""
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler

    config = OptimizerConfig(
        optimizer="adam", lr=settings.lr, min_lr=settings.min_lr, weight_decay=settings.weight_decay,
        adam_beta1=settings.adam_beta1, adam_beta2=settings.adam_beta2, adam_eps=settings.adam_eps,
        clip_grad=settings.clip_grad, use_distributed_optimizer=settings.use_distributed_optimizer,
        bf16=params_dtype == torch.bfloat16, fp16=params_dtype == torch.float16, params_dtype=params_dtype,
        decoupled_weight_decay=True,
    )
    optimizer = get_megatron_optimizer(config, model_chunks)
    # Megatron asserts decay_steps > warmup_steps even for a constant schedule.
    decay_steps = settings.decay_steps or settings.warmup_steps + 1
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if settings.warmup_steps else settings.lr, max_lr=settings.lr,
        min_lr=settings.min_lr, lr_warmup_steps=settings.warmup_steps,
        lr_decay_steps=max(decay_steps, settings.warmup_steps + 1), lr_decay_style=settings.schedule,
        start_wd=settings.weight_decay, end_wd=settings.weight_decay, wd_incr_steps=1,
        wd_incr_style="constant", use_checkpoint_opt_param_scheduler=True,
        override_opt_param_scheduler=False,
    )
    return optimizer, scheduler


def current_lr(optimizer) -> float:
    """The LR of the first parameter group with weight decay (the default group)."""
    groups = optimizer.param_groups
    for group in groups:
        if group.get("wd_mult", 1.0) != 0.0:
            return float(group["lr"])
    return float(groups[0]["lr"]) if groups else 0.0
