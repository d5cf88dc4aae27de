"""Decoupled PPO's behaviour weights (megatron_arpo/algo/off_policy.py) and their place in policy_loss."""

from __future__ import annotations

import math

import pytest
import torch

from megatron_arpo.algo.losses import policy_loss
from megatron_arpo.algo.off_policy import behaviour_weights, sequence_weights, weight_stats


def _batch(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    logp = (-torch.rand(3, 7, generator=g) * 3).requires_grad_(True)
    old = logp.detach() + torch.randn(3, 7, generator=g) * 0.3
    adv = torch.randn(3, generator=g)
    mask = (torch.rand(3, 7, generator=g) > 0.2).float()
    return logp, old, adv, mask


@pytest.mark.parametrize("ebc", [False, True])
def test_sync_mode_loss_and_gradient_are_unchanged_bit_for_bit(ebc):
    """No weights (sync mode) and all-one weights (off-policy at max_staleness 0) give today's loss exactly."""
    logp, old, adv, mask = _batch()
    base, base_metrics = policy_loss(logp, old, adv, mask, entropy_balanced_clip=ebc)
    (base_grad,) = torch.autograd.grad(base, logp)
    w, _ = behaviour_weights(old, old - 0.5, torch.zeros(3, 7, dtype=torch.long), cap=2.0)  # lag 0: all 1
    assert torch.equal(w, torch.ones_like(w))
    loss, metrics = policy_loss(logp, old, adv, mask, entropy_balanced_clip=ebc, token_weights=w)
    (grad,) = torch.autograd.grad(loss, logp)
    assert torch.equal(loss, base) and torch.equal(grad, base_grad)
    assert all(torch.equal(metrics[k], base_metrics[k]) for k in base_metrics)


def test_weights_scale_each_tokens_loss_and_are_truncated_at_the_cap():
    logp, old, adv, mask = _batch(1)
    behav = old.clone()
    behav[0, 1] = old[0, 1] - math.log(1.5)   # w = 1.5
    behav[1, 2] = old[1, 2] - math.log(10.0)  # w = 10 -> cap 2
    behav[2, 3] = old[2, 3] + math.log(4.0)   # w = 0.25
    lag = torch.ones(3, 7, dtype=torch.long)
    lag[2, 4] = 0  # sampled by the trained version: 1 whatever the log-probs say
    behav[2, 4] = old[2, 4] - 3.0
    w, raw = behaviour_weights(old, behav, lag, cap=2.0)
    assert w[0, 1].item() == pytest.approx(1.5) and w[1, 2].item() == pytest.approx(2.0)
    assert raw[1, 2].item() == pytest.approx(10.0) and w[2, 3].item() == pytest.approx(0.25)
    assert w[2, 4].item() == 1.0 and w[0, 0].item() == pytest.approx(1.0)
    mask = torch.ones(3, 7)
    per_token, _ = policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-sum", normalizer=1.0)
    weighted, _ = policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-sum", normalizer=1.0,
                              token_weights=w)
    # token-level check: the weighted sum differs from the plain one by exactly the re-weighted tokens
    lp = logp.detach()
    tok = []
    for b, s in ((0, 1), (1, 2), (2, 3)):
        one = torch.zeros(3, 7)
        one[b, s] = 1.0
        tok.append(policy_loss(lp, old, adv, one, aggregation="seq-mean-token-sum", normalizer=1.0)[0].item())
    expected = per_token.item() + 0.5 * tok[0] + 1.0 * tok[1] - 0.75 * tok[2]
    assert weighted.item() == pytest.approx(expected, rel=1e-5, abs=1e-6)
    stats = weight_stats(w, raw, lag, mask, cap=2.0)
    assert stats["is_weight_max"] == pytest.approx(2.0) and stats["lagged_tokens"] == 20.0
    assert stats["is_weight_clipped_frac"] == pytest.approx(1 / 20)


def test_no_gradient_flows_through_the_weights():
    logp, old, adv, mask = _batch(2)
    w = torch.full((3, 7), 1.7, requires_grad=True)
    loss, _ = policy_loss(logp, old, adv, mask, token_weights=w)
    loss.backward()
    assert w.grad is None and logp.grad is not None


def test_sequence_weights_over_ragged_rows_and_bad_input():
    rows, stats = sequence_weights([[0.0, -1.0, -2.0], [-0.5]], [[0.0, -2.0, -2.0], [-0.5]],
                                   [[-1, 1, 0], [2]], [[0, 1, 1], [1]], cap=2.0)
    assert rows[0][1] == 2.0 and rows[0][2] == 1.0 and rows[1] == [1.0]
    assert stats["lagged_tokens"] == 2.0 and stats["is_weight_clipped_frac"] == 0.5
    with pytest.raises(ValueError, match="sequence 0: 2 proximal log-probs, 1 behaviour"):
        sequence_weights([[0.0, 0.0]], [[0.0]], [[1, 1]], [[1, 1]], cap=2.0)
    with pytest.raises(ValueError, match="behaviour_weight_cap"):
        behaviour_weights(torch.zeros(1), torch.zeros(1), torch.zeros(1), cap=1.0)
    assert sequence_weights([], [], [], [], cap=2.0)[1]["is_weight_mean"] == 1.0
