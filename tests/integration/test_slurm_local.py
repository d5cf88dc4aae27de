"""The local 2-node Slurm cluster manager: restart over a crashed run's leftovers, stop by PID."""

from __future__ import annotations

import os

import pytest

from support.slurm_local import LocalSlurmCluster, _pid_alive, missing_requirements

pytestmark = pytest.mark.timeout(120)


def test_start_over_a_crashed_run_stops_its_daemons_and_state(tmp_path):
    if missing_requirements():
        pytest.skip(missing_requirements())
    ports = dict(ctld_port=16917, slurmd_ports=(17101, 17102))
    crashed = LocalSlurmCluster(tmp_path / "slurm", **ports).start()
    stale_pids = [p.pid for p in crashed._procs.values()]
    (crashed.state_dir / "leftover").write_text("from the crashed run")
    crashed._release_lock()  # what a killed pytest process leaves: daemons running, lock released
    crashed._restore_env()
    fresh = LocalSlurmCluster(tmp_path / "slurm", **ports)
    try:
        fresh.start()
        assert not any(_pid_alive(pid) for pid in stale_pids)
        assert not (fresh.state_dir / "leftover").exists()
        assert fresh.run("sinfo", "-h", "-o", "%T %D").stdout.strip() == "idle 2"
        assert os.environ["SLURM_CONF"] == str(fresh.conf_path)
        own = [p.pid for p in fresh._procs.values()]
    finally:
        fresh.stop()
    assert not any(_pid_alive(pid) for pid in own)
    assert os.environ.get("SLURM_CONF") != str(fresh.conf_path)
