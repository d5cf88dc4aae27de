"""Ray bootstrap pieces that need no Ray: port plan, node options from Slurm's environment, NIC choice,
the `ray start` command line, atomic handshake files, and the missing-node report."""

from __future__ import annotations

import json
import os
import socket
import threading
from pathlib import Path

import pytest

from megatron_arpo.cluster.bootstrap import (NODE_LABEL, NodeOptions, PortPlan, alive_node_ids,
                                             build_node_env, missing_nodes_message, ray_start_command,
                                             select_interface, write_json_atomic)
from support.slurm_local import ensure_hosts_entry


def test_pinned_port_plan_gives_every_node_a_disjoint_block():
    plan = PortPlan(gcs_port=6379, node_port_base=20000, ports_per_node=200)
    blocks = [plan.node_ports(k) for k in range(4)]
    assert blocks[1]["node_manager_port"] == 20200 and blocks[3]["object_manager_port"] == 20601
    assert blocks[0]["gcs_port"] == 6379 and "gcs_port" not in blocks[1]
    used = [set(range(b["node_manager_port"], b["max_worker_port"] + 1)) for b in blocks]
    assert all(not (used[i] & used[j]) for i in range(4) for j in range(i + 1, 4))
    assert all(len(set(b.values())) == len(b) for b in blocks)
    with pytest.raises(ValueError, match="falls inside the per-node block 20000-20199"):
        PortPlan(gcs_port=20005, node_port_base=20000).node_ports(0)
    with pytest.raises(ValueError, match="> 65535"):
        PortPlan(node_port_base=65000).node_ports(10)


def _block(ports: dict) -> set[int]:
    return set(range(ports["node_manager_port"], ports["max_worker_port"] + 1))


def test_derived_ports_differ_per_job_and_per_node_and_hold_the_head_services():
    plan = PortPlan(ports_per_node=100, port_range=(20000, 21999))  # 20 blocks: 10 slots of 2 nodes
    always_free = lambda ports: True  # noqa: E731
    jobs = {job: [plan.choose(job, k, 2, always_free) for k in range(2)] for job in ("4711", "4712", "4713")}
    blocks = [_block(p) for nodes in jobs.values() for p in nodes]
    assert all(not (a & b) for i, a in enumerate(blocks) for b in blocks[i + 1:])  # no two nodes share a port
    head = jobs["4711"][0]
    # Slot 4711 mod 10 = 1: node 0 takes block 2 of the range, node 1 block 3.
    assert head["node_manager_port"] == 20200 and jobs["4711"][1]["node_manager_port"] == 20300
    assert (head["gcs_port"], head["client_server_port"], head["min_worker_port"]) == (20206, 20207, 20210)
    assert "gcs_port" not in jobs["4711"][1]
    assert plan.choose("4711", 0, 2, always_free) == head  # deterministic: a requeued job gets the same
    assert plan.choose("local123", 0, 2, always_free) == plan.choose("local123", 0, 2, always_free)


def test_derived_ports_skip_busy_blocks_and_fail_naming_the_range():
    plan = PortPlan(ports_per_node=100, port_range=(20000, 20599))  # 6 blocks: 3 slots of 2 nodes
    busy = set(range(20200, 20300))  # node 0's first choice for job 1 (slot 1)

    def free(ports):
        return not busy & set(ports)

    node0, node1 = plan.choose("1", 0, 2, free), plan.choose("1", 1, 2, free)
    assert node0["node_manager_port"] == 20400  # next slot, same position: cannot meet node 1
    assert node1["node_manager_port"] == 20300 and not _block(node0) & _block(node1)
    with pytest.raises(RuntimeError, match="all 3 candidate port blocks of launcher.ray_port_range 20000-20599"):
        plan.choose("1", 0, 2, lambda ports: False)
    with pytest.raises(ValueError, match="holds 6 blocks of 100 ports, but a 8-node job needs 8"):
        plan.choose("1", 0, 8, free)
    with pytest.raises(RuntimeError, match="pinned block 30000-30099"):
        PortPlan(ports_per_node=100, node_port_base=30000).choose("1", 0, 2, lambda ports: False)


def test_free_check_sees_a_real_listener():
    plan = PortPlan(ports_per_node=40, port_range=(41000, 42199))
    first = plan.choose("99", 0, 1)
    squatter = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    squatter.bind(("127.0.0.1", first["max_worker_port"]))
    squatter.listen(1)
    try:
        moved = plan.choose("99", 0, 1)
    finally:
        squatter.close()
    assert moved["node_manager_port"] != first["node_manager_port"]
    assert first["max_worker_port"] not in _block(moved)


def test_node_options_from_slurm_environment_and_short_temp_dirs(tmp_path):
    env = {"SLURM_NNODES": "4", "SLURM_NODEID": "2", "SLURM_JOB_ID": "9876", "SLURM_RESTART_COUNT": "1"}
    opts = NodeOptions.from_slurm_env(tmp_path, env)
    assert (opts.num_nodes, opts.node_id, opts.job_id, opts.restart_count) == (4, 2, "9876", 1)
    assert opts.temp_dir == "/tmp/ma-9876-2"
    # A requeued job never reads its previous incarnation's head address.
    assert opts.head_file == tmp_path / "ray" / "9876.1" / "head.json"
    with pytest.raises(ValueError, match="unix socket limit"):
        NodeOptions.from_slurm_env(tmp_path, env, temp_root="/tmp/" + "x" * 40)
    with pytest.raises(ValueError, match="node id 4 is outside 0..3"):
        NodeOptions.from_slurm_env(tmp_path, {**env, "SLURM_NODEID": "4"})


def test_interface_selection_order_and_env_exported_before_ray_start(tmp_path):
    assert select_interface("lo", {}) == ("lo", "127.0.0.1")
    assert select_interface(None, {"NCCL_SOCKET_IFNAME": "^docker0,lo"}) == ("lo", "127.0.0.1")
    assert select_interface(None, {"GLOO_SOCKET_IFNAME": "lo"}) == ("lo", "127.0.0.1")
    with pytest.raises(ValueError, match="'nosuch0', which has no IPv4 address.*interfaces here"):
        select_interface("nosuch0", {})
    opts = NodeOptions(run_dir=tmp_path, num_nodes=2, node_id=1, job_id="5", interface="lo",
                       env={"NCCL_DEBUG": "WARN"})
    env, ip = build_node_env(opts, {"NCCL_SOCKET_IFNAME": "eth9", "PATH": "/bin"})
    assert ip == "127.0.0.1"
    # An explicit launcher.network_interface wins over what the environment had.
    assert env["NCCL_SOCKET_IFNAME"] == env["GLOO_SOCKET_IFNAME"] == "lo"
    assert env["NCCL_DEBUG"] == "WARN" and env["MEGATRON_ARPO_NODE_ID"] == "1"
    # Without one, a user's NCCL list is left alone.
    opts.interface = None
    env, _ = build_node_env(opts, {"NCCL_SOCKET_IFNAME": "lo,eth0"})
    assert env["NCCL_SOCKET_IFNAME"] == "lo,eth0" and env["GLOO_SOCKET_IFNAME"] == "lo"


def test_ray_start_command_for_head_and_worker(tmp_path):
    plan = PortPlan(gcs_port=7000, client_server_port=7001, node_port_base=30000, ports_per_node=50)
    head = NodeOptions(run_dir=tmp_path, num_nodes=2, node_id=0, job_id="3", ports=plan, num_cpus=4,
                       object_store_memory=10**9)
    cmd = ray_start_command(head, "10.0.0.1", ray_executable="ray")
    assert cmd[:3] == ["ray", "start", "--block"]
    for arg in ("--head", "--port=7000", "--ray-client-server-port=7001", "--include-dashboard=false",
                "--node-ip-address=10.0.0.1", "--temp-dir=/tmp/ma-3-0", f"--labels={NODE_LABEL}=0",
                "--node-manager-port=30000", "--object-manager-port=30001", "--min-worker-port=30010",
                "--max-worker-port=30049", "--num-cpus=4", "--object-store-memory=1000000000"):
        assert arg in cmd
    worker = NodeOptions(run_dir=tmp_path, num_nodes=2, node_id=1, job_id="3", ports=plan)
    cmd = ray_start_command(worker, "10.0.0.2", head_address="10.0.0.1:7000", ray_executable="ray")
    assert "--address=10.0.0.1:7000" in cmd and "--head" not in cmd
    assert "--node-manager-port=30050" in cmd and "--temp-dir=/tmp/ma-3-1" in cmd


def test_atomic_json_write_is_never_seen_half_written(tmp_path):
    path = tmp_path / "hs" / "head.json"
    payload = {"address": "1.2.3.4:6379", "pad": "x" * 200_000}
    seen, stop = [], threading.Event()

    def reader():
        while not stop.is_set():
            if path.exists():
                seen.append(json.loads(path.read_text())["address"])

    t = threading.Thread(target=reader)
    t.start()
    for _ in range(20):
        write_json_atomic(path, payload)
    stop.set()
    t.join()
    assert seen and set(seen) == {"1.2.3.4:6379"}
    assert [p.name for p in path.parent.iterdir()] == ["head.json"]


def test_missing_node_report_names_node_port_and_logs(tmp_path):
    opts = NodeOptions(run_dir=tmp_path, num_nodes=3, node_id=0, job_id="77",
                       ports=PortPlan(node_port_base=40000, ports_per_node=100),
                       node_log_template=str(tmp_path / "logs" / "j-77-node{node_id}.out"))
    nodes = [{"Alive": True, "Labels": {NODE_LABEL: "0"}}, {"Alive": False, "Labels": {NODE_LABEL: "1"}},
             {"Alive": True, "Labels": {NODE_LABEL: "2"}}, {"Alive": True, "Labels": {}}]
    present = alive_node_ids(nodes)
    assert set(present) == {0, 2}
    write_json_atomic(opts.node_file(1), {"node_id": 1})
    msg = missing_nodes_message(opts, set(present), 12.0)
    assert "2/3 nodes after 12 s" in msg
    assert "node 1 (node-manager port 40100, started its raylet)" in msg
    assert str(tmp_path / "logs" / "j-77-node1.out") in msg and "/tmp/ma-77-1/session_latest/logs" in msg
    assert "node 0" not in msg and "node 2" not in msg


def test_hosts_entry_is_appended_in_place_once(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n127.0.0.1 node1")
    inode = os.stat(hosts).st_ino
    assert ensure_hosts_entry(("node1", "node2"), str(hosts)) is True
    assert hosts.read_text() == "127.0.0.1 localhost\n127.0.0.1 node1\n127.0.0.1 node2\n"
    assert ensure_hosts_entry(("node1", "node2"), str(hosts)) is False
    assert os.stat(hosts).st_ino == inode  # same file: safe on a bind mount


def _fake_cgroup(tmp_path, cpu_max: dict[str, str]) -> tuple[Path, str]:
    root = tmp_path / "cgroup"
    for rel, value in cpu_max.items():
        (root / rel).mkdir(parents=True, exist_ok=True)
        (root / rel / "cpu.max").write_text(value + "\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("0::/slurm/uid_0/job_7/step_0\n")
    return root, str(proc)


def test_ray_gets_the_cpus_the_allocation_gives_not_the_hosts(tmp_path):
    from megatron_arpo.cluster.allocation import allocated_cpus

    host = len(os.sched_getaffinity(0))
    # A quota on the job's cgroup (not the step's) still applies: the tightest limit up the tree wins.
    root, proc = _fake_cgroup(tmp_path, {"slurm/uid_0/job_7": "100000 100000", "slurm/uid_0/job_7/step_0": "max 100000"})
    cpus, how = allocated_cpus({}, cgroup_root=root, proc_cgroup=proc)
    assert cpus == 1 and how.startswith("cgroup CPU quota") and f"CPU affinity {host}" in how
    root, proc = _fake_cgroup(tmp_path / "b", {"slurm": "max 100000"})
    cpus, how = allocated_cpus({"SLURM_CPUS_ON_NODE": "1"}, cgroup_root=root, proc_cgroup=proc)
    assert cpus == 1 and how.startswith("SLURM_CPUS_ON_NODE")
    # Slurm granting more than the task may use: the affinity mask decides.
    cpus, how = allocated_cpus({"SLURM_CPUS_ON_NODE": str(host + 64)}, cgroup_root=root, proc_cgroup=proc)
    assert cpus == host and how.startswith("CPU affinity")


def test_node_cpus_and_the_ray_start_line(tmp_path, monkeypatch, caplog):
    from megatron_arpo.cluster.bootstrap import node_cpus

    opts = NodeOptions(run_dir=tmp_path, num_nodes=1, node_id=0, job_id="5")
    assert node_cpus(opts, {"SLURM_CPUS_ON_NODE": "1"}) == 1
    ports = PortPlan(ports_per_node=50, port_range=(30000, 30999)).choose("5", 0, 1, lambda p: True)
    cmd = ray_start_command(opts, "10.0.0.1", ray_executable="ray", ports=ports, num_cpus=1)
    assert "--num-cpus=1" in cmd and f"--port={ports['gcs_port']}" in cmd
    assert f"--ray-client-server-port={ports['client_server_port']}" in cmd
    assert not any(arg.startswith("--gcs-port") for arg in cmd)  # not a `ray start` flag
    opts.num_cpus = 64  # an explicit launcher.num_cpus wins, with a warning when the allocation is smaller
    assert node_cpus(opts, {"SLURM_CPUS_ON_NODE": "2"}) == 64
    assert "exceeds the 2 CPUs this allocation gives" in caplog.text


def test_ray_session_logs_are_copied_to_the_run_dir_incrementally(tmp_path):
    from megatron_arpo.cluster.allocation import RayLogSync

    session = tmp_path / "ma-5-0" / "session_2025_01_01"
    (session / "logs" / "old").mkdir(parents=True)
    os.symlink(session, tmp_path / "ma-5-0" / "session_latest")
    (session / "logs" / "raylet.out").write_text("raylet up\n")
    (session / "logs" / "old" / "worker-1.err").write_text("boom\n")
    dest = tmp_path / "run" / "logs" / "ray" / "5.0" / "node0"
    sync = RayLogSync(tmp_path / "ma-5-0", dest, interval=0).start()
    assert sync.sync() == 2
    assert (dest / "old" / "worker-1.err").read_text() == "boom\n"
    assert sync.sync() == 0  # unchanged files are not copied again
    with open(session / "logs" / "raylet.out", "a") as fh:
        fh.write("more\n")
    assert sync.stop() == 1 and (dest / "raylet.out").read_text() == "raylet up\nmore\n"
    assert RayLogSync(tmp_path / "nothing-here", dest).stop() == 0  # a node whose Ray never started


def test_ports_inside_the_ephemeral_range_are_warned_about_pinned_or_derived(tmp_path, monkeypatch, caplog):
    import functools

    from megatron_arpo.cluster import bootstrap, ports

    proc = tmp_path / "ip_local_port_range"
    proc.write_text("32768\t60999\n")
    monkeypatch.setattr(ports, "ephemeral_overlap", functools.partial(ports.ephemeral_overlap, proc_file=str(proc)))
    caplog.set_level("WARNING", logger=bootstrap.logger.name)
    for plan, node in ((PortPlan(ports_per_node=40, node_port_base=20000), 1),
                       (PortPlan(port_range=(20000, 32000)), 0)):
        bootstrap._warn_ephemeral(plan, node)
    assert not caplog.records
    bootstrap._warn_ephemeral(PortPlan(ports_per_node=40, node_port_base=32700), 1)  # node 1: 32740-32779
    bootstrap._warn_ephemeral(PortPlan(ports_per_node=40, node_port_base=32700), 0)  # node 0: below 32768
    bootstrap._warn_ephemeral(PortPlan(port_range=(30000, 40000)), 0)
    messages = [r.getMessage() for r in caplog.records]
    assert len(messages) == 2, messages
    assert "node 1's Ray ports (32740-32779) inside this host's ephemeral port range 32768-60999" in messages[0]
    assert "launcher.ray_port_range 30000-40000 overlaps" in messages[1]
