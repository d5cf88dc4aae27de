"""GRPO advantages against the reference cases of docs/design/arpo_reference.md §11.2."""

from __future__ import annotations

import pytest
import torch

from megatron_arpo.algo.advantages import grpo_advantages

A1 = [1.0, 0.0, 0.0, 1.0]
A5 = [1.0] + [0.0] * 7


@pytest.mark.parametrize(
    ("rewards", "with_std", "without_std"),
    [
        (A1, [0.8660, -0.8660, -0.8660, 0.8660], [0.5, -0.5, -0.5, 0.5]),  # A1
        ([1.0, 1.0, 1.0, 1.0], [0.0] * 4, [0.0] * 4),  # A2
        ([0.5], [0.5], [0.5]),  # A3: a group of one keeps its reward
        (A5, [2.4749] + [-0.3536] * 7, [0.875] + [-0.125] * 7),  # A5
    ],
    ids=["A1", "A2", "A3", "A5"],
)
def test_reference_cases(rewards, with_std, without_std):
    gids = [0] * len(rewards)
    got = grpo_advantages(torch.tensor(rewards), gids)
    assert torch.allclose(got, torch.tensor(with_std), atol=1e-4)
    got = grpo_advantages(torch.tensor(rewards), gids, norm_by_std=False)
    assert torch.allclose(got, torch.tensor(without_std), atol=1e-6)


def test_group_of_one_divides_by_one_plus_eps_like_reference():
    got = grpo_advantages(torch.tensor([0.5], dtype=torch.float64), [7])
    assert got.item() == pytest.approx(0.5 / (1 + 1e-6), abs=1e-15)


def test_groups_interleaved_with_string_and_tensor_ids():
    # A1 and A5 interleaved; each group must be normalised on its own.
    rewards, gids = [], []
    for i in range(8):
        rewards.append(A5[i])
        gids.append("uid-b")
        if i < 4:
            rewards.append(A1[i])
            gids.append("uid-a")
    r = torch.tensor(rewards)
    got = grpo_advantages(r, gids)
    sel_a = [i for i, g in enumerate(gids) if g == "uid-a"]
    sel_b = [i for i, g in enumerate(gids) if g == "uid-b"]
    assert torch.allclose(got[sel_a], grpo_advantages(torch.tensor(A1), [0] * 4))
    assert torch.allclose(got[sel_b], grpo_advantages(torch.tensor(A5), [0] * 8))
    int_ids = torch.tensor([0 if g == "uid-a" else 5 for g in gids])
    assert torch.equal(grpo_advantages(r, int_ids), got)


def test_matches_naive_loop_on_random_groups():
    gen = torch.Generator().manual_seed(0)
    rewards = torch.rand(50, generator=gen, dtype=torch.float64)
    gids = torch.randint(0, 9, (50,), generator=gen)
    got = grpo_advantages(rewards, gids)
    for g in gids.unique():
        sel = gids == g
        vals = rewards[sel]
        if vals.numel() == 1:
            expect = vals / (1 + 1e-6)
        else:
            expect = (vals - vals.mean()) / (vals.std() + 1e-6)
        assert torch.allclose(got[sel], expect, atol=1e-12)


def test_dtype_and_list_input():
    assert grpo_advantages([1, 0, 0, 1], [0, 0, 0, 0]).dtype == torch.float32
    assert grpo_advantages(torch.tensor(A1, dtype=torch.float64), [0] * 4).dtype == torch.float64
    assert grpo_advantages(torch.tensor([]), []).numel() == 0


def test_errors():
    with pytest.raises(ValueError, match="one group id per trajectory"):
        grpo_advantages(torch.tensor(A1), [0, 0, 0])
    with pytest.raises(ValueError, match="1-D"):
        grpo_advantages(torch.zeros(2, 2), [0, 0])
    with pytest.raises(ValueError, match="integer tensor"):
        grpo_advantages(torch.tensor(A1), torch.zeros(4))
    with pytest.raises(ValueError, match="non-finite"):
        grpo_advantages(torch.tensor([1.0, float("nan")]), [0, 0])
    with pytest.raises(ValueError, match="hashable"):
        grpo_advantages(torch.tensor([1.0, 0.0]), [[0], [1]])
