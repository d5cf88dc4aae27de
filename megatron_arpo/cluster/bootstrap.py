"""Form a Ray cluster across the nodes of a Slurm allocation, with a readiness handshake and no ``sleep``.

One process per node (an ``srun`` task, ``python -m launchers ray-node``) calls ``run_ray_node``:

- **Ports**: each node takes a block of ports derived from the job id and checked free
  (``megatron_arpo.cluster.ports.PortPlan``: node manager, object manager, metrics, dashboard agent,
  runtime-env agent, the head's GCS and Ray-client ports, a worker port range), so two jobs on one host
  and the "nodes" of the local test cluster never collide. A pinned plan (``launcher.ray_node_port_base``)
  keeps fixed ports for sites that need them. The dashboard is off.
- **CPUs**: Ray is started with ``--num-cpus`` = what the allocation really gives this node
  (``megatron_arpo.cluster.allocation.allocated_cpus``: affinity mask, cgroup quota, ``SLURM_CPUS_ON_NODE``)
  unless ``launcher.num_cpus`` says otherwise.
- **Temp dirs** are per node and short (``/tmp/ma-<jobid>-<nodeid>``): Ray puts unix sockets under it
  and a socket path is limited to 107 bytes.
- **NIC**: the interface comes from the launcher config, else ``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME``,
  else the default-route interface, else loopback. Its IPv4 is ``--node-ip-address``, and
  ``NCCL_SOCKET_IFNAME``/``GLOO_SOCKET_IFNAME`` are exported into the environment *before* ``ray start``
  so every Ray worker inherits them.
- **Handshake**: the head (node 0) runs ``ray start --head --block``, waits until its GCS and node-manager
  ports accept connections, then publishes its address by an atomic write (temp file + fsync + rename)
  to ``<run_dir>/ray/<jobid>.<restart>/head.json``. Workers poll for that file (timeout, error naming the
  file and the head's log), then ``ray start --address ... --block``. The head then waits, via
  ``ray.nodes()``, until all N nodes are alive; on timeout the error names each node that never
  registered and the logs to read. Only then does it run the driver command with ``RAY_ADDRESS`` set.
- **Lifetime and cleanup**: workers stay up until the head writes ``done`` (or the head's GCS stays
  unreachable), so ``srun`` tasks live exactly as long as the job needs them. Each node stops only the
  processes it started (the ``ray start`` process tree and processes naming its own temp dir) — never
  ``ray stop``, which would kill every raylet on a shared host.
- **Logs**: Ray's session logs live in the node-local temp dir; ``RayLogSync`` copies them to
  ``<run_dir>/logs/ray/<jobid>.<restart>/node<k>/`` every ``launcher.ray_log_sync_seconds`` and when the
  node stops.
- **Signals**: Ray's processes and the driver start with SIGUSR1 ignored (Slurm signals every process
  of a step, and USR1's default action is to exit); the trainer installs its own handler. Inside a
  Slurm step the driver receives the preemption notice from slurmstepd directly; outside Slurm the head
  forwards USR1 to it. SIGTERM is forwarded to the driver. The head's exit code is the driver's.

Slurm's ``SLURM_RESTART_COUNT`` is part of the handshake directory, so a requeued job never reads the
address its previous incarnation published.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import signal
import socket
import struct
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import psutil

from megatron_arpo.cluster.allocation import allocated_cpus
from megatron_arpo.cluster.launch_options import LauncherSection
from megatron_arpo.cluster.ports import DEFAULT_PORT_RANGE, parse_port_range
from megatron_arpo.fsutil import atomic_write
from megatron_arpo.cluster.ports import PortPlan  # noqa: F401  (re-exported)

logger = logging.getLogger(__name__)

# Ray places sockets at <temp_dir>/session_<date>_<time>_<micro>_<pid>/sockets/plasma_store (~70 bytes
# after the temp dir); the kernel limit for a unix socket path is 107 bytes.
RAY_SOCKET_SUFFIX_BYTES = 72
UNIX_SOCKET_PATH_MAX = 107
NODE_LABEL = "megatron-arpo/node-id"


@dataclass
class NodeOptions:
    """Everything one node's bootstrap needs; built from the launcher config and Slurm's environment.

    Settings that come from the ``launcher`` section take their defaults from it (``LauncherSection``).
    """

    run_dir: Path
    num_nodes: int
    node_id: int
    job_id: str
    restart_count: int = 0
    ports: PortPlan = field(default_factory=PortPlan)
    interface: str | None = None
    num_cpus: int | None = LauncherSection.num_cpus
    num_gpus: int | None = None
    object_store_memory: int | None = LauncherSection.object_store_memory
    ready_timeout: float = LauncherSection.ready_timeout
    # How long a worker keeps its raylet after the head's GCS became unreachable.
    head_lost_timeout: float = 60.0
    # How long this node's own `ray start` may take to open its ports (a loaded host can be slow).
    start_timeout: float = 180.0
    temp_root: str = LauncherSection.temp_root
    node_log_template: str = ""  # e.g. "<run_dir>/logs/job-123-node{node_id}.out"
    env: Mapping[str, str] = field(default_factory=dict)
    ray_log_root: str | None = None  # Ray session logs are copied under it; None = <run_dir>/logs/ray
    log_sync_seconds: float = 60.0  # 0 = copy them only when the node stops

    def __post_init__(self) -> None:
        self.run_dir = Path(self.run_dir)
        if not 0 <= self.node_id < self.num_nodes:
            raise ValueError(f"node id {self.node_id} is outside 0..{self.num_nodes - 1} "
                             f"(SLURM_NODEID / --node-id vs SLURM_NNODES / --num-nodes)")
        if len(self.temp_dir) + RAY_SOCKET_SUFFIX_BYTES > UNIX_SOCKET_PATH_MAX:
            raise ValueError(
                f"Ray temp dir {self.temp_dir!r} is {len(self.temp_dir)} bytes; Ray's socket paths under it "
                f"would exceed the {UNIX_SOCKET_PATH_MAX}-byte unix socket limit. Set launcher.ray_temp_root "
                f"to a short path such as /tmp")

    @property
    def temp_dir(self) -> str:
        return os.path.join(self.temp_root, f"ma-{self.job_id}-{self.node_id}")

    @property
    def handshake_dir(self) -> Path:
        return self.run_dir / "ray" / f"{self.job_id}.{self.restart_count}"

    @property
    def head_file(self) -> Path:
        return self.handshake_dir / "head.json"

    @property
    def done_file(self) -> Path:
        return self.handshake_dir / "done"

    def node_file(self, node_id: int) -> Path:
        return self.handshake_dir / f"node-{node_id}.json"

    def node_log(self, node_id: int) -> str:
        if self.node_log_template:
            return self.node_log_template.format(node_id=node_id)
        return f"the srun output of Slurm node {node_id}"

    def ray_log_dir(self, node_id: int) -> str:
        return os.path.join(self.temp_root, f"ma-{self.job_id}-{node_id}", "session_latest", "logs")

    def ray_log_copy(self, node_id: int) -> Path:
        """Where node ``node_id``'s Ray session logs are copied (shared filesystem)."""
        root = Path(self.ray_log_root) if self.ray_log_root else self.run_dir / "logs" / "ray"
        return root / f"{self.job_id}.{self.restart_count}" / f"node{node_id}"

    @classmethod
    def from_slurm_env(cls, run_dir: str | os.PathLike, environ: Mapping[str, str] | None = None,
                       **overrides) -> "NodeOptions":
        """Fill node id, node count, job id and restart count from ``SLURM_*`` variables."""
        environ = os.environ if environ is None else environ
        values = {
            "num_nodes": int(environ.get("SLURM_NNODES", environ.get("SLURM_JOB_NUM_NODES", "1"))),
            "node_id": int(environ.get("SLURM_NODEID", "0")),
            "job_id": environ.get("SLURM_JOB_ID", f"local{os.getpid()}"),
            "restart_count": int(environ.get("SLURM_RESTART_COUNT", "0") or 0),
        }
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(run_dir=Path(run_dir), **values)


# -- network interface --------------------------------------------------------------------------------

def interface_ipv4(name: str) -> str | None:
    """IPv4 address of interface ``name`` (SIOCGIFADDR ioctl), or None if it has none / does not exist."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        packed = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
    except OSError:
        return None
    finally:
        sock.close()
    return socket.inet_ntoa(packed[20:24])


def default_route_interface(route_table: str = "/proc/net/route") -> str | None:
    try:
        lines = Path(route_table).read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if len(fields) > 1 and fields[1] == "00000000":
            return fields[0]
    return None


def _first_ifname(value: str | None) -> str | None:
    """First concrete name of an NCCL-style interface list (``eth0,ib0``); exclusions (``^lo``) are skipped."""
    for item in (value or "").split(","):
        item = item.strip().lstrip("=")
        if item and not item.startswith("^"):
            return item
    return None


def select_interface(configured: str | None, environ: Mapping[str, str]) -> tuple[str, str]:
    """Pick the interface and its IPv4: config, then NCCL/GLOO env, then default route, then loopback."""
    candidates = [("launcher.network_interface", configured),
                  ("NCCL_SOCKET_IFNAME", _first_ifname(environ.get("NCCL_SOCKET_IFNAME"))),
                  ("GLOO_SOCKET_IFNAME", _first_ifname(environ.get("GLOO_SOCKET_IFNAME")))]
    for source, name in candidates:
        if name:
            ip = interface_ipv4(name)
            if ip is None:
                names = [n for _, n in socket.if_nameindex()]
                raise ValueError(f"{source} names interface {name!r}, which has no IPv4 address on "
                                 f"{socket.gethostname()}; interfaces here: {names}. Set "
                                 f"launcher.network_interface to one of them")
            return name, ip
    route_iface = default_route_interface()
    if route_iface and (ip := interface_ipv4(route_iface)):
        return route_iface, ip
    logger.warning("no network interface configured and no default route; using loopback (single host only)")
    return "lo", "127.0.0.1"


def build_node_env(opts: NodeOptions, environ: Mapping[str, str]) -> tuple[dict[str, str], str]:
    """The environment every process of this node starts with (exported before ``ray start``)."""
    env = dict(environ)
    env.update({k: str(v) for k, v in opts.env.items()})
    iface, ip = select_interface(opts.interface, env)
    if opts.interface or "NCCL_SOCKET_IFNAME" not in env:
        env["NCCL_SOCKET_IFNAME"] = iface
    if opts.interface or "GLOO_SOCKET_IFNAME" not in env:
        env["GLOO_SOCKET_IFNAME"] = iface
    env["RAY_USAGE_STATS_ENABLED"] = env.get("RAY_USAGE_STATS_ENABLED", "0")
    # With RAY_AUTH_MODE unset, Ray switches token auth on whenever ~/.ray/auth_token exists; if that file
    # appears between `ray start` and a driver connecting, the driver is rejected. Decide it once here
    # (set RAY_AUTH_MODE=token in launcher.env, with the token on a shared path, to use auth).
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env["MEGATRON_ARPO_NODE_IP"] = ip
    env["MEGATRON_ARPO_NODE_ID"] = str(opts.node_id)
    return env, ip


# -- ray start -----------------------------------------------------------------------------------------

def ray_start_command(opts: NodeOptions, node_ip: str, head_address: str | None = None,
                      ray_executable: str | None = None, ports: Mapping[str, int] | None = None,
                      num_cpus: int | None = None) -> list[str]:
    """``ray start ... --block`` for this node (head when ``head_address`` is None).

    ``ports`` is this node's block (``PortPlan.choose``; default: the pinned plan's), ``num_cpus`` the
    CPUs to advertise (default ``opts.num_cpus``; None lets Ray count the host's)."""
    ray = ray_executable or os.path.join(os.path.dirname(sys.executable), "ray")
    ports = dict(ports if ports is not None else opts.ports.node_ports(opts.node_id))
    gcs, client = ports.pop("gcs_port", None), ports.pop("client_server_port", None)
    cmd = [ray, "start", "--block", "--disable-usage-stats", f"--node-ip-address={node_ip}",
           f"--temp-dir={opts.temp_dir}", f"--labels={NODE_LABEL}={opts.node_id}"]
    if head_address is None:
        cmd += ["--head", f"--port={gcs}", f"--ray-client-server-port={client}", "--include-dashboard=false"]
    else:
        cmd += [f"--address={head_address}"]
    for key, value in ports.items():
        cmd.append(f"--{key.replace('_', '-')}={value}")
    num_cpus = opts.num_cpus if num_cpus is None else num_cpus
    if num_cpus is not None:
        cmd.append(f"--num-cpus={num_cpus}")
    if opts.num_gpus is not None:
        cmd.append(f"--num-gpus={opts.num_gpus}")
    if opts.object_store_memory is not None:
        cmd.append(f"--object-store-memory={opts.object_store_memory}")
    return cmd


def node_cpus(opts: NodeOptions, environ: Mapping[str, str]) -> int:
    """The CPUs this node's raylet advertises: ``launcher.num_cpus`` or what the allocation gives."""
    cpus, how = allocated_cpus(environ)
    if opts.num_cpus is None:
        logger.info("node %d: Ray gets %d CPUs, the allocation's: %s", opts.node_id, cpus, how)
        return cpus
    if opts.num_cpus > cpus:
        logger.warning("node %d: launcher.num_cpus=%d exceeds the %d CPUs this allocation gives (%s); Ray will "
                       "oversubscribe them", opts.node_id, opts.num_cpus, cpus, how)
    return opts.num_cpus


def port_open(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.2,
               abort: Callable[[], str | None] | None = None) -> bool:
    """Poll ``predicate`` until true or ``timeout``; ``abort`` returning a message raises RuntimeError."""
    deadline = time.monotonic() + timeout
    while True:
        if predicate():
            return True
        if abort is not None and (why := abort()):
            raise RuntimeError(why)
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)


def write_json_atomic(path: Path, data: Mapping) -> None:
    """Write JSON so readers see either nothing or the whole file (temp + fsync + rename)."""
    with atomic_write(path) as fh:
        json.dump(data, fh)


def _ignore_usr1() -> None:
    """preexec_fn: an ignored disposition survives exec, so the child (and its children) ignore USR1."""
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)


class RayNodeProcess:
    """One ``ray start --block`` process and everything under it; ``stop()`` ends exactly those."""

    def __init__(self, cmd: Sequence[str], env: Mapping[str, str], temp_dir: str, log_path: Path):
        self.cmd = list(cmd)
        self.temp_dir = temp_dir
        self.log_path = log_path
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "ab") as out:
            # Slurm delivers `scancel --signal` (and srun-forwarded signals) to every process of the step;
            # USR1's default action would kill the GCS and raylets, so they start with USR1 ignored.
            self.proc = subprocess.Popen(self.cmd, env=dict(env), stdout=out, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, preexec_fn=_ignore_usr1)
        logger.info("started %s (pid %d), log %s", " ".join(self.cmd[:4]), self.proc.pid, log_path)

    def exited(self) -> int | None:
        return self.proc.poll()

    def _ours(self) -> list:
        procs = {}
        try:
            root = psutil.Process(self.proc.pid)
            procs[root.pid] = root
            for child in root.children(recursive=True):
                procs[child.pid] = child
        except psutil.NoSuchProcess:
            pass
        # Ray processes that were re-parented still name our private temp dir on their command line.
        marker = self.temp_dir + os.sep
        for p in psutil.process_iter(["pid", "cmdline"]):
            cmdline = " ".join(p.info.get("cmdline") or [])
            if (marker in cmdline or cmdline.endswith(self.temp_dir)) and p.pid != os.getpid():
                procs.setdefault(p.pid, p)
        return list(procs.values())

    def stop(self, timeout: float = 5.0) -> None:
        victims = self._ours()
        if self.proc.poll() is None:
            # ray start handles SIGTERM by draining (up to 30 s) then stopping its children; the job is
            # over, so after `timeout` whatever is left of the tree is killed.
            self.proc.terminate()
        _, alive = psutil.wait_procs(victims, timeout=timeout)
        for p in alive:
            try:
                p.kill()
            except psutil.NoSuchProcess:
                pass
        psutil.wait_procs(alive, timeout=5)
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        logger.info("stopped ray node (pid %d and %d children)", self.proc.pid, len(victims) - 1)


# -- cluster readiness ---------------------------------------------------------------------------------

def wait_for_head(opts: NodeOptions) -> dict:
    """Poll for the head's address file; on timeout name the file and the head's logs."""
    def ready() -> bool:
        return opts.head_file.exists()

    if not wait_until(ready, opts.ready_timeout, interval=0.25):
        raise TimeoutError(
            f"node {opts.node_id}: the Ray head did not publish its address in {opts.ready_timeout:.0f} s: "
            f"{opts.head_file} never appeared. Check the head node's log {opts.node_log(0)} and its Ray "
            f"logs in {opts.ray_log_dir(0)}; launcher.ready_timeout sets this limit")
    return json.loads(opts.head_file.read_text())


def alive_node_ids(nodes: Sequence[Mapping]) -> dict[int, dict]:
    """Map our node id (from the node label) to the ``ray.nodes()`` entry of each alive node."""
    found: dict[int, dict] = {}
    for node in nodes:
        if not node.get("Alive"):
            continue
        label = (node.get("Labels") or {}).get(NODE_LABEL)
        if label is not None and str(label).isdigit():
            found[int(label)] = dict(node)
    return found


def missing_nodes_message(opts: NodeOptions, present: set[int], waited: float) -> str:
    missing = [k for k in range(opts.num_nodes) if k not in present]
    lines = [f"Ray cluster formed with {len(present)}/{opts.num_nodes} nodes after {waited:.0f} s; these "
             "Slurm nodes never registered:"]
    for k in missing:
        try:
            reported = json.loads(opts.node_file(k).read_text())
        except (OSError, ValueError):
            reported = None
        port = (reported or {}).get("node_manager_port")
        if port is None and opts.ports.pinned:
            port = opts.ports.node_ports(k)["node_manager_port"]
        started = "started its raylet" if reported is not None else "never reported its raylet up"
        where = f"node-manager port {port}, " if port is not None else ""
        lines.append(f"  node {k} ({where}{started}): check {opts.node_log(k)}, "
                     f"{opts.handshake_dir / f'ray-start-node{k}.log'} and {opts.ray_log_dir(k)}")
    lines.append("Common causes: the node cannot reach the head's GCS (wrong launcher.network_interface), "
                 "a port of the plan is taken, or the node's srun task failed before ray start. "
                 "launcher.ready_timeout sets this limit.")
    return "\n".join(lines)


def wait_for_nodes(address: str, opts: NodeOptions) -> dict[int, dict]:
    """Connect to the cluster and poll ``ray.nodes()`` until ``opts.num_nodes`` nodes are alive."""
    # deferred: pulls in ray (heavy; this module imports without it)
    import ray

    start = time.monotonic()
    ray.init(address=address, log_to_driver=False, logging_level=logging.WARNING,
             namespace="megatron-arpo-bootstrap")
    try:
        found: dict[int, dict] = {}

        def all_there() -> bool:
            nonlocal found
            found = alive_node_ids(ray.nodes())
            return len(found) >= opts.num_nodes

        if not wait_until(all_there, max(0.0, opts.ready_timeout - (time.monotonic() - start)), interval=0.5):
            raise TimeoutError(missing_nodes_message(opts, set(found), time.monotonic() - start))
        return found
    finally:
        ray.shutdown()


# -- the per-node entry point ----------------------------------------------------------------------------

class _Signals:
    """Record SIGTERM/SIGUSR1 and forward them to the driver process once it exists."""

    def __init__(self, forward_usr1: bool):
        self.target: subprocess.Popen | None = None
        self.terminated = False
        self.forward_usr1 = forward_usr1
        self.install()

    def install(self) -> None:
        """(Re)install the handlers; ``ray.init`` may replace SIGTERM/SIGINT handlers."""
        signal.signal(signal.SIGTERM, self._handle)
        signal.signal(signal.SIGINT, self._handle)
        signal.signal(signal.SIGUSR1, self._handle)

    def _handle(self, signum, _frame) -> None:
        if signum in (signal.SIGTERM, signal.SIGINT):
            self.terminated = True
        elif not self.forward_usr1:
            logger.info("SIGUSR1 received; not forwarded (inside a Slurm step it reaches every process, "
                        "the driver included, directly)")
            return
        if self.target is not None and self.target.poll() is None:
            logger.info("forwarding %s to the driver (pid %d)", signal.Signals(signum).name, self.target.pid)
            self.target.send_signal(signum)


def run_ray_node(opts: NodeOptions, command: Sequence[str] | None = None,
                 environ: Mapping[str, str] | None = None) -> int:
    """Bootstrap this node's part of the Ray cluster; on the head run ``command``. Returns the exit code."""
    env, node_ip = build_node_env(opts, os.environ if environ is None else environ)
    os.environ["RAY_AUTH_MODE"] = env["RAY_AUTH_MODE"]  # for this process's own ray.init (wait_for_nodes)
    is_head = opts.node_id == 0
    # slurmstepd delivers a step's signals to every process in it, so inside `srun` the driver already
    # gets USR1; forwarding it again would deliver it twice, and a second USR1 arriving while the
    # trainer's interpreter shuts down (handlers reset to default) kills it. Forward only outside Slurm.
    in_slurm_step = "SLURM_STEP_ID" in (os.environ if environ is None else environ)
    signals = _Signals(forward_usr1=is_head and not in_slurm_step)
    opts.handshake_dir.mkdir(parents=True, exist_ok=True)
    ray_log = opts.handshake_dir / f"ray-start-node{opts.node_id}.log"
    logger.info("node %d/%d of job %s (restart %d): ip %s via %s, temp dir %s", opts.node_id, opts.num_nodes,
                opts.job_id, opts.restart_count, node_ip, env["NCCL_SOCKET_IFNAME"], opts.temp_dir)
    node: RayNodeProcess | None = None
    log_sync = None
    try:
        head_address = None
        if not is_head:
            head_address = wait_for_head(opts)["address"]
        _warn_ephemeral(opts.ports, opts.node_id)
        ports = opts.ports.choose(opts.job_id, opts.node_id, opts.num_nodes)
        cpus = node_cpus(opts, os.environ if environ is None else environ)
        node = RayNodeProcess(ray_start_command(opts, node_ip, head_address, ports=ports, num_cpus=cpus), env,
                              opts.temp_dir, ray_log)
        from megatron_arpo.cluster.allocation import RayLogSync

        log_sync = RayLogSync(opts.temp_dir, opts.ray_log_copy(opts.node_id), opts.log_sync_seconds).start()
        need = [ports["node_manager_port"]] + ([ports["gcs_port"]] if is_head else [])

        def node_died() -> str | None:
            if node.exited() is not None:
                return (f"node {opts.node_id}: `ray start` exited with code {node.exited()} before the node "
                        f"was up; read {ray_log} and {opts.ray_log_dir(opts.node_id)}")
            if signals.terminated:
                return f"node {opts.node_id}: terminated while starting Ray"
            return None

        if not wait_until(lambda: all(port_open(node_ip, p) for p in need) or opts.done_file.exists(),
                          opts.start_timeout, abort=node_died):
            raise TimeoutError(f"node {opts.node_id}: Ray ports {need} on {node_ip} not listening after "
                               f"{opts.start_timeout:.0f} s; read {ray_log}")
        if not is_head and opts.done_file.exists():
            logger.error("node %d: the head gave up before this node's raylet came up; read %s",
                         opts.node_id, ray_log)
            return 1
        info = {"node_id": opts.node_id, "ip": node_ip, "temp_dir": opts.temp_dir, "ray_log": str(ray_log),
                "node_log": opts.node_log(opts.node_id), "num_cpus": cpus,
                "ray_session_logs": str(opts.ray_log_copy(opts.node_id)), **ports}
        write_json_atomic(opts.node_file(opts.node_id), info)
        if not is_head:
            return _serve_worker(opts, node, signals, head_address)
        address = f"{node_ip}:{ports['gcs_port']}"
        write_json_atomic(opts.head_file, {**info, "address": address})
        nodes = wait_for_nodes(address, opts)
        signals.install()
        logger.info("Ray cluster up: %d nodes (%s)", len(nodes), ", ".join(
            f"{k}:{n.get('NodeManagerAddress')}:{n.get('NodeManagerPort')}" for k, n in sorted(nodes.items())))
        if not command:
            return 0
        return _run_driver(command, {**env, "RAY_ADDRESS": address}, signals)
    finally:
        if is_head:
            # Tell the workers to leave, whatever happened here.
            write_json_atomic(opts.done_file, {"time": time.time()})
        if node is not None:
            node.stop()
        if log_sync is not None:
            log_sync.stop()


def _warn_ephemeral(plan: PortPlan, node_id: int = 0) -> None:
    """Warn when this node's Ray ports may lie in the kernel's ephemeral range, where any outgoing
    connection can take one between the free check and Ray's bind (seen on CI with a pinned block)."""
    # deferred: ephemeral_overlap is looked up per call, so a patch of its module takes effect
    from megatron_arpo.cluster.ports import ephemeral_overlap

    if plan.pinned:
        ports = list(plan.node_ports(node_id).values())
        overlap = ephemeral_overlap(min(ports), max(ports))
        if overlap:
            logger.warning("launcher.ray_node_port_base puts node %d's Ray ports (%d-%d) inside this host's "
                           "ephemeral port range %d-%d (net.ipv4.ip_local_port_range): outgoing connections "
                           "may take them; pin ports below %d or unset launcher.ray_node_port_base",
                           node_id, min(ports), max(ports), *overlap, overlap[0])
        return
    overlap = ephemeral_overlap(*plan.port_range)
    if overlap:
        logger.warning("launcher.ray_port_range %d-%d overlaps this host's ephemeral port range %d-%d "
                       "(net.ipv4.ip_local_port_range): outgoing connections may take Ray's ports; choose a "
                       "range below %d", *plan.port_range, *overlap, overlap[0])


def _run_driver(command: Sequence[str], env: Mapping[str, str], signals: _Signals) -> int:
    logger.info("running driver: %s", " ".join(command))
    # The driver starts with USR1 ignored (see _ignore_usr1) so an early preemption notice cannot kill it
    # before it installs its own handler; the trainer must install one at start-up, and set USR1 back to
    # SIG_IGN once it decided to stop (Python resets its handlers to the default at exit).
    proc = subprocess.Popen(list(command), env=dict(env), preexec_fn=_ignore_usr1)
    signals.target = proc
    code = proc.wait()
    logger.info("driver exited with code %d", code)
    # A driver killed by a signal reports -N; shells report 128+N.
    return code if code >= 0 else 128 - code


def _serve_worker(opts: NodeOptions, node: RayNodeProcess, signals: _Signals, head_address: str) -> int:
    """Keep this node's raylet up until the head says done, the head vanishes, or we are terminated."""
    host, port = head_address.rsplit(":", 1)
    head_lost_since: float | None = None
    while True:
        if opts.done_file.exists():
            logger.info("node %d: head finished; leaving", opts.node_id)
            return 0
        if signals.terminated:
            logger.info("node %d: terminated", opts.node_id)
            return 143
        if (code := node.exited()) is not None:
            logger.error("node %d: ray start exited with %s; read %s", opts.node_id, code, node.log_path)
            return 1
        if port_open(host, int(port)):
            head_lost_since = None
        elif head_lost_since is None:
            head_lost_since = time.monotonic()
        elif time.monotonic() - head_lost_since > opts.head_lost_timeout:
            logger.error("node %d: head GCS %s unreachable for %.0f s and no done file at %s; leaving",
                         opts.node_id, head_address, opts.head_lost_timeout, opts.done_file)
            return 1
        time.sleep(1.0)


def plan_from_launcher(launcher: Mapping) -> PortPlan:
    """The ``PortPlan`` of a launcher-config mapping (``ray_*`` keys of ``launchers.options.LauncherOptions``)."""
    text = launcher.get("ray_port_range")
    return PortPlan(ports_per_node=launcher.get("ray_ports_per_node", 200),
                    port_range=parse_port_range(text) if text else DEFAULT_PORT_RANGE,
                    node_port_base=launcher.get("ray_node_port_base"), gcs_port=launcher.get("ray_gcs_port"),
                    client_server_port=launcher.get("ray_client_server_port"))
