"""Policy loss (PPO/dual clip, AEPO clip), aggregation, KL kinds, entropy-aware advantages, token entropy.

Reference values: docs/design/arpo_reference.md §11.6 (single sequence, r = [0.5, 0.9, 1.0, 1.1, 1.3, 2.0, 4.0],
eps = 0.2, c = 3, token-mean over 7 tokens, gradients are d loss / d logpi_t).
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_arpo.algo.losses import (
    aggregate_loss,
    entropy_aware_advantages,
    entropy_moments,
    entropy_stats_from_moments,
    kl_penalty,
    policy_loss,
    token_entropy_from_logits,
)

RATIOS = [0.5, 0.9, 1.0, 1.1, 1.3, 2.0, 4.0]
F64 = torch.float64


def _run(adv: float, ebc: bool, **kwargs):
    logp = torch.log(torch.tensor([RATIOS], dtype=F64)).requires_grad_(True)
    old = torch.zeros(1, 7, dtype=F64)
    loss, metrics = policy_loss(
        logp, old, torch.tensor([adv], dtype=F64), torch.ones(1, 7), entropy_balanced_clip=ebc, **kwargs
    )
    loss.backward()
    return loss.item(), logp.grad[0].tolist(), {k: float(v) for k, v in metrics.items()}


@pytest.mark.parametrize("ebc", [False, True], ids=["ppo", "aepo"])
def test_L3_negative_advantage_identical_for_ppo_and_aepo(ebc):
    loss, grads, m = _run(-1.0, ebc)
    assert loss == pytest.approx(1.4429, abs=1e-4)
    assert grads == pytest.approx([0, 0.1286, 0.1429, 0.1571, 0.1857, 0.2857, 0], abs=1e-4)
    assert m["clip_frac"] == pytest.approx(0.1429, abs=1e-4)
    assert m["low_clip_frac"] == pytest.approx(0.1429, abs=1e-4)  # r = 0.5 < 0.8
    assert m["dual_clip_frac"] == pytest.approx(0.1429, abs=1e-4)  # r = 4.0 > c = 3
    assert m["high_clip_frac"] == 0.0


def test_L1_positive_advantage_ppo():
    loss, grads, m = _run(1.0, False)
    assert loss == pytest.approx(-1.0143, abs=1e-4)
    assert grads == pytest.approx([-0.0714, -0.1286, -0.1429, -0.1571, 0, 0, 0], abs=1e-4)
    assert m["clip_frac"] == pytest.approx(0.4286, abs=1e-4)
    assert m["high_clip_frac"] == pytest.approx(0.4286, abs=1e-4)
    assert m["low_clip_frac"] == 0.0  # the lower bound never binds for A > 0
    assert m["dual_clip_frac"] == 0.0


def test_L1_positive_advantage_aepo_keeps_clipped_gradient():
    # Same value and metrics as PPO; tokens with r > 1.2 get -A*(1+eps_high)/7 = -1.2/7 instead of 0.
    loss, grads, m = _run(1.0, True)
    assert loss == pytest.approx(-1.0143, abs=1e-4)
    aepo_clip = -1.2 / 7
    expected = [-0.5 / 7, -0.9 / 7, -1.0 / 7, -1.1 / 7] + [aepo_clip] * 3
    assert grads == pytest.approx(expected, abs=1e-8)  # 1e-8: the token-mean denominator's epsilon
    # §4.3's table: -A*(1+eps_high) per token, token-mean over 7 -> -0.1714 where PPO's (§11.6 L1) is 0.
    assert grads[4:] == pytest.approx([-0.1714] * 3, abs=1e-4)
    assert m["clip_frac"] == pytest.approx(3 / 7)


def test_aepo_gradient_scales_with_advantage_and_eps_high():
    _, grads, _ = _run(2.5, True, clip_high=0.28)
    # r = 1.3, 2.0, 4.0 exceed 1.28 -> -A*(1.28)/7 each; r = 1.1 unclipped -> -A*1.1/7
    assert grads[3] == pytest.approx(-2.5 * 1.1 / 7)
    assert grads[4:] == pytest.approx([-2.5 * 1.28 / 7] * 3)


def test_dual_clip_none_disables_dual_clip():
    loss, grads, m = _run(-1.0, False, dual_clip=None)
    assert loss == pytest.approx((0.8 + 0.9 + 1.0 + 1.1 + 1.3 + 2.0 + 4.0) / 7)
    assert grads[-1] == pytest.approx(4.0 / 7)
    assert m["dual_clip_frac"] == 0.0


def _agg_inputs():
    # ratio 1 everywhere, so the per-token loss is exactly -A.
    adv = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
    logp = torch.zeros(2, 3, dtype=F64, requires_grad=True)
    return logp, torch.zeros(2, 3, dtype=F64), adv, mask


@pytest.mark.parametrize(
    ("aggregation", "expected"),
    [
        ("token-mean", -(1 + 2 + 4) / 3),
        ("seq-mean-token-sum", (-(1 + 2) - 4) / 2),
        ("seq-mean-token-mean", (-(1 + 2) / 2 - 4) / 2),
    ],
)
def test_aggregations_hand_computed(aggregation, expected):
    logp, old, adv, mask = _agg_inputs()
    loss, _ = policy_loss(logp, old, adv, mask, aggregation=aggregation)
    assert loss.item() == pytest.approx(expected, abs=1e-7)


def test_masked_tokens_excluded_from_loss_gradient_and_metrics():
    logp, old, adv, mask = _agg_inputs()
    loss, m = policy_loss(logp, old, adv, mask)
    loss.backward()
    assert logp.grad[mask == 0].abs().max().item() == 0.0
    # Wild values at masked positions change nothing.
    logp2 = logp.detach().clone()
    logp2[mask == 0] = 5.0
    loss2, m2 = policy_loss(logp2, old, adv, mask)
    assert loss2.item() == pytest.approx(loss.item(), abs=1e-12)
    assert float(m2["clip_frac"]) == float(m["clip_frac"]) == 0.0
    assert float(m2["approx_kl"]) == 0.0
    assert float(m2["num_tokens"]) == 3.0


def test_empty_row_seq_mean_token_mean_is_finite():
    logp, old, adv, mask = _agg_inputs()
    mask = mask.clone()
    mask[1] = 0
    loss, _ = policy_loss(logp, old, adv, mask, aggregation="seq-mean-token-mean")
    assert loss.item() == pytest.approx(-1.5 / 2)


@pytest.mark.parametrize(
    ("aggregation", "normalizer"),
    [("token-mean", 3.0), ("seq-mean-token-sum", 2.0), ("seq-mean-token-mean", 2.0)],
)
def test_normalizer_makes_micro_batch_accumulation_exact(aggregation, normalizer):
    logp, old, adv, mask = _agg_inputs()
    full, _ = policy_loss(logp, old, adv, mask, aggregation=aggregation)
    parts = [
        policy_loss(logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1],
                    aggregation=aggregation, normalizer=normalizer)[0]
        for i in range(2)
    ]
    assert (parts[0] + parts[1]).item() == pytest.approx(full.item(), abs=1e-7)
    if aggregation == "token-mean":
        # Without the normalizer, averaging per-micro-batch token means is not the mini-batch mean.
        naive = [
            policy_loss(logp[i : i + 1], old[i : i + 1], adv[i : i + 1], mask[i : i + 1])[0]
            for i in range(2)
        ]
        assert ((naive[0] + naive[1]) / 2).item() != pytest.approx(full.item(), abs=1e-3)


def test_sequence_advantages_broadcast_equals_token_advantages():
    gen = torch.Generator().manual_seed(1)
    logp = (torch.randn(3, 5, generator=gen, dtype=F64) * 0.3)
    old = torch.randn(3, 5, generator=gen, dtype=F64) * 0.3
    mask = (torch.rand(3, 5, generator=gen) > 0.3).long()
    adv = torch.tensor([1.0, -0.5, 2.0], dtype=F64)
    for ebc in (False, True):
        a, ma = policy_loss(logp, old, adv, mask, entropy_balanced_clip=ebc)
        b, mb = policy_loss(logp, old, adv[:, None].expand(3, 5), mask, entropy_balanced_clip=ebc)
        assert a.item() == b.item()
        assert {k: float(v) for k, v in ma.items()} == {k: float(v) for k, v in mb.items()}


def test_approx_kl_is_masked_mean_of_old_minus_new():
    logp = torch.tensor([[-1.0, -2.0, -3.0]])
    old = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1, 1, 0]])
    _, m = policy_loss(logp, old, torch.tensor([1.0]), mask)
    assert float(m["approx_kl"]) == pytest.approx(((-1.5 + 1.0) + (-1.0 + 2.0)) / 2, abs=1e-6)


def test_extreme_log_ratio_stays_finite():
    logp = torch.tensor([[500.0, -500.0, 0.0]], requires_grad=True)
    old = torch.zeros(1, 3)
    for adv in (1.0, -1.0):
        for ebc in (False, True):
            logp.grad = None
            loss, m = policy_loss(logp, old, torch.tensor([adv]), torch.ones(1, 3), entropy_balanced_clip=ebc)
            loss.backward()
            assert torch.isfinite(loss) and torch.isfinite(logp.grad).all()


def test_policy_loss_errors():
    logp, old, adv, mask = _agg_inputs()
    with pytest.raises(ValueError, match="allowed: token-mean, seq-mean-token-sum, seq-mean-token-mean"):
        policy_loss(logp, old, adv, mask, aggregation="sum")
    with pytest.raises(ValueError, match=r"old_logp=\(2, 4\)"):
        policy_loss(logp, torch.zeros(2, 4), adv, mask)
    with pytest.raises(ValueError, match=r"expected \[batch\]=2"):
        policy_loss(logp, old, torch.zeros(3), mask)
    with pytest.raises(ValueError, match="dual_clip must be > 1.0"):
        policy_loss(logp, old, adv, mask, dual_clip=0.5)
    with pytest.raises(ValueError, match="clip_low"):
        policy_loss(logp, old, adv, mask, clip_low=1.5)
    with pytest.raises(ValueError, match="normalizer must be > 0"):
        aggregate_loss(logp, mask, "token-mean", normalizer=0)


def test_kl_kinds_hand_computed():
    logp = torch.tensor([0.0, -1.0, -30.0, 0.0], dtype=F64)
    ref = torch.tensor([-0.5, -0.5, 0.0, -30.0], dtype=F64)
    assert kl_penalty(logp, ref, "k1").tolist() == pytest.approx([0.5, -0.5, -30.0, 30.0])
    assert kl_penalty(logp, ref, "k2").tolist() == pytest.approx([0.125, 0.125, 450.0, 450.0])
    k3 = kl_penalty(logp, ref, "k3").tolist()
    assert k3[0] == pytest.approx(math.exp(-0.5) + 0.5 - 1)  # 0.1065
    assert k3[1] == pytest.approx(math.exp(0.5) - 0.5 - 1)  # 0.1487
    assert k3[2:] == [10.0, 10.0]  # clamped to [-10, 10]
    assert kl_penalty(logp, ref, "low_var_kl").tolist() == k3
    assert kl_penalty(logp, ref, "abs").tolist() == pytest.approx([0.5, 0.5, 30.0, 30.0])


def test_kl_errors():
    x = torch.zeros(3)
    with pytest.raises(ValueError, match="allowed: k1, .*k2, .*low_var_kl"):
        kl_penalty(x, x, "k4")
    with pytest.raises(ValueError, match="shape"):
        kl_penalty(x, torch.zeros(4), "k1")


def test_entropy_aware_advantages_z_scores_and_mask():
    h = torch.tensor([[1.0, 2.0, 3.0, 100.0]], dtype=F64)
    mask = torch.tensor([[1, 1, 1, 0]])
    # valid tokens: mean 2, unbiased std 1 -> z = [-1, 0, 1, 98]; the masked token does not enter the stats.
    out = entropy_aware_advantages(torch.tensor([2.0], dtype=F64), h, mask, alpha=0.2)
    assert out[0].tolist() == pytest.approx([1.6, 2.0, 2.4, 2.0 * (1 + 0.2 * 98)])


def test_entropy_aware_advantages_constant_entropy_and_single_token():
    adv = torch.tensor([[1.0, -1.0, 3.0]])
    out = entropy_aware_advantages(adv, torch.full((1, 3), 0.7), torch.ones(1, 3))
    assert torch.equal(out, adv)  # std 0 -> 1, z = 0
    out = entropy_aware_advantages(adv, torch.tensor([[0.5, 9.0, 9.0]]), torch.tensor([[1, 0, 0]]))
    assert torch.isfinite(out).all()
    assert out[0, 0].item() == 1.0


def test_entropy_aware_advantages_external_stats_and_moments():
    gen = torch.Generator().manual_seed(2)
    h = torch.rand(4, 6, generator=gen, dtype=F64) * 3
    mask = (torch.rand(4, 6, generator=gen) > 0.25).long()
    adv = torch.tensor([1.0, -1.0, 0.5, 2.0], dtype=F64)
    # Moments of two micro-batches add up to the statistics of the whole mini-batch.
    moments = entropy_moments(h[:2], mask[:2]) + entropy_moments(h[2:], mask[2:])
    mean, std = entropy_stats_from_moments(moments)
    valid = h[mask.bool()]
    assert mean.item() == pytest.approx(valid.mean().item(), abs=1e-12)
    assert std.item() == pytest.approx(valid.std().item(), abs=1e-12)
    whole = entropy_aware_advantages(adv, h, mask)
    split = torch.cat([entropy_aware_advantages(adv[:2], h[:2], mask[:2], stats=(mean, std)),
                       entropy_aware_advantages(adv[2:], h[2:], mask[2:], stats=(mean, std))])
    assert torch.allclose(whole, split, atol=1e-12)
    per_micro = entropy_aware_advantages(adv[:2], h[:2], mask[:2])
    assert not torch.allclose(per_micro, whole[:2])
    out = entropy_aware_advantages(adv, h, mask, stats=(0.0, 2.0), alpha=0.5)
    assert torch.allclose(out, adv[:, None] * (1 + 0.5 * h / 2))
    with pytest.raises(ValueError, match="stats"):
        entropy_aware_advantages(adv, h, mask, stats=(float("nan"), 1.0))


def test_entropy_aware_advantages_stop_gradient():
    h = torch.tensor([[0.2, 1.5, 3.0]], requires_grad=True)
    logp = torch.tensor([[-0.1, -0.2, -0.3]], requires_grad=True)
    mask = torch.ones(1, 3)
    adv = entropy_aware_advantages(torch.tensor([1.0]), h, mask)
    assert not adv.requires_grad
    loss, _ = policy_loss(logp, logp.detach(), adv, mask)
    loss.backward()
    assert h.grad is None
    assert torch.allclose(logp.grad, -adv / 3)


def test_token_entropy_from_logits():
    v = 1000
    assert token_entropy_from_logits(torch.zeros(2, v)).tolist() == pytest.approx([math.log(v)] * 2, abs=1e-5)
    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(3, 4, 50, generator=gen) * 4
    expect = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(token_entropy_from_logits(logits), expect, atol=1e-5)
    hot = torch.tensor([[0.0, 0.0, -1e4]])
    assert token_entropy_from_logits(hot).item() == pytest.approx(math.log(2), abs=1e-6)
    assert token_entropy_from_logits(torch.tensor([[2.0, 0.0]]), temperature=2.0).item() == pytest.approx(
        torch.distributions.Categorical(logits=torch.tensor([1.0, 0.0])).entropy().item(), abs=1e-6)


def test_token_entropy_masked_vocab_no_nan():
    logits = torch.tensor([[1.0, 2.0, float("-inf"), 0.5]], requires_grad=True)
    h = token_entropy_from_logits(logits)
    expect = torch.distributions.Categorical(logits=torch.tensor([1.0, 2.0, 0.5])).entropy()
    assert h.item() == pytest.approx(expect.item(), abs=1e-6)
    h.sum().backward()
    assert torch.isfinite(logits.grad).all()
    assert logits.grad[0, 2].item() == 0.0
    with pytest.raises(ValueError, match="temperature"):
        token_entropy_from_logits(logits, temperature=0.0)
