"""Branch decision rules for ARPO/AEPO rollouts and the recorded random stream they draw from.

Rules (docs/design/arpo_reference.md §2.5, §4.1, §4.2), with ΔH = h_now - h0 (current segment entropy minus the
trajectory's first-segment baseline), β = ``entropy_weight``, τ = ``threshold``:

* ``variant="arpo"``: s = clip(U - β·ΔH, 0, 1); branch iff s <= τ. P(branch) = clip(τ + β·ΔH, 0, 1).
* ``variant="aepo"``: s = clip((U + β·ΔH)·max(0, 1 - penalty·c), 0, 1); branch iff s >= τ, where c is
  the consecutive-branch count the caller tracks. With c = 0, P(branch) = clip(1 - τ + β·ΔH, 0, 1): the
  same as ARPO's only at τ = 0.5. τ means opposite things in the two rules (ARPO: the branch probability
  at ΔH = 0; AEPO: the no-branch probability at ΔH = 0), so an ARPO τ_A corresponds to an AEPO τ = 1 - τ_A.
  With c > 0, P = clip(1 - τ/f + β·ΔH, 0, 1), f = 1 - penalty·c.
* ``aepo_initial_rollouts``: m = clip(floor(n·σ(0.5·ΔH)) + 1, 1, n), ΔH = H_root - mean H_tool.

What τ and β mean depends on two rollout settings, ``rollout.branch_timing`` (which segment's entropy a
decision reads) and ``rollout.entropy_estimator`` (the scale of H, `megatron_arpo.algo.entropy`). The
published values (ARPO scripts: τ = 0.5, β = 0.2; AEPO: τ = 0.5, β = 0.2) were tuned on the reference code,
i.e. ``reference`` timing and ``reference`` estimator; in that combination the first decision of a
trajectory reads the segment that also set H0, so ΔH = 0 and it branches with probability exactly τ, and
later decisions with τ + β·ΔH. The τ/β that reproduce those rates in the other combinations (ARPO; for AEPO
use 1 - τ, same β; E[ΔH₁] = mean ΔH at a trajectory's first decision, read from a first step's
``rollout/entropy_after_tool - rollout/entropy_first_segment`` metrics; S = W·ln(k)/ln|V|, W =
``entropy_window``, k = top-k entries per position, S = 3.86 for W = 20, k = 10 and Qwen's |V| ≈ 151.7k):

| timing | estimator | ΔH at the 1st decision | scale of H | τ | β |
|---|---|---|---|---|---|
| reference | reference | 0 | [0, ≈ S]: sum over ≤ W positions / ln|V|, smaller for short segments | 0.5 | 0.2 |
| reference | mean | 0 | [0, 1] per token, length independent | 0.5 | 0.2·S = 0.77 when segments fill the window; less when many are shorter (0.36 measured with a third under W); no single β reproduces the reference's shrinking of short segments |
| after_result | reference | H(first W tokens after the result) - H0, ≠ 0 | as row 1 | 0.5 - 0.2·E[ΔH₁] .. 0.5: the low end gives the 1st decision's rate τ, the high end the later decisions' rates (both timings read a post-result segment there) | 0.2 |
| after_result | mean | as row 3 | as row 2 | 0.5 - β·E[ΔH₁] .. 0.5 | as row 2 |

How it was derived and measured: for a position whose top-k mass is ≈ 1, the reference estimator adds the
position's entropy / ln|V| and the mean estimator averages entropy / ln k, so a full window gives
H_reference = S·H_mean; a segment of L < W tokens gives L/W of that. ``after_result`` shifts every decision
to the segment after the result, so its first decision has ΔH ≠ 0 and an offset of β·E[ΔH₁]. The
benchmark ``benchmarks/branching_rates.py`` runs the real scheduler on a scripted policy with a known
entropy profile and compares the per-decision branch probabilities of every row with the reference
combination (benchmarks/RESULTS.md): with full windows the converted β reproduces the reference's rates
exactly (0.500 / 0.575 / 0.590 at the 1st / 2nd / 3rd decision), and the lowered τ gives 0.500 at the
first ``after_result`` decision. The ranges hold for that profile; a different policy has another E[ΔH₁]
and another length mix, which the formulas take as inputs.

The formulas, including the float evaluation order, match the reference, so recorded draws replay
to the same decisions. Differences from the reference live in the caller, not here: the reference
draws U from Python's unseeded global ``random`` (Q17) and keys the AEPO counter per prompt counting
fills as branches (Q11); here U comes from an explicit ``BranchRng`` whose draws are recorded, and the
scheduler decides what ``consecutive_branches`` counts (the recommended per-path count, or the
reference's per-prompt one).
"""

from __future__ import annotations

import hashlib
import logging
import math
import random
from typing import Any

logger = logging.getLogger(__name__)

__all__ = ["BRANCH_VARIANTS", "BranchRng", "aepo_initial_rollouts", "branch_score", "should_branch"]

BRANCH_VARIANTS = ("arpo", "aepo")


def _finite(name: str, value: float) -> float:
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return v


def branch_score(
    u: float,
    h_now: float,
    h0: float,
    entropy_weight: float = 0.2,
    variant: str = "arpo",
    consecutive_branches: int = 0,
    penalty: float = 0.05,
) -> float:
    """The clipped score s of one draw (recorded next to the decision); see module docstring."""
    if variant not in BRANCH_VARIANTS:
        raise ValueError(f"unknown branch variant {variant!r}; allowed: {', '.join(BRANCH_VARIANTS)}")
    u = _finite("u", u)
    if not 0.0 <= u <= 1.0:
        raise ValueError(f"u must be a uniform draw in [0, 1], got {u}")
    delta = _finite("h_now", h_now) - _finite("h0", h0)
    beta = _finite("entropy_weight", entropy_weight)
    if variant == "arpo":
        s = u - beta * delta
    else:
        if isinstance(consecutive_branches, bool) or int(consecutive_branches) != consecutive_branches \
                or consecutive_branches < 0:
            raise ValueError(f"consecutive_branches must be an int >= 0, got {consecutive_branches!r}")
        pen = _finite("penalty", penalty)
        if pen < 0:
            raise ValueError(f"penalty must be >= 0 (reference: 0.05), got {penalty}")
        s = (u + beta * delta) * max(0.0, 1.0 - pen * consecutive_branches)
    return min(max(s, 0.0), 1.0)


def should_branch(
    u: float,
    h_now: float,
    h0: float,
    threshold: float = 0.5,
    entropy_weight: float = 0.2,
    variant: str = "arpo",
    consecutive_branches: int = 0,
    penalty: float = 0.05,
) -> bool:
    """Whether one draw ``u`` spawns a branch. ARPO: s <= τ; AEPO: s >= τ (both inclusive).

    ``consecutive_branches`` and ``penalty`` only affect ``variant="aepo"``.
    """
    tau = _finite("threshold", threshold)
    if not 0.0 <= tau <= 1.0:
        raise ValueError(f"threshold (branch_probability) must be in [0, 1], got {threshold}")
    s = branch_score(u, h_now, h0, entropy_weight, variant, consecutive_branches, penalty)
    return s <= tau if variant == "arpo" else s >= tau


def _sigmoid(x: float) -> float:
    if x >= 0:
        return 1.0 / (1.0 + math.exp(-x))
    e = math.exp(x)
    return e / (1.0 + e)


def aepo_initial_rollouts(n: int, delta_h: float, beta: float = 0.5) -> int:
    """AEPO's number of initial (global) rollouts for a prompt: clip(floor(n·σ(β·ΔH)) + 1, 1, n).

    ``delta_h`` = H_root - mean(H_tool); ``beta`` is 0.5 hard-coded in the reference. The "+1 after
    floor" of the reference is kept (ΔH = 0 gives n/2 + 1).
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1:
        raise ValueError(f"n (trajectories per prompt) must be an int >= 1, got {n!r}")
    x = _finite("beta", beta) * _finite("delta_h", delta_h)
    return min(max(math.floor(n * _sigmoid(x)) + 1, 1), n)


class BranchRng:
    """A seeded stream of uniform draws in [0, 1) that records every value it hands out.

    Independent of Python's global ``random`` and of numpy/torch RNGs. ``state_dict()`` is plain
    JSON-serialisable data; loading it continues the stream exactly. ``spawn(key)`` derives an
    independent child stream from (seed, key) through SHA-256, so each trajectory's draws do not depend
    on the order in which tool results arrive. That alone does not make a tree reproducible: which
    decision gets a contested budget slot must not depend on arrival order either, which the scheduler
    ensures by allocating slots in a canonical order (`megatron_arpo.rollout.ledger`).
    """

    def __init__(self, seed: int) -> None:
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.seed = seed
        self._rng = random.Random(seed)
        self.history: list[float] = []

    def draw(self) -> float:
        u = self._rng.random()
        self.history.append(u)
        return u

    @property
    def num_draws(self) -> int:
        return len(self.history)

    def clear_history(self) -> list[float]:
        """Return the recorded draws and start a new record (the stream itself continues)."""
        taken, self.history = self.history, []
        return taken

    def spawn(self, key: str | int) -> BranchRng:
        digest = hashlib.sha256(f"{self.seed}/{key}".encode()).digest()
        return BranchRng(int.from_bytes(digest[:8], "little"))

    def state_dict(self) -> dict[str, Any]:
        version, internal, gauss_next = self._rng.getstate()
        return {
            "seed": self.seed,
            "state": [version, list(internal), gauss_next],
            "history": list(self.history),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        try:
            version, internal, gauss_next = state["state"]
            self._rng.setstate((version, tuple(internal), gauss_next))
            self.seed = int(state["seed"])
            self.history = [float(u) for u in state["history"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise ValueError(
                f"not a BranchRng state_dict (need keys seed, state, history): {exc}"
            ) from exc

    def __repr__(self) -> str:
        return f"BranchRng(seed={self.seed}, num_draws={self.num_draws})"
