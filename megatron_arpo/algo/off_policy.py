"""Off-policy correction for ``trainer.mode: off_policy``: AReaL's decoupled PPO, behaviour weight truncated.

Per trained token, with ``prox`` the log-prob the actor recomputes at the start of the update (the
proximal policy: the batch's ``old_logprobs``) and ``behav`` the engine's log-prob of the sampled token
under the policy version that sampled it (``Trajectory.response_logprobs``)::

    r = exp(logp - prox)          PPO ratio, clipped against the proximal policy (losses.policy_loss)
    w = min(exp(prox - behav), C)  behaviour importance weight, no gradient, C = algorithm.behaviour_weight_cap
    L = w * L_ppo(r, A)            aggregated as in sync mode (the denominator stays the token count)

Where we differ from AReaL: tokens above the cap are truncated to C (AReaL masks them out), and tokens
sampled by the version being trained (lag 0), or not sampled at all (tool results, the EOS appended at
the call limit: version -1), get w = 1. There the behaviour policy is the proximal one; only the
engine/trainer numeric mismatch separates them, which this correction leaves alone. So with
``rollout.max_staleness: 0`` every weight is 1 and the loss is sync's, bit for bit.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


__all__ = ["NOT_SAMPLED", "behaviour_weights", "sequence_weights", "token_lags", "weight_stats"]

_LOG_WEIGHT_CLAMP = 20.0
NOT_SAMPLED = -1  # the token version of tokens no policy sampled (tool results, an appended EOS)


def token_lags(versions: Sequence[int], current: int) -> list[int]:
    """Per token, how many versions before ``current`` it was sampled (0 for tokens not sampled)."""
    return [0 if v == NOT_SAMPLED else current - v for v in versions]


def behaviour_weights(prox_logp: torch.Tensor, behav_logp: torch.Tensor, lag: torch.Tensor,
                      cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """``(w, raw)``: truncated weights (1 where ``lag <= 0``) and the untruncated ones, same shape as inputs."""
    if not cap > 1.0:
        raise ValueError(f"the behaviour weight cap must be > 1 (algorithm.behaviour_weight_cap), got {cap}")
    if prox_logp.shape != behav_logp.shape or prox_logp.shape != lag.shape:
        raise ValueError(f"prox_logp {tuple(prox_logp.shape)}, behav_logp {tuple(behav_logp.shape)} and lag "
                         f"{tuple(lag.shape)} must have one shape")
    log_w = (prox_logp.detach().double() - behav_logp.detach().double()).clamp(-_LOG_WEIGHT_CLAMP, _LOG_WEIGHT_CLAMP)
    lagged = lag > 0
    raw = torch.where(lagged, torch.exp(log_w), torch.ones_like(log_w))
    return raw.clamp(max=cap).to(prox_logp.dtype), raw


def weight_stats(weights: torch.Tensor, raw: torch.Tensor, lag: torch.Tensor, mask: torch.Tensor,
                 cap: float) -> dict[str, float]:
    """Mean and max weight over the trained tokens with lag > 0, and the share of them truncated at the cap."""
    lagged = (lag > 0) & (mask > 0)
    count = int(lagged.sum())
    if count == 0:
        return {"is_weight_mean": 1.0, "is_weight_max": 1.0, "is_weight_clipped_frac": 0.0, "lagged_tokens": 0.0}
    return {"is_weight_mean": float(weights.double()[lagged].mean()), "is_weight_max": float(weights[lagged].max()),
            "is_weight_clipped_frac": float((raw[lagged] > cap).double().mean()), "lagged_tokens": float(count)}


def sequence_weights(prox: Sequence[Sequence[float]], behav: Sequence[Sequence[float]],
                     lags: Sequence[Sequence[int]], masks: Sequence[Sequence[float]],
                     cap: float) -> tuple[list[list[float]], dict[str, float]]:
    """``behaviour_weights`` over a batch of token-aligned rows of any lengths (the driver's batch format):
    per row the weights, and the batch's ``weight_stats``."""
    rows, raws, all_lags, all_masks = [], [], [], []
    for i, (p, b, g, m) in enumerate(zip(prox, behav, lags, masks, strict=True)):
        if not len(p) == len(b) == len(g) == len(m):
            raise ValueError(f"sequence {i}: {len(p)} proximal log-probs, {len(b)} behaviour log-probs, "
                             f"{len(g)} lags, {len(m)} mask entries")
        lag = torch.as_tensor(list(g), dtype=torch.long)
        w, raw = behaviour_weights(torch.as_tensor(list(p), dtype=torch.float32),
                                   torch.as_tensor(list(b), dtype=torch.float32), lag, cap)
        rows.append(w.tolist())
        raws.append(raw)
        all_lags.append(lag)
        all_masks.append(torch.as_tensor(list(m), dtype=torch.float32))
    if not rows:
        return [], weight_stats(*(torch.zeros(0),) * 4, cap=cap)
    flat_w = torch.cat([torch.as_tensor(r) for r in rows])
    stats = weight_stats(flat_w, torch.cat(raws), torch.cat(all_lags), torch.cat(all_masks), cap)
    return rows, stats
