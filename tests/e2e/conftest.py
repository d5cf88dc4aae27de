"""Runs of `megatron-arpo train` that several e2e tests read, started once per session.

- ``sync_run``: two RL steps of the tiny Qwen3 in sync mode, default (non-deterministic-mode) path,
  separate pools on that cluster, rollout records saved, validation at step 2, final HF export.
  The determinism, off-policy and replay tests read it.
- ``off_policy_run``: the same run with ``trainer.mode: off_policy`` and ``rollout.max_staleness: 0``,
  which must equal ``sync_run`` bit for bit (test_off_policy_train.py, test_train_determinism.py).
- ``in_flight_run``: three off-policy steps with ``rollout.in_flight_updates`` (test_off_policy_train.py).

Both run on the session's 2-raylet Ray cluster (``_ray_two_node_cluster``, tests/conftest.py).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from train_helpers import read_rows, run_train, train_command, write_task  # noqa: E402

SHARED_SETS = ("logging.wandb.mode=disabled", "logging.save_rollout_records=true", "trainer.placement=separate",
               "trainer.actor_devices=2", "trainer.rollout_devices=1")


@dataclass(frozen=True)
class TrainRun:
    """A finished run: its directory, its log, the task it trained on and its metrics rows."""

    run_dir: Path
    log: Path
    data: Path
    rows: list


def _train(cluster, data: Path, run_dir: Path, *sets: str) -> TrainRun:
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    cmd = train_command(str(tiny_checkpoint("tiny-qwen3")), data, run_dir, *SHARED_SETS, *sets, resume="none")
    log = run_dir.parent / f"{run_dir.name}.log"
    run_train(cmd, data, log, cluster.address, timeout=900)
    return TrainRun(run_dir=run_dir, log=log, data=data, rows=read_rows(run_dir))


@pytest.fixture(scope="session")
def _shared_task(tmp_path_factory) -> Path:
    return write_task(tmp_path_factory.mktemp("shared-runs"))


@pytest.fixture(scope="session")
def sync_run(_ray_two_node_cluster, _shared_task) -> TrainRun:  # noqa: F811
    return _train(_ray_two_node_cluster, _shared_task, _shared_task.parent / "sync", "trainer.mode=sync")


@pytest.fixture(scope="session")
def off_policy_run(_ray_two_node_cluster, _shared_task) -> TrainRun:  # noqa: F811
    return _train(_ray_two_node_cluster, _shared_task, _shared_task.parent / "off", "trainer.mode=off_policy",
                  "rollout.max_staleness=0")


@pytest.fixture(scope="session")
def in_flight_run(_ray_two_node_cluster, _shared_task) -> TrainRun:  # noqa: F811
    """Three steps with ``rollout.in_flight_updates`` (max_staleness 1), every sync checksummed."""
    return _train(_ray_two_node_cluster, _shared_task, _shared_task.parent / "in-flight", "trainer.mode=off_policy",
                  "rollout.max_staleness=1", "rollout.in_flight_updates=true", "rollout.verify_sync=true",
                  "trainer.total_steps=3", "trainer.val_every=0", "trainer.export_hf_at_end=false")
