"""Pytest fixtures for real local Ray clusters (import the fixtures into a test module).

- ``ray_two_nodes`` (module scope): the driver connected to a 2-node Ray cluster made of two raylets on
  this host, started with the ``ray`` CLI (``ray start --head`` plus ``ray start --address=...``), each
  with its own temp dir and its own node-manager/object-manager/agent/worker ports, all on 127.0.0.1.
  The raylet processes live for the whole session (``_ray_two_node_cluster``), so several modules share
  one cluster; each module connects and disconnects its driver. Yields the ``LocalRayCluster``.
- ``ray_single_node`` (module scope): ``ray.init`` of a private 1-node cluster (2 CPUs, 256 MB object
  store, its own temp dir), shut down after the module.

Every node advertises ``--num-cpus 2`` and a 256 MB object store, the dashboard is off, usage stats
are off, and ``RAY_AUTH_MODE`` is pinned (default ``disabled``) for raylets and driver alike. Ports are
picked from blocks that are free right now so tests never collide with other Ray users of the machine.
Teardown stops exactly what was started: the ``ray start --block`` process groups this module created
(SIGTERM, then SIGKILL after a short grace), then any process still naming one of its temp dirs —
never ``ray stop``, which would kill every raylet on a shared host.
"""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

import psutil
import pytest

logger = logging.getLogger(__name__)

NODE_IP = "127.0.0.1"
NUM_CPUS_PER_NODE = 2
OBJECT_STORE_BYTES = 256 * 1024 * 1024
NODE_LABEL = "megatron-arpo-test/node"
# Per node: 6 service ports + a worker port range.
_SERVICE_PORTS = ("node-manager-port", "object-manager-port", "metrics-export-port",
                  "dashboard-agent-listen-port", "dashboard-agent-grpc-port", "runtime-env-agent-port")
_WORKER_PORTS = 40
_PORTS_PER_NODE = 10 + _WORKER_PORTS


def _port_free(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("0.0.0.0", port))
        except OSError:
            return False
    return True


def free_port_block(span: int, lo: int = 20000) -> int:
    """Base of a block [base, base + span) whose every port is free now (TIME_WAIT counts as taken).

    The block lies below the kernel's ephemeral range (``net.ipv4.ip_local_port_range``), as the
    launcher's default ``ray_port_range`` does: a port inside that range that is free when the block is
    picked can be taken by any outgoing connection before Ray binds it (CI saw exactly that).
    """
    from megatron_arpo.cluster.ports import ephemeral_overlap

    overlap = ephemeral_overlap(lo, 65535)
    top = min(overlap[0] if overlap else 32768, 32768)
    rng = random.Random()
    for _ in range(200):
        base = rng.randrange(lo, top - span, 10)
        if all(_port_free(p) for p in range(base, base + span)):
            return base
    raise RuntimeError(f"no free block of {span} ports found in {lo}-{top}")


def _ray_cli() -> str:
    path = Path(sys.executable).with_name("ray")
    if not path.exists():
        raise RuntimeError(f"ray_cluster: the ray CLI is not next to {sys.executable}; install ray in this venv")
    return str(path)


def _pin_auth_mode() -> None:
    """Decide Ray's auth mode explicitly, for the raylets and the driver alike.

    With ``RAY_AUTH_MODE`` unset, Ray turns token auth on whenever ``~/.ray/auth_token`` exists, and any
    Ray user of the machine may create that file at any moment; a cluster started before it appeared
    then rejects a driver that connects after ("Authentication token is missing or incorrect").
    """
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"


def _env() -> dict[str, str]:
    _pin_auth_mode()
    return dict(os.environ)


@dataclass
class LocalRayCluster:
    """Raylets on this host forming one Ray cluster; ``start()``/``stop()`` manage exactly its processes."""

    num_nodes: int = 2
    num_cpus: int = NUM_CPUS_PER_NODE
    object_store_bytes: int = OBJECT_STORE_BYTES
    startup_timeout: float = 90.0
    port_base: int = 0
    temp_dirs: list[str] = field(default_factory=list)
    procs: list[subprocess.Popen] = field(default_factory=list)
    log_dir: Path | None = None

    @property
    def gcs_port(self) -> int:
        return self.port_base

    @property
    def address(self) -> str:
        return f"{NODE_IP}:{self.gcs_port}"

    def node_command(self, node: int) -> list[str]:
        block = self.port_base + 10 + node * _PORTS_PER_NODE
        cmd = [_ray_cli(), "start", "--block", "--disable-usage-stats", f"--node-ip-address={NODE_IP}",
               f"--temp-dir={self.temp_dirs[node]}", f"--num-cpus={self.num_cpus}", "--num-gpus=0",
               f"--object-store-memory={self.object_store_bytes}", f"--labels={NODE_LABEL}={node}"]
        if node == 0:
            cmd += ["--head", f"--port={self.gcs_port}", f"--ray-client-server-port={self.port_base + 1}",
                    "--include-dashboard=false"]
        else:
            cmd += [f"--address={self.address}"]
        cmd += [f"--{name}={block + i}" for i, name in enumerate(_SERVICE_PORTS)]
        cmd += [f"--min-worker-port={block + 10}", f"--max-worker-port={block + 10 + _WORKER_PORTS - 1}"]
        return cmd

    def start(self) -> "LocalRayCluster":
        self.port_base = free_port_block(10 + self.num_nodes * _PORTS_PER_NODE)
        # Short temp dirs: Ray's unix socket paths under them must stay below 107 bytes.
        self.temp_dirs = [tempfile.mkdtemp(prefix=f"rc{node}-", dir="/tmp") for node in range(self.num_nodes)]
        self.log_dir = Path(tempfile.mkdtemp(prefix="ray-cluster-logs-"))
        try:
            for node in range(self.num_nodes):
                self._start_node(node)
                if node == 0:
                    self._wait_for_port(self.gcs_port, node)
        except BaseException:
            self.stop()
            raise
        return self

    def _start_node(self, node: int) -> None:
        log = open(self.log_dir / f"node{node}.log", "wb")
        proc = subprocess.Popen(self.node_command(node), stdout=log, stderr=subprocess.STDOUT, env=_env(),
                                start_new_session=True)
        log.close()
        self.procs.append(proc)

    def _wait_for_port(self, port: int, node: int) -> None:
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self.procs[node].poll() is not None:
                raise RuntimeError(f"ray_cluster: node {node} exited with {self.procs[node].returncode} before its "
                                   f"port {port} opened; see {self.log_dir / f'node{node}.log'}\n{self.node_log(node)}")
            try:
                with socket.create_connection((NODE_IP, port), timeout=0.5):
                    return
            except OSError:
                time.sleep(0.2)
        raise TimeoutError(f"ray_cluster: node {node} did not open port {port} within {self.startup_timeout} s; "
                           f"see {self.log_dir / f'node{node}.log'}")

    def node_log(self, node: int, tail: int = 3000) -> str:
        try:
            return (self.log_dir / f"node{node}.log").read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def wait_for_nodes(self) -> list[dict]:
        """With the driver connected: wait until all raylets are alive; return their ``ray.nodes()`` rows."""
        import ray

        deadline = time.monotonic() + self.startup_timeout
        while True:
            alive = [n for n in ray.nodes() if n["Alive"]]
            if len(alive) >= self.num_nodes:
                return alive
            dead = [i for i, p in enumerate(self.procs) if p.poll() is not None]
            if dead or time.monotonic() > deadline:
                logs = "\n".join(f"--- node {i}:\n{self.node_log(i)}" for i in range(self.num_nodes))
                raise RuntimeError(f"ray_cluster: {len(alive)} of {self.num_nodes} nodes alive "
                                   f"(exited: {dead}); logs in {self.log_dir}\n{logs}")
            time.sleep(0.3)

    def wait_until_idle(self, timeout: float = 60.0) -> None:
        """With the driver connected: wait until every CPU of the cluster is free again. Actors of the
        previous test die asynchronously after its driver disconnects; a placement group made before they
        are gone lands where they are not (a SPREAD group then packs onto one raylet)."""
        import ray

        deadline = time.monotonic() + timeout
        while True:
            total = ray.cluster_resources().get("CPU", 0.0)
            free = ray.available_resources().get("CPU", 0.0)
            if free >= total > 0:
                return
            if time.monotonic() > deadline:
                raise RuntimeError(f"ray_cluster: only {free:g} of {total:g} CPUs free {timeout:g} s after the "
                                   f"previous test ended; a test leaked an actor or a placement group "
                                   f"(logs in {self.log_dir})")
            time.sleep(0.2)

    def own_processes(self) -> list[psutil.Process]:
        """Processes of this cluster: anything whose command line names one of its temp dirs."""
        found = []
        for proc in psutil.process_iter(["pid", "cmdline"]):
            cmdline = " ".join(proc.info["cmdline"] or [])
            if any(d in cmdline for d in self.temp_dirs):
                found.append(proc)
        return found

    def stop(self, grace: float = 3.0) -> None:
        # `ray start --block` takes a minute to stop gracefully here (a worker raylet keeps retrying the
        # GCS that went away first), so give SIGTERM a short grace and then SIGKILL the process groups
        # this cluster created. Nothing it leaves in /dev/shm survives: plasma files are unlinked.
        groups = [proc.pid for proc in self.procs if proc.poll() is None]
        for signum in (signal.SIGTERM, signal.SIGKILL):
            for pgid in groups:
                try:
                    os.killpg(pgid, signum)
                except ProcessLookupError:
                    pass
            deadline = time.monotonic() + grace
            while time.monotonic() < deadline and any(proc.poll() is None for proc in self.procs):
                time.sleep(0.1)
        for proc in self.procs:
            proc.wait(timeout=10)
        leftovers = [p for p in self.own_processes() if p.pid != os.getpid()]
        for p in leftovers:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(leftovers, timeout=10)
        self.procs.clear()
        for d in [*self.temp_dirs, self.log_dir]:
            if d:
                shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def _ray_two_node_cluster():
    cluster = LocalRayCluster(num_nodes=2).start()
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="module")
def ray_two_nodes(_ray_two_node_cluster):
    import ray

    if ray.is_initialized():
        raise RuntimeError("ray_two_nodes: a Ray driver is already connected in this process; a module may use "
                           "only one Ray fixture")
    _pin_auth_mode()
    # _node_ip_address: the driver attaches to a raylet on 127.0.0.1 rather than the host's public IP.
    ray.init(address=_ray_two_node_cluster.address, _node_ip_address=NODE_IP, logging_level=logging.WARNING,
             log_to_driver=True)
    try:
        _ray_two_node_cluster.wait_for_nodes()
        _ray_two_node_cluster.wait_until_idle()
        yield _ray_two_node_cluster
    finally:
        ray.shutdown()


@pytest.fixture(scope="module")
def ray_single_node():
    import ray

    if ray.is_initialized():
        raise RuntimeError("ray_single_node: a Ray driver is already connected in this process; a module may use "
                           "only one Ray fixture")
    temp_dir = tempfile.mkdtemp(prefix="rs-", dir="/tmp")
    _pin_auth_mode()
    ray.init(num_cpus=NUM_CPUS_PER_NODE, num_gpus=0, object_store_memory=OBJECT_STORE_BYTES,
             include_dashboard=False, _temp_dir=temp_dir, _node_ip_address=NODE_IP,
             logging_level=logging.WARNING)
    try:
        yield
    finally:
        ray.shutdown()
        shutil.rmtree(temp_dir, ignore_errors=True)
