"""The order in which one prompt's branch decisions take budget slots: deterministic branch allocation.

A prompt has ``n - count`` free slots; several trajectories reach tool results at times set by tool and
engine latencies. If the slots went to whichever decision came first (as a plain asynchronous scheduler
would do), the tree would depend on latencies: rollouts would not be reproducible from the seed, and fast
tools (cache hits, short python) would get more branches than slow ones. So every decision point gets a
canonical rank and decisions resolve in rank order, whatever order they were reached in:

    rank of a decision = (k, i)    k = tool results on the trajectory's path at the decision (inherited
                                       ones included), i = the trajectory's creation index in its prompt

This is the reference's order (docs/design/arpo_reference.md §2.4-2.5: rounds, then trajectory index within the
round; a copy forked after result k joins round k + 1 like here), without its barrier. A decision
resolves once nothing can still produce an earlier-ranked one: every live trajectory's next decision
(its *frontier*) ranks after it. A live trajectory that registered its decision at k cannot decide
before (k + 1, i); a child forked at (k, i) gets a larger index and decides at k + 1 or later, so it
never precedes its own origin. Only the spawning of children waits for the order; the trajectories
themselves (the parent's own continuation included) run on. When the prompt's budget is used up, every
pending and later decision resolves at once to "no draw", which is also what the canonical order
would give (the budget never frees up again).

The ledger is pure bookkeeping (no asyncio): the scheduler registers decisions and opens/closes
trajectories, and pops what is resolvable after every change.
"""

from __future__ import annotations

import heapq
import logging
import math
from dataclasses import dataclass, field
from typing import Any, Optional

logger = logging.getLogger(__name__)

__all__ = ["DecisionLedger", "PendingDecision"]

_NEVER = (math.inf, math.inf)


@dataclass
class PendingDecision:
    """A decision point waiting for its turn (and, with after-result timing, for its probe's entropy)."""

    k: int                      # tool results on the path at the decision
    index: int                  # creation index of the deciding trajectory
    at_offset: int              # fork point: response offset right after the k-th result block
    timing: str                 # "after_result" | "reference"
    owner: Any = field(default=None, repr=False)   # the scheduler's live trajectory
    h_now: Optional[float] = None   # None until the entropy is known

    @property
    def key(self) -> tuple[int, int]:
        return (self.k, self.index)

    @property
    def ready(self) -> bool:
        return self.h_now is not None


class DecisionLedger:
    """Per-prompt canonical order of branch decisions (see module docstring)."""

    def __init__(self) -> None:
        self._frontier: dict[int, tuple[int, int]] = {}   # live trajectory index -> its earliest possible next rank
        self._heap: list[tuple[tuple[int, int], PendingDecision]] = []
        self._last: tuple[float, float] = (-1, -1)       # rank of the last decision resolved in order

    def open(self, index: int, next_k: int) -> None:
        """A trajectory starts; its first decision can come at ``next_k`` results (1 for a root)."""
        if index in self._frontier:
            raise AssertionError(f"trajectory index {index} opened twice")
        self._frontier[index] = (next_k, index)

    def close(self, index: int) -> None:
        """A trajectory ended: it produces no further decision."""
        self._frontier.pop(index, None)

    def register(self, decision: PendingDecision) -> None:
        if decision.index not in self._frontier:
            raise AssertionError(f"decision {decision.key} from a trajectory that is not open")
        if decision.key < self._frontier[decision.index]:
            raise AssertionError(f"decision {decision.key} ranks before its trajectory's frontier "
                                 f"{self._frontier[decision.index]}")
        self._frontier[decision.index] = (decision.k + 1, decision.index)
        heapq.heappush(self._heap, (decision.key, decision))

    @property
    def num_pending(self) -> int:
        return len(self._heap)

    def pop_resolvable(self, budget_left: bool = True) -> Optional[PendingDecision]:
        """The next decision to resolve, or None when the earliest pending one must still wait.

        ``budget_left=False``: the prompt has no slot left; every pending decision resolves now (to no draw).
        """
        if not self._heap:
            return None
        key, decision = self._heap[0]
        if budget_left:
            if not decision.ready or min(self._frontier.values(), default=_NEVER) < key:
                return None
            if key <= self._last:
                raise AssertionError(f"decision {key} resolved after {self._last}: the canonical order is broken")
            self._last = key
        heapq.heappop(self._heap)
        return decision
