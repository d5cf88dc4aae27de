"""Evaluation metrics: pass@k, pass@1 mean±std, EM, F1, accuracy, math equivalence, answer extraction.

The scorers are the RL rewards' own helpers (`megatron_arpo.rewards.text` and `.math`), so evaluation
and training score answers identically.

Differences from the reference evaluation code (ARPO `evaluation/src/metrics.py`, docs/design/arpo_reference.md §9):
  - QA normalisation is the standard SQuAD one, which DELETES punctuation; the reference keeps it.
    So `Paris.` vs `Paris` is em 1, f1 1 here (reference: em 0, f1 0; acc 1 in both). This matches the
    training reward's normalisation and the published HotpotQA/SQuAD scripts.
  - The same normalisation is used for math tasks' em/f1/accuracy (the reference's math path only
    lowercases and collapses spaces); math tasks should report `math_equal`.
  - Token F1 has the HotpotQA yes/no/noanswer rule (as the training reward).
  - `math_equal` is math-verify plus a light LaTeX string normalisation, not Hendrycks `is_equiv`.
  - pass@k is computed (the reference leaves it out): the unbiased estimator of Chen et al. (2021).
Kept from the reference: gold strings starting with `[` are lists split on commas (QA metrics only, not
`math_equal`, where `[1, 2]` is an interval); metrics are maxima over gold answers.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Iterable, Sequence

from megatron_arpo.rewards.math import math_equal
from megatron_arpo.rewards.text import (
    extract_answer,
    max_contains,
    max_exact_match,
    max_token_f1,
    normalize_answer,
)

__all__ = [
    "accuracy",
    "exact_match",
    "extract_answer",
    "math_equal",
    "mean_std",
    "normalize_answer",
    "pass_at_k",
    "qa_f1",
]


def _check_count(name: str, value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise TypeError(f"pass_at_k: {name} must be an integer, got {type(value).__name__} {value!r}")
    return int(value)


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct: 1 - C(n-c, k) / C(n, k).

    Computed as 1 - prod_{i=n-c+1..n} (1 - k/i), which never forms the large binomials.
    """
    n, c, k = _check_count("n", n), _check_count("c", c), _check_count("k", k)
    if n < 1:
        raise ValueError(f"pass_at_k: n (samples per problem) must be >= 1, got n={n}")
    if not 0 <= c <= n:
        raise ValueError(f"pass_at_k: c (correct samples) must satisfy 0 <= c <= n, got c={c}, n={n}")
    if not 1 <= k <= n:
        raise ValueError(
            f"pass_at_k: k must satisfy 1 <= k <= n, got k={k}, n={n}; sample at least k answers per problem"
        )
    if n - c < k:
        return 1.0
    return 1.0 - math.prod(1.0 - k / i for i in range(n - c + 1, n + 1))


def mean_std(values: Iterable[float], ddof: int = 0) -> tuple[float, float]:
    """Mean and standard deviation (population by default, `ddof=1` for the sample std) of run scores."""
    data: Sequence[float] = [float(v) for v in values]
    if not data:
        raise ValueError("mean_std: no values; pass one score per evaluation run")
    if ddof not in (0, 1):
        raise ValueError(f"mean_std: ddof must be 0 (population) or 1 (sample), got {ddof!r}")
    if len(data) <= ddof:
        raise ValueError(f"mean_std: ddof={ddof} needs more than {ddof} value(s), got {len(data)}")
    mean = math.fsum(data) / len(data)
    variance = math.fsum((v - mean) ** 2 for v in data) / (len(data) - ddof)
    return mean, math.sqrt(variance)


def exact_match(prediction: str, gold: str | Iterable[str]) -> float:
    """1.0 if the normalised prediction equals a normalised gold answer, else 0.0."""
    return max_exact_match(prediction, gold, split_list=True)


def qa_f1(prediction: str, gold: str | Iterable[str]) -> float:
    """Best token F1 of the prediction against the gold answers."""
    return max_token_f1(prediction, gold, split_list=True)


def accuracy(prediction: str, gold: str | Iterable[str]) -> float:
    """1.0 if a (non-empty) normalised gold answer is contained in the normalised prediction."""
    return max_contains(prediction, gold, split_list=True)
