"""A real Slurm job running the real trainer (issue 7): ranks on both nodes, preemption, requeue, resume.

The sbatch script rendered by the launcher forms a Ray cluster over both slurmd "nodes" of the local
test cluster, then runs `megatron-arpo train` on the head: the Megatron actor (TP=2), one vLLM engine,
tools, weight sync and checkpoints. Each raylet offers one CPU, so the actor's two ranks must land on
different nodes; the trainer records where they ran in placement.json. After the first step the test
sends the job USR1: the trainer checkpoints and exits with the preemption code, the script requeues the
job (Ray's daemons stay up until the head is done), and the requeued job resumes from that checkpoint
with `--resume auto` and completes. One job covers all of it: each job start costs a Ray cluster, an
engine and an actor group.
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest

from launchers.options import PREEMPT_EXIT_CODE
from launchers.slurm import render_sbatch, submit
from slurm_cluster import job_env, ray_ports, slurm_cluster, wait_requeued  # noqa: F401 (fixtures)
from test_slurm_ray_cluster import _logs, _options

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from train_helpers import read_rows, train_command, write_task  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def test_two_node_training_job_preempted_checkpoints_requeues_and_resumes(slurm_cluster, ray_ports, tmp_path):
    """USR1 from Slurm -> the real trainer checkpoints and exits 42 -> requeue -> --resume auto -> done."""
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    hf_dir = tiny_checkpoint("tiny-qwen3")
    data = write_task(tmp_path)
    run_dir = tmp_path / "run"
    total = 4
    command = train_command(str(hf_dir), data, run_dir, f"trainer.total_steps={total}", "trainer.val_every=0",
                            "trainer.export_hf_at_end=false", resume="auto")
    opts = _options(tmp_path, ray_ports, job_name="ma-preempt-train", run_dir=str(run_dir), num_cpus=1,
                    object_store_memory=256 * 1024 * 1024, ready_timeout=120, time="00:20:00", requeue=True,
                    max_requeues=2, signal_lead_seconds=60)
    env = job_env()
    env["PYTHONPATH"] = f"{data}:{env['PYTHONPATH']}"
    env.update({"GLOO_SOCKET_IFNAME": "lo", "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind",
                "WANDB_MODE": "offline", "RAY_AUTH_MODE": "disabled"})
    job_id = submit(render_sbatch(opts, command=command), opts["run_dir"], "ma-preempt-train", env=env)

    deadline = time.monotonic() + 600
    while not read_rows(run_dir):  # the first step is done: the trainer is in its loop
        state = slurm_cluster.job_info(job_id).get("JobState")
        assert state in ("PENDING", "RUNNING"), (state, _logs(opts, job_id))
        assert time.monotonic() < deadline, _logs(opts, job_id)
        time.sleep(0.5)
    first_ranks = json.loads((run_dir / "placement.json").read_text())["actor"]
    slurm_cluster.run("scancel", "--signal=USR1", "--batch", job_id)
    wait_requeued(slurm_cluster, job_id, timeout=300)
    saved = sorted(p.name for p in (run_dir / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())
    steps_before = [row["step"] for row in read_rows(run_dir)]
    assert steps_before and steps_before[-1] < total, steps_before
    assert saved and saved[-1] == f"step-{steps_before[-1]}", (saved, steps_before)  # checkpointed where it stopped
    # Slurm holds a requeued job for ~2 minutes (EligibleTime = requeue time + 120 s) while the nodes
    # still revoke the old incarnation's credential; once the nodes are idle, start it a few seconds
    # later (a credential from the very second of the revocation would be rejected as revoked).
    slurm_cluster.wait_idle(timeout=60)
    slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "StartTime=now+3")
    info = slurm_cluster.wait_job(job_id, timeout=700, final_states=("COMPLETED", "FAILED", "CANCELLED"))
    logs = _logs(opts, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0" and info["Restarts"] == "1", logs
    assert [row["step"] for row in read_rows(run_dir)] == list(range(1, total + 1))  # no step lost or repeated
    assert (run_dir / "checkpoints" / f"step-{total}" / "COMPLETE").exists(), logs

    # Both incarnations put the actor's two ranks on different Slurm nodes.
    ranks = json.loads((run_dir / "placement.json").read_text())["actor"]
    for placed in (first_ranks, ranks):
        assert len(placed) == 2 and len({r["node_id"] for r in placed}) == 2, placed

    # The batch script's side of preemption: it passed the notice on, saw the preemption code, requeued.
    batch_log = (run_dir / "logs" / f"ma-preempt-train-{job_id}.out").read_text()
    assert "USR1: asking the trainer to checkpoint" in batch_log, logs
    assert f"job step exited with code {PREEMPT_EXIT_CODE}" in batch_log, logs
    assert "requeueing (restart 1 of at most 2)" in batch_log, logs
    # The notice reached every process of the step; Ray's daemons ignored it and stayed up until the
    # head said done, on both nodes, in both incarnations.
    node_logs = [(run_dir / "logs" / f"ma-preempt-train-{job_id}-node{k}.out").read_text() for k in (0, 1)]
    assert "SIGUSR1 received; not forwarded" in node_logs[0], logs
    assert node_logs[1].count("head finished; leaving") == 2, node_logs[1]
    assert "ray start exited" not in node_logs[0] + node_logs[1]
