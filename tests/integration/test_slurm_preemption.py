"""Preemption on real Slurm: USR1 to the batch shell -> the trainer checkpoints and exits with the
preemption code -> the script requeues the job -> the requeued job resumes from the checkpoint and
completes. A stand-in trainer (a tiny script with the trainer's contract) replaces `megatron-arpo train`."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

from launchers.options import PREEMPT_EXIT_CODE
from launchers.slurm import render_sbatch, submit
from slurm_cluster import job_env, ray_ports, slurm_cluster  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]  # Slurm waits about 2 min before it restarts a requeued job

# The trainer's contract: on SIGUSR1 save a checkpoint at the next safe point and exit with the
# preemption code; when started with a checkpoint present (--resume auto), resume and finish.
STAND_IN_TRAINER = r'''
import json, os, signal, sys, time
run_dir, preempt_code = sys.argv[1], int(sys.argv[2])
events, ckpt = os.path.join(run_dir, "events.txt"), os.path.join(run_dir, "checkpoint.json")
restart = os.environ.get("SLURM_RESTART_COUNT", "0")

def log(msg):
    with open(events, "a") as fh:
        fh.write(f"{msg} restart={restart}\n")

if os.path.exists(ckpt):
    with open(ckpt) as fh:
        step = json.load(fh)["step"]
    log(f"resumed step={step}")
    log("completed")
    sys.exit(0)
stop = []

def on_usr1(*_):
    stop.append(True)
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)  # decided to stop: later notices must not kill the exit

signal.signal(signal.SIGUSR1, on_usr1)
log("started")
open(os.path.join(run_dir, "trainer-ready"), "w").close()
step, deadline = 0, time.monotonic() + 120
while not stop and time.monotonic() < deadline:
    step += 1
    time.sleep(0.05)
with open(ckpt + ".tmp", "w") as fh:
    json.dump({"step": step}, fh)
os.replace(ckpt + ".tmp", ckpt)
log(f"checkpointed step={step}")
sys.exit(preempt_code if stop else 1)
'''


def _wait_for(path: Path, timeout: float, cluster, job_id: str) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        state = cluster.job_info(job_id).get("JobState")
        if state in ("FAILED", "COMPLETED", "CANCELLED", "TIMEOUT"):
            pytest.fail(f"job {job_id} ended ({state}) before {path} appeared")
        if time.monotonic() > deadline:
            pytest.fail(f"{path} did not appear within {timeout:.0f} s (job {job_id})")
        time.sleep(0.2)


def _wait_requeued(cluster, job_id: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    info = {}
    while time.monotonic() < deadline:
        info = cluster.job_info(job_id)
        if info.get("Restarts") == "1" and info.get("JobState") == "PENDING":
            return
        if info.get("JobState") in ("FAILED", "COMPLETED", "CANCELLED"):
            break
        time.sleep(0.3)
    pytest.fail(f"job {job_id} was not requeued: {info.get('JobState')} restarts {info.get('Restarts')}")


def test_usr1_checkpoints_requeues_resumes_and_completes(slurm_cluster, ray_ports, tmp_path):
    trainer = tmp_path / "trainer.py"
    trainer.write_text(STAND_IN_TRAINER)
    run_dir = tmp_path / "run"
    opts = {"nodes": 2, "gpus_per_node": 0, "time": "00:05:00", "run_dir": str(run_dir),
            "job_name": "ma-preempt", "python": sys.executable, "network_interface": "lo", "num_cpus": 1,
            "object_store_memory": 80 * 1024 * 1024, "ready_timeout": 60, "requeue": True,
            "max_requeues": 2, "signal_lead_seconds": 60, **ray_ports}
    command = [sys.executable, str(trainer), "$RUN_DIR", str(PREEMPT_EXIT_CODE)]
    job_id = submit(render_sbatch(opts, command=command), run_dir, "ma-preempt", env=job_env())

    _wait_for(run_dir / "trainer-ready", 120, slurm_cluster, job_id)
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    _wait_requeued(slurm_cluster, job_id, timeout=60)
    # Slurm holds a requeued job for ~2 minutes (EligibleTime = requeue time + 120 s) while the nodes
    # still revoke the old incarnation's credential; once the nodes are idle, start it a few seconds
    # later (a credential from the very second of the revocation would be rejected as revoked).
    slurm_cluster.wait_idle(timeout=60)
    slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+3")
    info = slurm_cluster.wait_job(job_id, timeout=120, final_states=("COMPLETED", "FAILED", "CANCELLED"))

    batch_log = (run_dir / "logs" / f"ma-preempt-{job_id}.out").read_text()
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", batch_log
    assert info["Restarts"] == "1"
    events = [line.split(" step=")[0] if "step=" in line else line
              for line in (run_dir / "events.txt").read_text().split("\n") if line]
    assert events == ["started restart=0", "checkpointed", "resumed", "completed restart=1"], events
    lines = (run_dir / "events.txt").read_text().split("\n")
    saved = lines[1].split("step=")[1].split()[0]
    assert lines[2] == f"resumed step={saved} restart=1"  # resumed exactly the saved checkpoint
    assert "USR1: asking the trainer to checkpoint" in batch_log
    assert f"job step exited with code {PREEMPT_EXIT_CODE}" in batch_log
    assert "requeueing (restart 1 of at most 2)" in batch_log
    # The notice reached every process of the step; Ray's daemons ignored it and stayed up until the
    # head said done, on both nodes.
    node_logs = [(run_dir / "logs" / f"ma-preempt-{job_id}-node{k}.out").read_text() for k in (0, 1)]
    assert "SIGUSR1 received; not forwarded" in node_logs[0]
    assert node_logs[1].count("head finished; leaving") == 2, node_logs[1]
    assert "ray start exited" not in node_logs[0] + node_logs[1]
