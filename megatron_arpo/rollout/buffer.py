"""The bounded rollout buffer of ``trainer.mode: off_policy``: whole prompt groups (ARPO trees) wait here.

The engines put finished groups in; the trainer takes the oldest ``trainer.train_batch_size`` of them as
one batch. A group's age is measured by its oldest sampled token (``Trajectory.oldest_version``): a
group whose oldest token is more than ``rollout.max_staleness`` versions behind the policy being trained
is dropped at ``take`` and counted, never recomputed (its prompt is not retried this epoch). Slots
reserved for groups still being generated count against the capacity (``rollout.buffer_groups``), so
the producer cannot run ahead of it.

``state_dict`` holds the finished groups and the counters; a checkpoint saves it (``save``, atomic) and
a resumed run loads it, counting the groups that were in flight at the save as dropped: they are not
regenerated.
"""

from __future__ import annotations

import json
import logging
import os
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_arpo.fsutil import atomic_write
from megatron_arpo.rollout.trajectory import Trajectory

logger = logging.getLogger(__name__)

__all__ = ["BufferedGroup", "RolloutBuffer"]

STATE_VERSION = 1


@dataclass
class BufferedGroup:
    """One prompt's finished trajectories (its whole tree) with what scoring needs later."""

    prompt_id: str
    token_ids: list[int]
    dataset_index: int             # the prompt's row in the training set (ground truth, data source)
    trajectories: list[Trajectory] = field(default_factory=list)

    def oldest_version(self) -> Optional[int]:
        versions = [v for v in (t.oldest_version() for t in self.trajectories) if v is not None]
        return min(versions) if versions else None

    def to_dict(self) -> dict[str, Any]:
        return {"prompt_id": self.prompt_id, "token_ids": list(self.token_ids), "dataset_index": self.dataset_index,
                "trajectories": [t.to_dict() for t in self.trajectories]}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "BufferedGroup":
        return cls(data["prompt_id"], list(data["token_ids"]), int(data["dataset_index"]),
                   [Trajectory.from_dict(t) for t in data["trajectories"]])


class RolloutBuffer:
    """FIFO of finished groups, bounded by ``capacity`` (finished plus reserved), aged by policy versions."""

    def __init__(self, capacity: int, max_staleness: int):
        if capacity < 1 or max_staleness < 0:
            raise ValueError(f"capacity must be >= 1 and max_staleness >= 0, got {capacity}, {max_staleness} "
                             f"(rollout.buffer_groups, rollout.max_staleness)")
        self.capacity = capacity
        self.max_staleness = max_staleness
        self.groups: deque[BufferedGroup] = deque()
        self.in_flight = 0
        self.counters = {"put": 0, "taken": 0, "dropped_stale": 0, "dropped_in_flight": 0}

    def __len__(self) -> int:
        return len(self.groups)

    @property
    def room(self) -> int:
        """Groups the producer may still start."""
        return self.capacity - len(self.groups) - self.in_flight

    def reserve(self, count: int) -> None:
        """``count`` groups start generating."""
        if count > self.room:
            raise ValueError(f"cannot reserve {count} groups: {self.room} free of {self.capacity}")
        self.in_flight += count

    def put(self, groups: Sequence[BufferedGroup]) -> None:
        """Reserved groups finished."""
        if len(groups) > self.in_flight:
            raise ValueError(f"{len(groups)} groups put but only {self.in_flight} reserved")
        self.in_flight -= len(groups)
        self.groups.extend(groups)
        self.counters["put"] += len(groups)

    def lose_in_flight(self, count: int) -> None:
        """Reserved groups that will never finish (an engine died, a cancelled call): counted as dropped."""
        count = min(count, self.in_flight)
        self.in_flight -= count
        self.counters["dropped_in_flight"] += count

    def is_stale(self, group: BufferedGroup, version: int) -> bool:
        oldest = group.oldest_version()
        return oldest is not None and version - oldest > self.max_staleness

    def drop_stale(self, version: int) -> list[BufferedGroup]:
        """Remove (and count) every group too old to train policy ``version``; returns them."""
        stale = [g for g in self.groups if self.is_stale(g, version)]
        if stale:
            self.groups = deque(g for g in self.groups if not self.is_stale(g, version))
            self.counters["dropped_stale"] += len(stale)
            logger.warning("rollout buffer: dropped %d group(s) sampled more than %d version(s) before version %d",
                           len(stale), self.max_staleness, version)
        return stale

    def ready(self, num_groups: int, version: int) -> bool:
        return sum(not self.is_stale(g, version) for g in self.groups) >= num_groups

    def take(self, num_groups: int, version: int) -> list[BufferedGroup]:
        """The oldest ``num_groups`` groups fit to train policy ``version`` (stale ones dropped first)."""
        self.drop_stale(version)
        if len(self.groups) < num_groups:
            raise ValueError(f"the buffer holds {len(self.groups)} groups, {num_groups} asked for")
        batch = [self.groups.popleft() for _ in range(num_groups)]
        self.counters["taken"] += num_groups
        return batch

    def put_back(self, groups: Sequence[BufferedGroup]) -> None:
        """An abandoned step's batch goes back to the front, in its order."""
        self.groups.extendleft(reversed(list(groups)))
        self.counters["taken"] -= len(groups)

    def version_lags(self, version: int) -> list[int]:
        """Per finished group, how many versions its oldest token is behind ``version`` (the depth's ages)."""
        return [version - v for v in (g.oldest_version() for g in self.groups) if v is not None]

    # ------------------------------------------------------------------ checkpoint
    def state_dict(self) -> dict[str, Any]:
        return {"version": STATE_VERSION, "groups": [g.to_dict() for g in self.groups],
                "counters": dict(self.counters), "in_flight": self.in_flight}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Finished groups and counters back; the groups in flight at the save count as dropped."""
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"rollout buffer state version {state.get('version')!r}; this build reads "
                             f"{STATE_VERSION}")
        self.groups = deque(BufferedGroup.from_dict(g) for g in state["groups"])
        self.counters = {**self.counters, **state.get("counters", {})}
        self.counters["dropped_in_flight"] += int(state.get("in_flight", 0))
        self.in_flight = 0
        if len(self.groups) > self.capacity:
            logger.warning("rollout buffer: %d groups restored into a capacity of %d (rollout.buffer_groups was "
                           "lowered); the producer waits until it drains", len(self.groups), self.capacity)

    def save(self, path: str | os.PathLike) -> Path:
        with atomic_write(path) as fh:
            json.dump(self.state_dict(), fh, separators=(",", ":"))
        return Path(path)

    def load(self, path: str | os.PathLike) -> None:
        with open(path, encoding="utf-8") as fh:
            self.load_state_dict(json.load(fh))
