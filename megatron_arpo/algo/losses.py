"""Token-level policy losses for ARPO (PPO with dual clip) and AEPO, KL penalties, entropy.

Variants implemented (docs/design/arpo_reference.md §3.2, §4.3):

* ``policy_loss`` — verl 0.4 ``compute_policy_loss`` as ARPO ships it: ratio r = exp(logp - old_logp),
  L = max(-A·r, -A·clip(r, 1-eps_low, 1+eps_high)), and for A < 0 the dual clip
  L = min(L, -A·c). With ``entropy_balanced_clip=True`` it is AEPO's
  ``compute_policy_loss_entropy_balanced_clipping`` part (b): the upper clip bound is a tensor equal
  to 1+eps_high in value whose gradient is (1+eps_high)·∇logp, so tokens with A > 0 and r > 1+eps_high
  keep the gradient -A·(1+eps_high) instead of 0. Loss value and clip metrics are the PPO ones.
  As in the reference this is applied to every such token, not only high-entropy ones (Q12).
* ``entropy_aware_advantages`` — AEPO part (a): A·(1 + alpha·stopgrad(z(H))), z standardised over the
  valid tokens with the unbiased std (std 0 → 1).
* ``kl_penalty`` — verl's k1 / k2 / k3 (``low_var_kl``, clamped to [-10, 10]) estimators.
* ``token_entropy_from_logits`` — full-vocabulary entropy per position (single device; the actor has
  the vocab-parallel version for TP).

Differences from the reference:

* The log-ratio is clamped to [-20, 20] before ``exp`` (as later verl versions do) so an extreme token
  cannot produce inf/NaN; the AEPO bound's gradient is taken from the unclamped log-ratio.
* ``seq-mean-token-mean`` treats a sequence with no valid token as contributing 0 instead of NaN.
* ``normalizer``: the reference's token-mean is per micro-batch (Q2/§3.2). Passing the mini-batch token
  (or sequence) count makes the sum of micro-batch losses the exact mini-batch mean.
* Entropy-aware advantages are computed whenever the caller enables them (the reference only computed
  token entropy when ``entropy_coeff != 0``, which made part (a) dead code, Q2), and their statistics can
  be supplied by the caller (``stats``) so they need not be per micro-batch. A single valid token gets
  std 1 (the reference would produce NaN from a one-element unbiased std).
* ``token_weights`` (off-policy mode only) scale each token's loss: decoupled PPO's behaviour weight
  (``megatron_arpo.algo.off_policy``). Without them the loss is the reference's.
* Metrics: the reference's ``pg_clipfrac_lower`` is our ``dual_clip_frac``; ``low_clip_frac`` (A < 0 and
  r below the lower bound) and ``high_clip_frac`` are extra.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable

import torch

logger = logging.getLogger(__name__)

__all__ = [
    "AGGREGATIONS",
    "KL_KINDS",
    "aggregate_loss",
    "entropy_aware_advantages",
    "entropy_moments",
    "entropy_stats_from_moments",
    "kl_penalty",
    "policy_loss",
    "token_entropy_from_logits",
]

AGGREGATIONS = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean")
_LOG_RATIO_CLAMP = 20.0


def _check_same_shape(**tensors: torch.Tensor) -> torch.Size:
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    first = next(iter(shapes.values()))
    if len(first) != 2 or any(s != first for s in shapes.values()):
        desc = ", ".join(f"{k}={v}" for k, v in shapes.items())
        raise ValueError(f"expected equal [batch, seq] shapes, got {desc}")
    return torch.Size(first)


def _broadcast_advantages(advantages: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    if advantages.dim() == 1 and advantages.shape[0] == shape[0]:
        return advantages.unsqueeze(-1).expand(shape)
    if tuple(advantages.shape) == tuple(shape):
        return advantages
    raise ValueError(
        f"advantages has shape {tuple(advantages.shape)}; expected [batch]={shape[0]} "
        f"(one per sequence) or [batch, seq]={tuple(shape)}"
    )


def aggregate_loss(
    loss_mat: torch.Tensor,
    loss_mask: torch.Tensor,
    aggregation: str = "token-mean",
    normalizer: float | torch.Tensor | None = None,
) -> torch.Tensor:
    """Reduce a [batch, seq] per-token loss to a scalar (verl ``agg_loss`` semantics).

    ``token-mean``: sum over valid tokens / number of valid tokens (+1e-8).
    ``seq-mean-token-sum``: per-sequence sum over valid tokens, mean over sequences.
    ``seq-mean-token-mean``: per-sequence mean over valid tokens, mean over sequences.

    ``normalizer`` replaces the final denominator (valid-token count for ``token-mean``, sequence
    count for the seq-mean modes). For gradient accumulation pass the count over the whole
    mini-batch, so that summing the returned micro-batch losses gives the exact mini-batch mean;
    if the data-parallel reduction averages gradients over ``dp`` ranks, pass the global count
    divided by ``dp``.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; allowed: {', '.join(AGGREGATIONS)}")
    mask = loss_mask.to(loss_mat.dtype)
    masked = loss_mat * mask  # [batch, seq]
    if normalizer is not None and not torch.is_tensor(normalizer) and not normalizer > 0:
        raise ValueError(f"normalizer must be > 0 (a token or sequence count), got {normalizer}")
    if aggregation == "token-mean":
        denom = mask.sum() + 1e-8 if normalizer is None else normalizer
        return masked.sum() / denom
    seq_values = masked.sum(dim=-1)  # [batch]
    if aggregation == "seq-mean-token-mean":
        seq_values = seq_values / mask.sum(dim=-1).clamp(min=1.0)
    denom = seq_values.shape[0] if normalizer is None else normalizer
    return seq_values.sum() / denom


def policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    dual_clip: float = 3.0,
    aggregation: str = "token-mean",
    entropy_balanced_clip: bool = False,
    normalizer: float | torch.Tensor | None = None,
    token_weights: torch.Tensor | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with dual clip (ARPO), optionally AEPO's gradient-preserving upper clip.

    Args:
        logp: ``[batch, seq]`` log-probs of the taken tokens under the current policy (requires grad).
        old_logp: ``[batch, seq]`` log-probs under the rollout-time policy (no grad).
        advantages: ``[batch]`` (broadcast over tokens) or ``[batch, seq]`` (e.g. entropy-aware).
        loss_mask: ``[batch, seq]``, 1 for trained (model-generated) tokens, 0 elsewhere.
        clip_low, clip_high: eps_low / eps_high of the ratio clip.
        dual_clip: c of the dual clip for A < 0 (must be > 1); ``None`` disables it.
        aggregation: one of ``AGGREGATIONS`` (see ``aggregate_loss``).
        entropy_balanced_clip: AEPO's gradient-preserving upper clip.
        normalizer: optional global denominator for exact accumulation, see ``aggregate_loss``.
        token_weights: optional ``[batch, seq]`` no-grad factors on each token's loss (off-policy mode:
            the behaviour importance weights of ``megatron_arpo.algo.off_policy``); None leaves the loss as is.

    Returns:
        ``(loss, metrics)``. ``metrics`` holds detached 0-dim tensors (token means over valid tokens of
        this call): ``clip_frac`` (clipped surrogate active), ``low_clip_frac`` (A < 0 and
        r < 1-eps_low), ``high_clip_frac`` (A > 0 and r > 1+eps_high), ``dual_clip_frac`` (A < 0 and
        the dual clip binds), ``approx_kl`` (mean of old_logp - logp), ``num_tokens``.
    """
    if aggregation not in AGGREGATIONS:
        raise ValueError(f"unknown aggregation {aggregation!r}; allowed: {', '.join(AGGREGATIONS)}")
    if not 0.0 <= clip_low < 1.0 or clip_high < 0.0:
        raise ValueError(
            f"clip_low must be in [0, 1) and clip_high >= 0, got clip_low={clip_low}, clip_high={clip_high}"
        )
    if dual_clip is not None and not dual_clip > 1.0:
        raise ValueError(f"dual_clip must be > 1.0 (reference uses 3.0) or None, got {dual_clip}")
    shape = _check_same_shape(logp=logp, old_logp=old_logp, loss_mask=loss_mask)
    adv = _broadcast_advantages(advantages, shape).to(logp.dtype)
    mask = loss_mask.to(logp.dtype)

    log_ratio = logp - old_logp
    ratio = torch.exp(log_ratio.clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP))
    lower, upper = 1.0 - clip_low, 1.0 + clip_high
    clipped_ratio = torch.clamp(ratio, lower, upper)
    if entropy_balanced_clip:
        # Value 1+eps_high, gradient (1+eps_high)·∇logp: exp(x - sg(x)) is exactly 1 with derivative 1.
        upper_bound = upper * torch.exp(log_ratio - log_ratio.detach())
        clipped_ratio = torch.where(ratio > upper, upper_bound, clipped_ratio)

    loss1 = -adv * ratio
    loss2 = -adv * clipped_ratio
    loss_clip = torch.maximum(loss1, loss2)
    negative = adv < 0
    if dual_clip is not None:
        loss3 = -adv * dual_clip
        token_loss = torch.where(negative, torch.minimum(loss_clip, loss3), loss_clip)
        dual_bind = negative & (loss_clip > loss3)
    else:
        token_loss = loss_clip
        dual_bind = torch.zeros_like(negative)
    if token_weights is not None:
        _check_same_shape(logp=logp, token_weights=token_weights)
        token_loss = token_loss * token_weights.detach().to(token_loss.dtype)

    loss = aggregate_loss(token_loss, loss_mask, aggregation, normalizer)

    with torch.no_grad():
        count = mask.sum()
        denom = count + 1e-8

        def frac(flags: torch.Tensor) -> torch.Tensor:
            return (flags.to(mask.dtype) * mask).sum() / denom

        metrics = {
            "clip_frac": frac(loss2 > loss1),
            "low_clip_frac": frac(negative & (ratio < lower)),
            "high_clip_frac": frac((adv > 0) & (ratio > upper)),
            "dual_clip_frac": frac(dual_bind),
            "approx_kl": (-log_ratio.detach() * mask).sum() / denom,
            "num_tokens": count,
        }
    return loss, metrics


def _masked_mean_std(values: torch.Tensor, mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    return entropy_stats_from_moments(entropy_moments(values, mask))


def entropy_moments(token_entropy: torch.Tensor, loss_mask: torch.Tensor) -> torch.Tensor:
    """``[3]`` float64 tensor (count, sum, sum of squares) of the entropy over valid tokens.

    The moments add up: a caller may sum them over micro-batches or all-reduce them over
    data-parallel ranks with its own process group, then call ``entropy_stats_from_moments``.
    """
    if token_entropy.shape != loss_mask.shape:
        raise ValueError(
            f"token_entropy shape {tuple(token_entropy.shape)} != loss_mask shape {tuple(loss_mask.shape)}"
        )
    h = token_entropy.detach().to(torch.float64)
    m = loss_mask.detach().to(torch.float64)
    return torch.stack([m.sum(), (h * m).sum(), (h * h * m).sum()])


def entropy_stats_from_moments(moments: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(mean, unbiased std) from ``entropy_moments``; std is 1 when it is 0 or undefined (< 2 tokens)."""
    count, total, total_sq = moments.unbind(0)
    safe_count = count.clamp(min=1.0)
    mean = total / safe_count
    var = (total_sq - total * total / safe_count).clamp(min=0.0) / (count - 1).clamp(min=1.0)
    std = torch.sqrt(var)
    std = torch.where((count < 2) | (std == 0), torch.ones_like(std), std)
    return mean, std


def entropy_aware_advantages(
    advantages: torch.Tensor,
    token_entropy: torch.Tensor,
    loss_mask: torch.Tensor,
    alpha: float = 0.2,
    stats: tuple[float | torch.Tensor, float | torch.Tensor] | None = None,
) -> torch.Tensor:
    """AEPO entropy-aware advantage: A·(1 + alpha·stopgrad((H - mean)/std)).

    Args:
        advantages: ``[batch]`` or ``[batch, seq]``.
        token_entropy: ``[batch, seq]`` full-vocabulary entropy of the current policy per token.
        loss_mask: ``[batch, seq]``; mean/std are taken over tokens with mask 1.
        alpha: weight of the z-score (0.2 hard-coded in the reference).
        stats: optional ``(mean, std)`` computed by the caller over a larger set (a whole mini-batch,
            all DP ranks; see ``entropy_moments``). A std of 0 is replaced by 1.

    Returns:
        ``[batch, seq]`` advantages; masked positions are scaled too (harmless, the loss masks them).
        No gradient flows into ``token_entropy``.
    """
    shape = _check_same_shape(token_entropy=token_entropy, loss_mask=loss_mask)
    adv = _broadcast_advantages(advantages, shape)
    h = token_entropy.detach()
    if stats is None:
        mean, std = _masked_mean_std(h, loss_mask)
    else:
        mean = torch.as_tensor(stats[0], dtype=torch.float64, device=h.device)
        std = torch.as_tensor(stats[1], dtype=torch.float64, device=h.device)
        if not bool(torch.isfinite(mean)) or not bool(torch.isfinite(std)) or bool(std < 0):
            raise ValueError(f"stats must be a finite (mean, std>=0), got ({float(mean)}, {float(std)})")
        std = torch.where(std == 0, torch.ones_like(std), std)
    z = ((h.to(torch.float64) - mean) / std).to(h.dtype)
    return adv * (1.0 + alpha * z)


def _kl_k1(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return logp - ref_logp


def _kl_abs(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return (logp - ref_logp).abs()


def _kl_k2(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    return 0.5 * (logp - ref_logp).square()


def _kl_k3(logp: torch.Tensor, ref_logp: torch.Tensor) -> torch.Tensor:
    # k3 = e^{ref-logp} - (ref-logp) - 1, unbiased and >= 0; clamps follow verl.
    log_r = (ref_logp - logp).clamp(-_LOG_RATIO_CLAMP, _LOG_RATIO_CLAMP)
    return (torch.exp(log_r) - log_r - 1.0).clamp(-10.0, 10.0)


KL_KINDS: dict[str, Callable[[torch.Tensor, torch.Tensor], torch.Tensor]] = {
    "k1": _kl_k1,
    "kl": _kl_k1,  # verl's name for k1
    "abs": _kl_abs,
    "k2": _kl_k2,
    "mse": _kl_k2,  # verl's name for k2
    "k3": _kl_k3,
    "low_var_kl": _kl_k3,
}


def kl_penalty(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "low_var_kl") -> torch.Tensor:
    """Per-token KL estimate between the current and the reference policy (same shape as inputs).

    ``k1``/``kl``: logp - ref; ``k2``/``mse``: ½(logp - ref)²; ``k3``/``low_var_kl``:
    e^{ref-logp} - (ref-logp) - 1 clamped to [-10, 10]; ``abs``: |logp - ref|.
    """
    fn = KL_KINDS.get(kind)
    if fn is None:
        raise ValueError(f"unknown KL kind {kind!r}; allowed: {', '.join(KL_KINDS)}")
    if logp.shape != ref_logp.shape:
        raise ValueError(f"logp shape {tuple(logp.shape)} != ref_logp shape {tuple(ref_logp.shape)}")
    return fn(logp, ref_logp)


def token_entropy_from_logits(logits: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """Entropy of softmax(logits / temperature) over the last dim: ``[..., vocab]`` -> ``[...]``.

    Computed in float32 (or float64 if given) as logsumexp(l) - Σ softmax(l)·l. ``-inf`` logits
    (masked vocabulary rows) are treated as probability 0 without producing NaN. Differentiable.
    """
    if not math.isfinite(temperature) or temperature <= 0:
        raise ValueError(f"temperature must be a positive finite number, got {temperature}")
    x = logits if logits.dtype == torch.float64 else logits.float()
    if temperature != 1.0:
        x = x / temperature
    # A finite floor keeps p·l = 0·(large negative) = 0 instead of 0·(-inf) = NaN, also in backward.
    x = x.clamp(min=torch.finfo(x.dtype).min)
    lse = torch.logsumexp(x, dim=-1, keepdim=True)
    p = torch.exp(x - lse)
    return lse.squeeze(-1) - (p * x).sum(dim=-1)
