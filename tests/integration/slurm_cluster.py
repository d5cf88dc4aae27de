"""Pytest fixtures for the real local Slurm cluster and Ray port plans (import into test modules).

``slurm_cluster`` (session scope) starts ``support.slurm_local.LocalSlurmCluster`` in
``<repo>/.slurm-local`` (git-ignored; a fixed place so a crashed run's daemons are found and stopped
next time) and skips, with the reason, when Slurm is not installed or the user is not root.
``ray_ports`` picks a block of free ports for one Ray cluster so tests never collide with other Ray
users of this machine.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import pytest

from support.slurm_local import LocalSlurmCluster, missing_requirements
from ray_cluster import free_port_block

REPO_ROOT = Path(__file__).resolve().parents[2]


def free_port_plan(num_nodes: int = 2, ports_per_node: int = 40) -> dict[str, int]:
    """Launcher port options (``ray_*``) for a cluster whose every port is currently free, below the
    ephemeral range (see ``ray_cluster.free_port_block``)."""
    base = free_port_block(10 + num_nodes * ports_per_node)
    return {"ray_gcs_port": base, "ray_client_server_port": base + 1,
            "ray_node_port_base": base + 10, "ray_ports_per_node": ports_per_node}


# Test modules import the fixture, so pytest registers one "session" fixture per module; they share
# this one cluster (the first to start it stops it at the end of the session).
_SHARED: dict[str, LocalSlurmCluster] = {}


@pytest.fixture(scope="session")
def slurm_cluster():
    reason = missing_requirements()
    if reason:
        pytest.skip(reason)
    if "cluster" in _SHARED:
        yield _SHARED["cluster"]
        return
    cluster = LocalSlurmCluster(os.environ.get("MEGATRON_ARPO_SLURM_DIR", REPO_ROOT / ".slurm-local"))
    with cluster:
        _SHARED["cluster"] = cluster
        try:
            yield cluster
        finally:
            _SHARED.pop("cluster", None)


@pytest.fixture
def ray_ports():
    return free_port_plan()


def job_env() -> dict[str, str]:
    """Environment for jobs: this interpreter's venv first on PATH, the repo importable."""
    env = dict(os.environ)
    env["PATH"] = os.path.dirname(sys.executable) + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = str(REPO_ROOT) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    return env


def wait_requeued(cluster: LocalSlurmCluster, job_id: str, timeout: float) -> None:
    """Poll until the job is PENDING again after one restart (requeued); fail the test otherwise."""
    deadline = time.monotonic() + timeout
    info: dict[str, str] = {}
    while time.monotonic() < deadline:
        info = cluster.job_info(job_id)
        if info.get("Restarts") == "1" and info.get("JobState") == "PENDING":
            return
        if info.get("JobState") in ("FAILED", "COMPLETED", "CANCELLED"):
            break
        time.sleep(0.3)
    pytest.fail(f"job {job_id} was not requeued: {info.get('JobState')} restarts {info.get('Restarts')}")
