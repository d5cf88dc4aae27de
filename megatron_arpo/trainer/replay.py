"""Train on saved rollout records instead of live rollouts: ``megatron-arpo train --replay-rollouts DIR``.

A run with ``logging.save_rollout_records: true`` writes, per step ``s``, ``<run_dir>/rollouts/step-s.jsonl``
(one trajectory record per line, rewards included) and ``step-s.stats.json`` (the scheduler's counters).
Replaying that directory runs the same training step without any vLLM engine or tool: the records are the
rollout, their recorded rewards are the reward, and everything from the advantages on (old and reference
log-probs, the PPO update, checkpoints, metrics) is the normal trainer code. With the same config and the
same initial weights the replayed step's loss and metrics equal the recorded run's (slime's debug-rollout
idea; tests/e2e/test_train_replay.py checks it).

Rules:

- trainer step ``s`` trains on ``step-s.jsonl``; a replay stops after the last recorded step (or at
  ``trainer.total_steps``, whichever is first), and a missing step in between is an error;
- the learning-rate schedule still counts the config's steps, so a partial replay follows the recorded run;
- no weight sync and no validation (both need engines); the data sampler advances as in the recorded run,
  so a checkpoint written by a replay resumes a normal run at the right data position.
"""

from __future__ import annotations

import json
import logging
import re
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from megatron_arpo.errors import InputError
from megatron_arpo.fsutil import atomic_write

logger = logging.getLogger(__name__)

RECORD_FILE = re.compile(r"^step-(\d+)\.jsonl$")
HOW_TO_RECORD = "record one with `megatron-arpo train ... --set logging.save_rollout_records=true` (<run_dir>/rollouts)"


def records_path(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step}.jsonl"


def stats_path(root: Path, step: int) -> Path:
    return Path(root) / f"step-{step}.stats.json"


def save_step_records(root: Path, step: int, result: Any) -> None:
    """What a replay needs of one step: the trajectory records and the scheduler's counters (atomic writes)."""
    # deferred: pulls in numpy, torch (heavy; this module imports without it)
    from megatron_arpo.rollout.trajectory import save_records

    save_records(records_path(root, step), result.trajectories())
    with atomic_write(stats_path(root, step)) as fh:
        json.dump(result.stats, fh)


@dataclass
class ReplaySource:
    """A directory of recorded steps, checked when opened."""

    root: Path
    steps: list[int]

    @classmethod
    def open(cls, path: str | Path) -> "ReplaySource":
        root = Path(path)
        if not root.exists():
            raise InputError(f"--replay-rollouts {path}: no such directory; {HOW_TO_RECORD}")
        if not root.is_dir():
            raise InputError(f"--replay-rollouts {path}: is a file; give the directory holding step-<N>.jsonl files")
        steps = sorted(int(m.group(1)) for p in root.iterdir() if (m := RECORD_FILE.match(p.name)))
        if not steps:
            raise InputError(f"--replay-rollouts {path}: no step-<N>.jsonl rollout records in it; {HOW_TO_RECORD}")
        return cls(root, steps)

    @property
    def last_step(self) -> int:
        return self.steps[-1]

    def check_covers(self, first: int, last: int) -> None:
        """Every step in [first, last] has a record file (a replay cannot skip a step)."""
        missing = [s for s in range(first, last + 1) if s not in self.steps]
        if missing:
            raise InputError(f"--replay-rollouts {self.root}: no records for step(s) {missing[:5]} (have "
                             f"{self.steps[0]}..{self.steps[-1]}); replay from a directory covering steps {first}-{last}, "
                             f"or lower trainer.total_steps")

    def load(self, step: int) -> tuple[list, Any]:
        """The step's prompts and its ``RolloutResult`` rebuilt from the records (groups in prompt order)."""
        # deferred: pulls in numpy, torch (heavy; this module imports without it)
        from megatron_arpo.rollout.scheduler import RolloutPrompt, RolloutResult
        from megatron_arpo.rollout.trajectory import load_records

        path = records_path(self.root, step)
        try:
            trajs = load_records(path)
        except (OSError, ValueError) as exc:
            raise InputError(f"--replay-rollouts: {exc}; re-record the step or remove the file") from exc
        if not trajs:
            raise InputError(f"{path}: empty; re-record the step or remove the file")
        groups: dict[int, list] = defaultdict(list)
        for t in trajs:
            if t.reward is None:
                raise InputError(f"{path}: trajectory {t.traj_id} has no reward (a record written before scoring); "
                                 f"{HOW_TO_RECORD}")
            try:
                t.check()
            except ValueError as exc:
                raise InputError(f"{path}: {exc}; the record is corrupt — re-record the step") from exc
            groups[t.prompt_index].append(t)
        order = sorted(groups)
        if order != list(range(len(order))):
            raise InputError(f"{path}: prompt indices {order} are not 0..{len(order) - 1}; the file is incomplete — "
                             f"re-record the step")
        prompts, result_groups = [], []
        for index in order:
            group = sorted(groups[index], key=lambda t: t.index)
            if len({t.prompt_id for t in group}) != 1:
                raise InputError(f"{path}: prompt index {index} holds trajectories of several prompts; re-record the step")
            prompts.append(RolloutPrompt(group[0].prompt_id, list(group[0].prompt_token_ids)))
            result_groups.append(group)
        stats = _load_stats(stats_path(self.root, step), [t for g in result_groups for t in g])
        return prompts, RolloutResult(result_groups, [{} for _ in result_groups], stats)


def _load_stats(path: Path, trajs: list) -> dict[str, float]:
    if path.exists():
        try:
            return {str(k): float(v) for k, v in json.loads(path.read_text()).items()}
        except (ValueError, AttributeError) as exc:
            raise InputError(f"{path}: not a JSON object of counters ({exc}); delete it (the counters are then "
                             f"derived from the records)") from exc
    # Records written by save_records alone: the counters the records determine.
    return {"branches": float(sum(t.origin == "branch" for t in trajs)),
            "fills": float(sum(t.origin == "fill" for t in trajs)),
            "call_limit_hits": float(sum(t.call_limit_hit for t in trajs))}


def data_sources(prompts: list, prompt_set: Any) -> dict[str, str]:
    """Prompt id (``<k>:<uid>``) -> the data source of that uid in the training data ("replay" if absent)."""
    by_uid = {r.uid: r.data_source for r in prompt_set.records}
    return {p.prompt_id: by_uid.get(p.prompt_id.split(":", 1)[1], "replay") for p in prompts}
