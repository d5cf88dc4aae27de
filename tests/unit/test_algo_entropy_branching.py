"""Segment entropy (docs/design/arpo_reference.md §11.3), branch rules (§11.4), AEPO initial rollouts (§11.5), BranchRng."""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass

import pytest

from megatron_arpo.algo.branching import BranchRng, aepo_initial_rollouts, branch_score, should_branch
from megatron_arpo.algo.entropy import segment_entropy

ln = math.log
E1 = [[ln(0.5), ln(0.3), ln(0.2)], [ln(0.9), ln(0.05), ln(0.05)]]


def test_E1_two_positions():
    raw = segment_entropy(E1, vocab_size=151_665) * ln(151_665)
    assert raw == pytest.approx(1.4241, abs=1e-4)
    assert segment_entropy(E1, vocab_size=151_665) == pytest.approx(0.11937, abs=1e-5)
    assert segment_entropy(E1, vocab_size=128_256) == pytest.approx(0.12107, abs=1e-5)


def test_E2_twenty_uniform_positions():
    positions = [[ln(0.1)] * 10 for _ in range(20)]
    assert segment_entropy(positions, vocab_size=151_665) == pytest.approx(3.8603, abs=1e-4)


def test_E3_only_window_positions_count():
    positions = [[ln(0.9), ln(0.1)] for _ in range(25)]
    got = segment_entropy(positions, vocab_size=98)
    assert got == pytest.approx(1.4180, abs=1e-4)
    assert got == pytest.approx(20 * 0.325083 / ln(98), abs=1e-5)
    assert segment_entropy(positions, vocab_size=98, window=5) == pytest.approx(got / 4)


def test_reference_empty_and_neg_inf_entries():
    assert segment_entropy([], vocab_size=1000) == 0.0
    assert segment_entropy([[], None], vocab_size=1000) == 0.0
    with_inf = [row + [float("-inf")] for row in E1]
    assert segment_entropy(with_inf, vocab_size=151_665) == segment_entropy(E1, vocab_size=151_665)
    assert segment_entropy(with_inf, vocab_size=151_665, estimator="mean") == pytest.approx(
        segment_entropy(E1, vocab_size=151_665, estimator="mean"))


@dataclass
class _Logprob:  # shaped like vllm.sequence.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


def test_mapping_inputs_like_vllm():
    as_floats = [{i: lp for i, lp in enumerate(row)} for row in E1]
    as_objects = [{i: _Logprob(lp) for i, lp in enumerate(row)} for row in E1]
    expect = segment_entropy(E1, vocab_size=151_665)
    assert segment_entropy(as_floats, vocab_size=151_665) == expect
    assert segment_entropy(as_objects, vocab_size=151_665) == expect
    assert segment_entropy(iter(E1), vocab_size=151_665) == expect


def test_mean_estimator():
    # Per position: renormalised top-k entropy / ln(k), then mean over positions.
    h1 = -(0.5 * ln(0.5) + 0.3 * ln(0.3) + 0.2 * ln(0.2)) / ln(3)
    h2 = -(0.9 * ln(0.9) + 2 * 0.05 * ln(0.05)) / ln(3)
    assert segment_entropy(E1, 151_665, estimator="mean") == pytest.approx((h1 + h2) / 2)
    uniform = [[ln(0.1)] * 10 for _ in range(20)]
    assert segment_entropy(uniform, 151_665, estimator="mean") == pytest.approx(1.0)
    # Renormalisation: two entries of 0.4 become 0.5/0.5.
    assert segment_entropy([[ln(0.4), ln(0.4)]], 1000, estimator="mean") == pytest.approx(1.0)
    # A single-entry position is certain; length does not change the mean.
    assert segment_entropy([[0.0]], 1000, estimator="mean") == 0.0
    short = [[ln(0.9), ln(0.1)]] * 3
    long = [[ln(0.9), ln(0.1)]] * 30
    assert segment_entropy(short, 98, estimator="mean") == pytest.approx(
        segment_entropy(long, 98, estimator="mean"))
    assert segment_entropy([], 98, estimator="mean") == 0.0


def test_entropy_errors():
    with pytest.raises(ValueError, match="allowed: reference, mean"):
        segment_entropy(E1, 1000, estimator="sum")
    with pytest.raises(ValueError, match="position 1"):
        segment_entropy([[ln(0.5)], [float("nan")]], 1000)
    with pytest.raises(ValueError, match="vocab_size"):
        segment_entropy(E1, 1)
    with pytest.raises(ValueError, match="window"):
        segment_entropy(E1, 1000, window=0)


# (case, variant, U, H_now, H0, c, expected score, branch?)
# B1-B6, B8, B10 are the reference table of §11.4 (tau = 0.5, beta = 0.2). The reference table has no B7/B9;
# B7/B9 here are penalty cases derived by hand from §4.2 (factor 1 - 0.05*c).
BRANCH_CASES = [
    ("B1", "arpo", 0.52, 0.30, 0.10, 0, 0.48, True),
    ("B2", "arpo", 0.56, 0.30, 0.10, 0, 0.52, False),
    ("B3", "arpo", 0.50, 0.10, 0.10, 0, 0.50, True),
    ("B4", "arpo", 0.90, 5.00, 1.00, 0, 0.10, True),
    ("B5", "arpo", 0.10, 0.00, 3.00, 0, 0.70, False),
    ("B6", "aepo", 0.49, 0.30, 0.10, 0, 0.53, True),
    ("B7", "aepo", 0.60, 0.10, 0.10, 2, 0.54, True),  # (0.60)*0.9
    ("B8", "aepo", 0.45, 0.30, 0.10, 0, 0.49, False),
    ("B9", "aepo", 0.51, 0.30, 0.10, 2, 0.495, False),  # (0.51+0.04)*0.9: penalty flips B6-like case
    ("B10", "aepo", 0.50, 0.10, 0.10, 0, 0.50, True),
]


@pytest.mark.parametrize(("case", "variant", "u", "h_now", "h0", "c", "score", "branch"), BRANCH_CASES,
                         ids=[c[0] for c in BRANCH_CASES])
def test_branch_cases(case, variant, u, h_now, h0, c, score, branch):
    kwargs = dict(entropy_weight=0.2, variant=variant, consecutive_branches=c)
    assert branch_score(u, h_now, h0, **kwargs) == pytest.approx(score, abs=1e-9)
    assert should_branch(u, h_now, h0, threshold=0.5, **kwargs) is branch


def test_aepo_score_clipping_and_large_penalty():
    assert branch_score(0.9, 10.0, 0.0, variant="aepo") == 1.0
    assert branch_score(0.1, 0.0, 10.0, variant="aepo") == 0.0
    # c >= 20 makes the factor 0: never branches at tau > 0.
    assert not should_branch(1.0, 5.0, 0.0, variant="aepo", consecutive_branches=20)
    # ARPO ignores the penalty arguments.
    assert should_branch(0.52, 0.3, 0.1, variant="arpo", consecutive_branches=50)


@pytest.mark.parametrize("variant", ["arpo", "aepo"])
def test_branch_probability_closed_form(variant):
    # P(branch) = clip(tau + beta*dH, 0, 1) for both rules when c = 0.
    rng = BranchRng(123)
    draws = [rng.draw() for _ in range(20_000)]
    for dh, expected in [(0.0, 0.5), (1.0, 0.7), (-1.5, 0.2), (5.0, 1.0)]:
        hits = sum(should_branch(u, dh, 0.0, variant=variant) for u in draws)
        assert hits / len(draws) == pytest.approx(expected, abs=0.015)


def test_branch_errors():
    with pytest.raises(ValueError, match="allowed: arpo, aepo"):
        should_branch(0.5, 0.0, 0.0, variant="grpo")
    with pytest.raises(ValueError, match="u must"):
        should_branch(1.5, 0.0, 0.0)
    with pytest.raises(ValueError, match="h_now must be finite"):
        should_branch(0.5, float("nan"), 0.0)
    with pytest.raises(ValueError, match="threshold"):
        should_branch(0.5, 0.0, 0.0, threshold=2.0)
    with pytest.raises(ValueError, match="consecutive_branches"):
        should_branch(0.5, 0.0, 0.0, variant="aepo", consecutive_branches=-1)


@pytest.mark.parametrize(("delta_h", "expected"),
                         [(-6, 1), (-2, 5), (-1, 7), (0, 9), (0.5, 9), (1, 10), (2, 12), (6, 16)])
def test_aepo_initial_rollouts_table(delta_h, expected):
    assert aepo_initial_rollouts(16, delta_h) == expected


def test_aepo_initial_rollouts_bounds():
    assert aepo_initial_rollouts(12, 0.0) == 7  # n/2 + 1, the reference's "+1 after floor"
    assert aepo_initial_rollouts(1, 100.0) == 1
    assert aepo_initial_rollouts(16, -1e6) == 1
    assert aepo_initial_rollouts(16, 1e6) == 16
    with pytest.raises(ValueError, match="n"):
        aepo_initial_rollouts(0, 0.0)


def test_branch_rng_deterministic_and_recorded():
    a, b = BranchRng(7), BranchRng(7)
    xs = [a.draw() for _ in range(5)]
    assert xs == [b.draw() for _ in range(5)]
    assert a.history == xs and a.num_draws == 5
    assert all(0.0 <= x < 1.0 for x in xs)
    assert xs != [BranchRng(8).draw() for _ in range(5)]
    assert a.clear_history() == xs and a.history == []
    assert a.draw() == b.draw()  # the stream continues after clearing the record


def test_branch_rng_state_round_trip_through_json():
    rng = BranchRng(2024)
    for _ in range(3):
        rng.draw()
    state = json.loads(json.dumps(rng.state_dict()))
    expected = [rng.draw() for _ in range(4)]
    restored = BranchRng(0)
    restored.load_state_dict(state)
    assert restored.seed == 2024 and restored.num_draws == 3
    assert [restored.draw() for _ in range(4)] == expected
    with pytest.raises(ValueError, match="state_dict"):
        restored.load_state_dict({"seed": 1})


def test_branch_rng_spawn_and_global_rng_untouched():
    root = BranchRng(5)
    assert root.spawn("prompt-3").draw() == BranchRng(5).spawn("prompt-3").draw()
    assert root.spawn("prompt-3").draw() != root.spawn("prompt-4").draw()
    assert root.num_draws == 0
    random.seed(99)
    expect = [random.random() for _ in range(3)]
    random.seed(99)
    rng = BranchRng(99)
    for _ in range(10):
        rng.draw()
    assert [random.random() for _ in range(3)] == expect
