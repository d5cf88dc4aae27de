"""Segment entropy from the rollout engine's top-k log-probs (the signal ARPO branches on).

Estimators (select with ``estimator=``):

``reference`` (default) — exactly the ARPO reference's value (docs/design/arpo_reference.md §2.3):
    take the first ``min(window, len)`` generated positions, pool every log-prob the engine returned
    there (top-k alternatives plus the sampled token when it is not among them), and return
    ``-Σ exp(l)·l / ln|V|`` (0 for an empty segment). This is a *sum* of truncated entropies over up to
    ``window`` positions, so it grows with segment length and is not bounded by 1 (20 positions of 10
    equiprobable tokens give 3.86 at |V| = 151,665); it is kept because the published τ/β were tuned
    on it.

``mean`` — the per-token mean of each position's top-k distribution renormalised to sum 1, with each
    position's entropy divided by ln(k_i) (k_i = number of finite entries at that position; positions
    with k_i < 2 count as 0). Result in [0, 1] regardless of vocabulary size, k and segment length,
    so τ/β act on a bounded, length-independent scale. We divide by ln(k_i) rather than ln|V| because a
    top-k renormalised entropy can never exceed ln(k): dividing by ln|V| would squeeze it into
    [0, ln k / ln|V|] ≈ [0, 0.19] and β·ΔH would barely move the branch probability. ``vocab_size`` is
    only validated, not used, by this estimator.

For a top-k mass near 1, a full window gives reference = W·ln(k)/ln|V| × mean (3.86 at W = 20, k = 10,
Qwen's |V|); the τ/β each estimator needs to reproduce the published branching rates are tabulated in
`megatron_arpo.algo.branching`.

Both estimators skip ``-inf`` log-probs (probability 0; the reference would produce NaN from
``exp(-inf)·(-inf)``, Q3) and reject NaN/+inf with an error naming the position.

Input: a sequence over generated positions; each position is a sequence of floats, a mapping
(token id -> float, or -> an object with a ``.logprob`` attribute such as vLLM's ``Logprob``), or
``None`` (no entries).
"""

from __future__ import annotations

import itertools
import logging
import math
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["ENTROPY_ESTIMATORS", "segment_entropy"]

ENTROPY_ESTIMATORS = ("reference", "mean")


def _position_logprobs(entry: Any, position: int) -> list[float]:
    """Finite log-probs of one position; ``-inf`` entries dropped, NaN/+inf rejected."""
    if entry is None:
        return []
    values: Iterable[Any] = entry.values() if isinstance(entry, Mapping) else entry
    out: list[float] = []
    for v in values:
        lp = float(getattr(v, "logprob", v))
        if lp == -math.inf:
            continue
        if not math.isfinite(lp):
            raise ValueError(
                f"logprob {lp} at generated position {position} is not finite; the engine returned "
                "a corrupt top-k entry (only -inf, meaning probability 0, is accepted)"
            )
        out.append(lp)
    return out


def _reference(positions: Sequence[Any], ln_vocab: float) -> float:
    total = 0.0
    for j, entry in enumerate(positions):
        for lp in _position_logprobs(entry, j):
            total -= math.exp(lp) * lp
    return total / ln_vocab


def _mean_renormalised(positions: Sequence[Any]) -> float:
    if len(positions) == 0:
        return 0.0
    total = 0.0
    for j, entry in enumerate(positions):
        lps = _position_logprobs(entry, j)
        if len(lps) < 2:
            continue
        top = max(lps)
        lse = top + math.log(sum(math.exp(lp - top) for lp in lps))
        h = 0.0
        for lp in lps:
            q = lp - lse  # renormalised log-prob
            h -= math.exp(q) * q
        total += max(0.0, h) / math.log(len(lps))
    return total / len(positions)


def segment_entropy(
    topk_logprobs: Iterable[Any],
    vocab_size: int,
    window: int = 20,
    estimator: str = "reference",
) -> float:
    """Entropy of the first ``window`` generated positions of a segment (see module docstring).

    Args:
        topk_logprobs: per generated position, the log-probs the engine returned there.
        vocab_size: |V| of the tokenizer (the reference uses ``len(tokenizer.get_vocab())``).
        window: number of leading positions measured (20 in the reference).
        estimator: ``"reference"`` or ``"mean"``.
    """
    if estimator not in ENTROPY_ESTIMATORS:
        raise ValueError(
            f"unknown entropy estimator {estimator!r}; allowed: {', '.join(ENTROPY_ESTIMATORS)}"
        )
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an int >= 2 (tokenizer vocabulary size), got {vocab_size!r}")
    if isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(f"window must be an int >= 1 (reference: 20), got {window!r}")
    positions = list(itertools.islice(topk_logprobs, window))
    if estimator == "reference":
        return _reference(positions, math.log(vocab_size))
    return _mean_renormalised(positions)
