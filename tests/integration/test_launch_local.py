"""`megatron-arpo launch local` with real Ray processes: a 2-node cluster on this host reaches the job,
the job's exit code is the launcher's, SIGTERM stops everything, and no Ray process the launch started
survives it. Also `connect_ray` starting (and stopping) its own local Ray when there is no cluster, and
(real Slurm) forming a 2-node cluster inside an allocation that has none.

A stand-in job replaces `megatron-arpo train`: it loads the resolved config the launcher wrote, connects
with `connect_ray` (RAY_ADDRESS mode), reports the alive nodes and the PIDs of the launch's Ray
processes, and exits with the code it is given."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest
import yaml

from slurm_cluster import free_port_plan, slurm_cluster  # noqa: F401 (fixture)

REPO_ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.timeout(120)

STAND_IN_JOB = r'''
import glob, json, os, sys, time
import psutil
from megatron_arpo.config import load_config
from megatron_arpo.cluster.runtime import connect_ray

report_path, code = sys.argv[1], int(sys.argv[2])
wait_forever = len(sys.argv) > 3
run_dir = os.environ["MEGATRON_ARPO_RUN_DIR"]
cfg = load_config(os.path.join(run_dir, "config.yaml"))
conn = connect_ray(cfg)
import ray
nodes = [n for n in ray.nodes() if n["Alive"]]
temp_dirs = [json.load(open(p))["temp_dir"] for p in glob.glob(os.path.join(run_dir, "ray", "*", "node-*.json"))]
ray_pids = [p.pid for p in psutil.process_iter(["cmdline"])
            if any(d in " ".join(p.info["cmdline"] or []) for d in temp_dirs)]
report = {"mode": conn.mode, "started": conn.started, "alive": len(nodes),
          "labels": sorted(n["Labels"].get("megatron-arpo/node-id", "?") for n in nodes),
          "temp_dirs": temp_dirs, "pids": {str(p): psutil.Process(p).create_time() for p in ray_pids + [os.getppid()]},
          "ray_address": os.environ.get("RAY_ADDRESS")}
conn.shutdown()
with open(report_path + ".tmp", "w") as fh:
    json.dump(report, fh)
os.replace(report_path + ".tmp", report_path)
print(f"stand-in job: {len(nodes)} nodes alive, exiting with {code}", flush=True)
while wait_forever:
    time.sleep(0.2)
sys.exit(code)
'''


def _config(tmp_path: Path, pinned: bool = True) -> Path:
    # Pinned: a random free block (fixed ports). Otherwise the default: blocks derived from the job id.
    ports = free_port_plan(num_nodes=2, ports_per_node=40) if pinned else {"ray_ports_per_node": 40}
    cfg = {"name": "launch-local-test", "model": {"config": "tiny-qwen3"}, "rollout": {"response_length": 512},
           "data": {"max_prompt_tokens": 256}, "tools": {"search": {"enabled": False}},
           "trainer": {"run_dir": str(tmp_path / "run")},
           "launcher": {"gpus_per_node": 0, "num_cpus": 1, "object_store_memory": 80 * 1024 * 1024,
                        "ready_timeout": 60, "job_name": "ll", **ports}}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def _launch_cmd(config: Path, job: Path, report: Path, code: int, nodes: int, *extra: str) -> list[str]:
    command = " ".join([sys.executable, str(job), str(report), str(code), *extra])
    return [sys.executable, "-m", "megatron_arpo", "launch", "local", "--config", str(config),
            "--nodes", str(nodes), "--command", command]


def _env() -> dict:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env["PYTHONPATH"] = str(REPO_ROOT)
    return env


def _still_running(pids: dict) -> list[int]:
    alive = []
    for pid, created in pids.items():
        try:
            proc = psutil.Process(int(pid))
            if proc.create_time() == created and proc.status() != psutil.STATUS_ZOMBIE:
                alive.append(int(pid))
        except psutil.NoSuchProcess:
            pass
    return alive


def _naming(temp_dirs: list[str]) -> list[int]:
    return [p.pid for p in psutil.process_iter(["cmdline"])
            if any(d in " ".join(p.info["cmdline"] or []) for d in temp_dirs)]


def test_launch_local_runs_job_on_cluster_propagates_exit_code_and_cleans_up(tmp_path):
    # One launch (each starts a 2-node Ray cluster): a non-zero code, on the default per-job port blocks;
    # test_sigterm_stops_job_and_cluster launches on a pinned port plan.
    nodes, code = 2, 3
    config, job, report = _config(tmp_path, pinned=False), tmp_path / "job.py", tmp_path / "report.json"
    job.write_text(STAND_IN_JOB)
    result = subprocess.run(_launch_cmd(config, job, report, code, nodes), env=_env(), capture_output=True,
                            text=True, timeout=100)
    out = result.stdout + result.stderr
    assert result.returncode == code, out
    data = json.loads(report.read_text())
    assert data["mode"] == "address" and data["started"] == [], data  # joined, started nothing itself
    assert data["alive"] == nodes, out
    assert data["labels"] == [str(k) for k in range(nodes)]
    # The job printed through the launcher to the console and to node 0's log in the run dir.
    assert f"stand-in job: {nodes} nodes alive, exiting with {code}" in result.stdout
    run_dir = tmp_path / "run"
    logs = list((run_dir / "logs").glob("ll-local*-node0.out"))
    assert len(logs) == 1 and "stand-in job" in logs[0].read_text()
    assert yaml.safe_load((run_dir / "config.yaml").read_text())["launcher"]["job_name"] == "ll"
    # Every Ray process of the launch (and the head's bootstrap process) is gone.
    assert len(data["temp_dirs"]) == nodes and len(data["pids"]) > nodes
    assert _still_running(data["pids"]) == [], out
    assert _naming(data["temp_dirs"]) == []
    # Derived per-job blocks inside the default range, one per node, disjoint.
    infos = [json.loads(p.read_text()) for p in (run_dir / "ray").glob("*/node-*.json")]
    blocks = sorted((i["node_manager_port"], i["max_worker_port"]) for i in infos)
    assert len(blocks) == nodes and blocks[0][1] < blocks[1][0], blocks
    assert all(20000 <= lo and hi <= 32000 for lo, hi in blocks)
    # Ray's session logs were copied to the run dir when the nodes stopped.
    copied = list((run_dir / "logs" / "ray").glob("*/node0/raylet.out"))
    assert copied and copied[0].stat().st_size > 0, out


def test_sigterm_stops_job_and_cluster(tmp_path):
    config, job, report = _config(tmp_path), tmp_path / "job.py", tmp_path / "report.json"
    job.write_text(STAND_IN_JOB)
    proc = subprocess.Popen(_launch_cmd(config, job, report, 0, 1, "wait"), env=_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 90
        while not report.exists():
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "the stand-in job never reported"
            time.sleep(0.2)
        proc.send_signal(signal.SIGTERM)
        out, _ = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    data = json.loads(report.read_text())
    # The job died of the forwarded SIGTERM; the launcher reports it the shell's way.
    assert proc.returncode == 128 + signal.SIGTERM, out
    assert "stopping the job and the local Ray cluster" in out
    assert _still_running(data["pids"]) == [], out
    assert _naming(data["temp_dirs"]) == []


def test_connect_ray_without_cluster_starts_and_stops_a_local_instance(tmp_path):
    script = r'''
import json, sys
import psutil
from megatron_arpo.config import build_config
from megatron_arpo.cluster.runtime import connect_ray
cfg = build_config({"model": {"config": "tiny-qwen3"}, "rollout": {"response_length": 512},
                    "data": {"max_prompt_tokens": 256}, "tools": {"search": {"enabled": False}},
                    "trainer": {"run_dir": sys.argv[1]},
                    "launcher": {"gpus_per_node": 0, "num_cpus": 1, "object_store_memory": 83886080}})
conn = connect_ray(cfg)
import ray
temp_dir = conn._temp_dir
pids = {p.pid: p.create_time() for p in psutil.process_iter(["cmdline"])
        if temp_dir in " ".join(p.info["cmdline"] or [])}
info = {"mode": conn.mode, "alive": conn.num_nodes, "cpus": ray.cluster_resources().get("CPU"),
        "temp_dir": temp_dir, "pids": pids}
conn.shutdown()
print(json.dumps(info))
'''
    env = {k: v for k, v in _env().items() if not k.startswith("SLURM_")}
    result = subprocess.run([sys.executable, "-c", script, str(tmp_path / "run")], env=env, capture_output=True,
                            text=True, timeout=100)
    assert result.returncode == 0, result.stderr
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info["mode"] == "local" and info["alive"] == 1 and info["cpus"] == 1.0
    assert info["pids"], "the local instance's processes name its private temp dir"
    assert _still_running(info["pids"]) == []
    assert not Path(info["temp_dir"]).exists()


CONNECT_IN_ALLOCATION = r"""
import json, os, sys
import psutil
from megatron_arpo.config import build_config
from megatron_arpo.cluster.runtime import connect_ray
report, run_dir, ports = sys.argv[1], sys.argv[2], json.loads(sys.argv[3])
cfg = build_config({"model": {"config": "tiny-qwen3"}, "rollout": {"response_length": 512},
                    "data": {"max_prompt_tokens": 256}, "tools": {"search": {"enabled": False}},
                    "trainer": {"run_dir": run_dir},
                    "launcher": {"nodes": 2, "gpus_per_node": 0, "num_cpus": 1, "network_interface": "lo",
                                 "object_store_memory": 83886080, "ready_timeout": 60, **ports}})
conn = connect_ray(cfg)
import ray
nodes = [n for n in ray.nodes() if n["Alive"]]
step = conn._step
temp_dirs = [json.load(open(step.handshake_dir / f"node-{k}.json"))["temp_dir"] for k in (0, 1)]
pids = {p.pid: p.create_time() for p in psutil.process_iter(["cmdline"])
        if any(d in " ".join(p.info["cmdline"] or []) for d in temp_dirs)}
info = {"mode": conn.mode, "alive": len(nodes), "job_id": step.job_id, "temp_dirs": temp_dirs, "pids": pids,
        "labels": sorted(n["Labels"].get("megatron-arpo/node-id", "?") for n in nodes)}
conn.shutdown()
info["left"] = [p.pid for p in psutil.process_iter(["cmdline"])
                if any(d in " ".join(p.info["cmdline"] or []) for d in temp_dirs)]
info["srun_code"] = step.proc.returncode
with open(report, "w") as fh:
    json.dump(info, fh)
"""


@pytest.mark.slow  # 14-23 s here, with the Slurm job's own scheduling
@pytest.mark.timeout(200)
def test_connect_ray_forms_a_cluster_inside_a_slurm_allocation(slurm_cluster, tmp_path):
    from launchers.slurm import submit
    from slurm_cluster import job_env

    driver, report, run_dir = tmp_path / "driver.py", tmp_path / "report.json", tmp_path / "run"
    driver.write_text(CONNECT_IN_ALLOCATION)
    ports = json.dumps(free_port_plan(num_nodes=2, ports_per_node=40))
    script = "\n".join([
        "#!/bin/bash", "#SBATCH --job-name=ma-connect", "#SBATCH --nodes=2", "#SBATCH --ntasks-per-node=1",
        "#SBATCH --time=00:04:00", f"#SBATCH --output={run_dir}/logs/%x-%j.out",
        # the trainer runs in the batch script, on the allocation's first node, with no Ray around
        f"exec {sys.executable} {driver} {report} {run_dir} '{ports}'", ""])
    env = {k: v for k, v in job_env().items() if k != "RAY_ADDRESS"}
    job_id = submit(script, run_dir, "ma-connect", env=env)
    info = slurm_cluster.wait_job(job_id, timeout=170)
    logs = "\n".join(f"==== {p}\n{p.read_text()[-3000:]}" for p in sorted((run_dir / "logs").glob("*")) if p.is_file())
    assert info["JobState"] == "COMPLETED", logs
    data = json.loads(report.read_text())
    assert data["mode"] == "slurm" and data["job_id"] == job_id, data
    assert data["alive"] == 2 and data["labels"] == ["0", "1"], logs
    # shutdown() released the step: both nodes stopped their Ray processes and srun ended cleanly.
    assert data["left"] == [] and data["srun_code"] == 0, logs
    assert _still_running(data["pids"]) == []
    assert (run_dir / "ray" / f"{job_id}.0" / "done").exists()
    # Each node's Ray session logs were copied into the run dir (logs/ray/<job>.<restart>/node<k>).
    assert all((run_dir / "logs" / "ray" / f"{job_id}.0" / f"node{k}" / "raylet.out").is_file() for k in (0, 1)), logs
