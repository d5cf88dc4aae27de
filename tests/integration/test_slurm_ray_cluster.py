"""Real Slurm (2 slurmd "nodes" on this host) + real Ray: the rendered sbatch job forms a Ray cluster
across both nodes, runs the driver on the head, propagates its exit code, and fails clearly when a node
never joins."""

from __future__ import annotations

import json
import socket
import sys
from pathlib import Path

import pytest

from launchers.slurm import log_paths, render_sbatch, submit
from slurm_cluster import job_env, ray_ports, slurm_cluster  # noqa: F401 (fixtures)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]

DRIVER = r'''
import json, os, sys
import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

ray.init()
nodes = [n for n in ray.nodes() if n["Alive"]]

@ray.remote(num_cpus=0)
def where():
    return {"slurmd": os.environ.get("SLURMD_NODENAME"), "slurm_node_id": os.environ.get("SLURM_NODEID"),
            "ray_node_id": ray.get_runtime_context().get_node_id(),
            "nccl_ifname": os.environ.get("NCCL_SOCKET_IFNAME"),
            "gloo_ifname": os.environ.get("GLOO_SOCKET_IFNAME")}

tasks = [where.options(scheduling_strategy=NodeAffinitySchedulingStrategy(n["NodeID"], soft=False)).remote()
         for n in nodes]
report = {"nodes": [{"NodeID": n["NodeID"], "NodeManagerPort": n["NodeManagerPort"],
                     "ObjectManagerPort": n["ObjectManagerPort"], "Labels": n.get("Labels", {})}
                    for n in nodes],
          "tasks": ray.get(tasks)}
with open(sys.argv[1], "w") as fh:
    json.dump(report, fh)
sys.exit(int(sys.argv[2]))
'''


def _options(tmp_path: Path, ports: dict, **extra) -> dict:
    return {"nodes": 2, "gpus_per_node": 0, "time": "00:05:00", "run_dir": str(tmp_path / "run"),
            "python": sys.executable, "network_interface": "lo", "num_cpus": 1,
            "object_store_memory": 80 * 1024 * 1024, "ready_timeout": 60, "requeue": False,
            "signal_lead_seconds": 0, **ports, **extra}


def _submit(cluster, tmp_path: Path, opts: dict, command: list[str]) -> tuple[str, dict]:
    script = render_sbatch(opts, command=command)
    job_id = submit(script, opts["run_dir"], opts.get("job_name", "megatron-arpo"), env=job_env())
    return job_id, cluster.wait_job(job_id, timeout=150)


def _logs(opts: dict, job_id: str) -> str:
    from launchers.options import launcher_options

    out = []
    for path in log_paths(launcher_options(opts), job_id):
        text = Path(path).read_text() if Path(path).exists() else "<missing>"
        out.append(f"==== {path}\n{text[-4000:]}")
    return "\n".join(out)


def test_two_node_job_forms_ray_cluster_and_its_driver_exit_code_is_the_job_exit_code(slurm_cluster, ray_ports,
                                                                                      tmp_path):
    # The driver reports the cluster it saw, then exits 3: one job checks both (a job start costs a Ray
    # cluster); a job exiting 0 is COMPLETED in test_two_jobs_on_the_same_hosts_... below.
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    report = tmp_path / "report.json"
    opts = _options(tmp_path, ray_ports, job_name="ma-form")
    job_id, info = _submit(slurm_cluster, tmp_path, opts, [sys.executable, str(driver), str(report), "3"])
    logs = _logs(opts, job_id)
    assert info["JobState"] == "FAILED" and info["ExitCode"] == "3:0", logs
    run_dir = Path(opts["run_dir"])
    assert "job step exited with code 3" in (run_dir / "logs" / f"ma-form-{job_id}.out").read_text()
    data = json.loads(report.read_text())

    nodes = data["nodes"]
    assert len(nodes) == 2, logs
    assert sorted(n["Labels"]["megatron-arpo/node-id"] for n in nodes) == ["0", "1"]
    # Fixed port plan: node k's node manager sits at node_port_base + k * ports_per_node.
    expected_ports = {ray_ports["ray_node_port_base"] + k * ray_ports["ray_ports_per_node"] for k in (0, 1)}
    assert {n["NodeManagerPort"] for n in nodes} == expected_ports
    assert {n["ObjectManagerPort"] for n in nodes} == {p + 1 for p in expected_ports}

    # One task pinned to each Ray node ran inside that node's srun task (Slurm node name and id).
    by_ray_node = {t["ray_node_id"]: t for t in data["tasks"]}
    assert set(by_ray_node) == {n["NodeID"] for n in nodes}
    label_of = {n["NodeID"]: n["Labels"]["megatron-arpo/node-id"] for n in nodes}
    seen = {(label_of[rid], t["slurm_node_id"], t["slurmd"]) for rid, t in by_ray_node.items()}
    assert seen == {("0", "0", "node1"), ("1", "1", "node2")}
    # The NIC choice was exported before `ray start`, so Ray workers inherited it.
    assert all(t["nccl_ifname"] == "lo" and t["gloo_ifname"] == "lo" for t in data["tasks"])

    assert (run_dir / "ma-form.sbatch").exists()
    assert (run_dir / "logs" / f"ma-form-{job_id}-node0.out").exists()
    assert (run_dir / "logs" / f"ma-form-{job_id}-node1.out").exists()


def test_node_that_never_joins_fails_within_timeout_naming_it(slurm_cluster, ray_ports, tmp_path):
    # Node 1's object-manager port is taken, so its raylet cannot start and it never registers.
    blocked = ray_ports["ray_node_port_base"] + ray_ports["ray_ports_per_node"] + 1
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    squatter.bind(("0.0.0.0", blocked))
    squatter.listen(1)
    try:
        marker = tmp_path / "driver-ran"
        opts = _options(tmp_path, ray_ports, job_name="ma-bad", ready_timeout=15)  # the head waits this long
        job_id, info = _submit(slurm_cluster, tmp_path, opts,
                               [sys.executable, "-c", f"open({str(marker)!r}, 'w')"])
    finally:
        squatter.close()
    logs = _logs(opts, job_id)
    assert info["JobState"] == "FAILED", logs
    assert info["ExitCode"] != "0:0"
    assert not marker.exists(), "the driver must not run on an incomplete cluster"
    head_log = (Path(opts["run_dir"]) / "logs" / f"ma-bad-{job_id}-node0.out").read_text()
    assert "1/2 nodes" in head_log, logs
    assert "node 1 (node-manager port" in head_log
    assert f"ma-bad-{job_id}-node1.out" in head_log  # names the log to check


SHARED_DRIVER = r'''
import json, os, sys, time
import ray

report, mine, other = sys.argv[1], sys.argv[2], sys.argv[3]
ray.init()
nodes = [n for n in ray.nodes() if n["Alive"]]
open(mine, "w").close()
deadline = time.monotonic() + 90
while not os.path.exists(other):  # both drivers run at the same time, or this job fails
    if time.monotonic() > deadline:
        sys.exit(5)
    time.sleep(0.2)
with open(report, "w") as fh:
    json.dump({"nodes": [{"NodeManagerPort": n["NodeManagerPort"], "ObjectManagerPort": n["ObjectManagerPort"],
                          "CPU": n["Resources"].get("CPU"), "Labels": n.get("Labels", {})} for n in nodes],
               "gcs": os.environ["RAY_ADDRESS"]}, fh)
'''


def test_two_jobs_on_the_same_hosts_get_their_own_ports_and_the_cpus_they_asked_for(slurm_cluster, tmp_path):
    """Two 2-node jobs packed onto the same two slurmd "nodes" (one host) at the same time: default per-job
    ports, no collision; each raylet advertises the 1 CPU its job holds (not the host's 2); Ray's session
    logs end up in each run dir."""
    driver = tmp_path / "driver.py"
    driver.write_text(SHARED_DRIVER)
    jobs = {}
    for name, other in (("ma-share-a", "ma-share-b"), ("ma-share-b", "ma-share-a")):
        opts = {"nodes": 2, "gpus_per_node": 0, "time": "00:05:00", "run_dir": str(tmp_path / name),
                "python": sys.executable, "network_interface": "lo", "object_store_memory": 80 * 1024 * 1024,
                "ready_timeout": 90, "requeue": False, "signal_lead_seconds": 0, "job_name": name,
                "exclusive": False, "cpus_per_task": 1, "memory_per_node": "400M", "ray_ports_per_node": 40}
        command = [sys.executable, str(driver), str(tmp_path / f"{name}.json"), str(tmp_path / f"started-{name}"),
                   str(tmp_path / f"started-{other}")]
        script = render_sbatch(opts, command=command)
        assert "#SBATCH --exclusive" not in script and "#SBATCH --cpus-per-task=1" in script
        jobs[name] = (opts, submit(script, opts["run_dir"], name, env=job_env()))
    reports, blocks = {}, []
    for name, (opts, job_id) in jobs.items():
        info = slurm_cluster.wait_job(job_id, timeout=170)
        logs = _logs(opts, job_id)
        assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", logs
        reports[name] = json.loads((tmp_path / f"{name}.json").read_text())
        handshake = Path(opts["run_dir"]) / "ray" / f"{job_id}.0"
        for k in (0, 1):
            node = json.loads((handshake / f"node-{k}.json").read_text())
            assert node["num_cpus"] == 1, node  # SLURM_CPUS_ON_NODE, not the host's CPUs
            assert 20000 <= node["node_manager_port"] and node["max_worker_port"] <= 32000  # the default range
            block = set(range(node["node_manager_port"], node["max_worker_port"] + 1))
            block |= {node[key] for key in ("gcs_port", "client_server_port") if key in node}
            blocks.append(block)
            # Ray's own session logs of every node are in the run dir, not only in node-local /tmp.
            copied = Path(opts["run_dir"]) / "logs" / "ray" / f"{job_id}.0" / f"node{k}" / "raylet.out"
            assert copied.is_file() and copied.stat().st_size > 0, logs
    for name, report in reports.items():
        assert len(report["nodes"]) == 2 and all(n["CPU"] == 1.0 for n in report["nodes"]), report
    assert reports["ma-share-a"]["gcs"] != reports["ma-share-b"]["gcs"]
    assert all(not (a & b) for i, a in enumerate(blocks) for b in blocks[i + 1:])  # no port used twice
