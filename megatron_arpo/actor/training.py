"""Micro-batch loops through Megatron's pipeline schedule: log-prob passes, PPO steps and SFT steps.

Everything here runs on one rank inside an initialised Megatron parallel state; the worker
(``megatron_arpo.actor.worker``) prepares the micro-batches and owns the model and optimizer.

Loss scaling (exact mini-batch token-mean across micro-batches and data-parallel ranks): Megatron's
schedule divides each micro-batch loss by the rank's number of micro-batches ``M`` and DDP averages the
gradients over the ``D`` data-parallel ranks. A micro-batch therefore returns
``sum(token_loss * weight) / normalizer`` with ``normalizer = N / (D * M)``, where ``N`` is the
mini-batch's global weight total (valid tokens for ``token-mean``, sequences for the ``seq-mean-*``
aggregations, all-reduced over DP). The gradient is then exactly that of ``sum over the mini-batch / N``,
whatever the packing and the DP split. For ``seq-mean-token-mean`` each token weighs
``1 / (valid tokens of its sequence)``; for ``seq-mean-token-sum`` 1. Sequences, not packed rows, are
the "seq" of the seq-mean modes.

AEPO entropy-aware advantages need the mean/std of the current policy's token entropy over the whole
mini-batch before any of its micro-batch losses can be formed. Parameters do not change within a
mini-batch, so a forward-only pass over it (:func:`entropy_moments_pass`) yields exactly the entropies the
training forward will see; its moments are all-reduced over DP. This costs one extra forward per
mini-batch, only when the option is on. The training forward recomputes the entropy (same values) for
the z-score of each token, with no gradient through it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.distributed as dist

from megatron_arpo.actor.logprobs import MicroBatch, run_model, vocab_parallel_logprobs
from megatron_arpo.algo import losses
from megatron_arpo.config_schema import AlgorithmSection

logger = logging.getLogger(__name__)


def collective_device() -> torch.device:
    """Where tensors built for a collective must live: the current GPU (NCCL), else the host (gloo)."""
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


@dataclass(frozen=True)
class VocabInfo:
    vocab_start: int
    vocab_size: int
    tp_group: object
    temperature: float = 1.0

    def logprobs(self, logits: torch.Tensor, targets: torch.Tensor, with_entropy: bool):
        return vocab_parallel_logprobs(logits, targets, vocab_start=self.vocab_start, vocab_size=self.vocab_size,
                                       tp_group=self.tp_group, with_entropy=with_entropy,
                                       temperature=self.temperature)


def run_schedule(model_chunks: list, micro_batches: list[MicroBatch], loss_fn: Callable, *, forward_only: bool,
                 rope) -> list:
    """Megatron's forward-backward schedule over ``micro_batches``; returns the last stage's loss dicts.

    ``loss_fn(mb, logits) -> (loss, dict)`` runs on the last pipeline stage only. Every stage must get
    the same micro-batches (same shapes) in the same order.
    """
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core.pipeline_parallel import get_forward_backward_func

    def forward_step(data_iterator, model):
        mb = next(data_iterator)
        output = run_model(model, mb, rope)
        return output, partial(loss_fn, mb)

    seq_length = max(mb.tokens.shape[1] for mb in micro_batches)
    rows = max(mb.tokens.shape[0] for mb in micro_batches)
    forward_backward = get_forward_backward_func()
    return forward_backward(forward_step_func=forward_step, data_iterator=iter(micro_batches), model=model_chunks,
                            num_microbatches=len(micro_batches), seq_length=seq_length, micro_batch_size=rows,
                            forward_only=forward_only)


def logprob_loss(vocab: VocabInfo, with_entropy: bool, mb: MicroBatch, logits: torch.Tensor):
    """Forward-only 'loss': returns the per-position log-probs (and entropy) as the reduced dict."""
    logp, entropy = vocab.logprobs(logits, mb.targets.to(logits.device), with_entropy)
    out = {"logp": logp.detach().float().cpu()}
    if entropy is not None:
        out["entropy"] = entropy.detach().float().cpu()
    return torch.zeros((), device=logits.device), out


def entropy_moments_pass(model_chunks, micro_batches, vocab: VocabInfo, rope, dp_group) -> torch.Tensor | None:
    """(count, sum, sum of squares) of the current policy's entropy over the mini-batch's trained tokens.

    All-reduced over DP; returned on the last pipeline stage (None elsewhere).
    """
    # deferred: pulls in megatron-core (heavy; this module imports without it)
    from megatron.core import parallel_state

    def loss_fn(mb, logits):
        _, entropy = vocab.logprobs(logits, mb.targets.to(logits.device), True)
        mask = mb.extras["loss_mask"].to(entropy.device)
        return torch.zeros((), device=logits.device), {"moments": losses.entropy_moments(entropy, mask).cpu()}

    with torch.no_grad():
        reduced = run_schedule(model_chunks, micro_batches, loss_fn, forward_only=True, rope=rope)
    if not parallel_state.is_pipeline_last_stage(ignore_virtual=True):
        return None
    moments = torch.stack([r["moments"] for r in reduced]).sum(0).to(collective_device())
    dist.all_reduce(moments, group=dp_group)
    return moments.cpu()


def ppo_loss(settings: AlgorithmSection, vocab: VocabInfo, normalizer: float, entropy_stats, with_entropy: bool,
             mb: MicroBatch, logits: torch.Tensor):
    """One micro-batch of the ARPO/AEPO policy loss (+ KL), scaled for exact mini-batch averaging."""
    dev = logits.device
    need_entropy = with_entropy or settings.entropy_aware_advantage
    logp, entropy = vocab.logprobs(logits, mb.targets.to(dev), need_entropy)
    entropy = entropy.detach() if entropy is not None else None
    x = {k: v.to(dev) for k, v in mb.extras.items()}
    mask, weight = x["loss_mask"], x["loss_weight"]  # [b, s]: binary / aggregation weight, 0 off-target
    adv = x["advantages"]
    if settings.entropy_aware_advantage:
        adv = losses.entropy_aware_advantages(adv, entropy, mask, alpha=settings.entropy_advantage_alpha,
                                              stats=entropy_stats)
    loss, metrics = losses.policy_loss(
        logp, x["old_logprobs"], adv, weight, clip_low=settings.clip_low, clip_high=settings.clip_high,
        dual_clip=settings.dual_clip, aggregation="token-mean",
        entropy_balanced_clip=settings.entropy_balanced_clip, normalizer=normalizer,
        token_weights=x.get("behav_weights"))  # off-policy mode only (megatron_arpo/algo/off_policy.py)
    weight_sum = metrics["num_tokens"]
    sums = {"pg_loss": loss.detach() * normalizer, "weight": weight_sum, "tokens": mask.sum()}
    for key in ("clip_frac", "low_clip_frac", "high_clip_frac", "dual_clip_frac", "approx_kl"):
        sums[key] = metrics[key] * weight_sum
    total = loss
    if settings.kl.coef > 0:
        kl = losses.kl_penalty(logp, x["ref_logprobs"], settings.kl.kind)
        kl_loss = losses.aggregate_loss(kl, weight, "token-mean", normalizer)
        total = total + settings.kl.coef * kl_loss
        sums["kl"] = kl_loss.detach() * normalizer
    sums["loss"] = total.detach() * normalizer
    if entropy is not None:
        sums["entropy"] = (entropy * mask).sum()
    return total, {k: v.detach().double().cpu() for k, v in sums.items()}


def sft_loss(vocab: VocabInfo, normalizer: float, mb: MicroBatch, logits: torch.Tensor):
    """Token-mean NLL over the loss-masked (assistant) tokens of the whole global batch."""
    logp, _ = vocab.logprobs(logits, mb.targets.to(logits.device), False)
    mask = mb.extras["loss_mask"].to(logp.device)
    nll_sum = -(logp * mask).sum()
    sums = {"loss": nll_sum.detach(), "tokens": mask.sum()}
    return nll_sum / normalizer, {k: v.detach().double().cpu() for k, v in sums.items()}


def sum_reduced(reduced: list[dict]) -> dict[str, torch.Tensor]:
    """Sum the per-micro-batch dicts of a schedule run key by key (float64)."""
    out: dict[str, torch.Tensor] = {}
    for item in reduced:
        for key, value in item.items():
            out[key] = out.get(key, torch.zeros((), dtype=torch.float64)) + value
    return out


def train_micro_batches(ddp_model, optimizer, scheduler, micro_batches: list[MicroBatch], loss_fn: Callable,
                        rope) -> tuple[dict[str, torch.Tensor], float, bool]:
    """One optimizer step over ``micro_batches``: ``(summed loss dicts, grad norm, stepped)``.

    The scheduler advances before the step (see ``megatron_arpo.actor.optimizer``).
    """
    ddp_model.zero_grad_buffer()
    optimizer.zero_grad()
    reduced = run_schedule([ddp_model], micro_batches, loss_fn, forward_only=False, rope=rope)
    scheduler.step(1)
    stepped, grad_norm, _ = optimizer.step()
    if not stepped:
        logger.warning("optimizer step skipped (non-finite gradients?)")
    return sum_reduced(reduced), float(grad_norm) if grad_norm is not None else float("nan"), bool(stepped)
