"""Ray ports for one node of one job: a block derived from the job id, checked free before ``ray start``.

Every Ray node of a job needs a block of ``ports_per_node`` consecutive ports (layout below). Fixed
ports break as soon as two jobs share a host — two small jobs packed onto one node, or the "nodes" of the
local test cluster — so by default each job derives its blocks from its Slurm job id:

- ``port_range = (lo, hi)`` holds ``(hi - lo + 1) // ports_per_node`` blocks, grouped into *slots* of
  ``num_nodes`` consecutive blocks (one per node of the job). Job ``j`` starts at slot ``j mod slots``,
  and node ``k`` takes block ``k`` of the slot. Jobs with consecutive ids therefore land in different
  slots, and the nodes of one job never share a block even when they share a host.
- Before ``ray start``, every port of the block is test-bound (``ports_free``). A busy block moves the
  node to the same block of the next slot (so nodes of one job still cannot meet), until a free one is
  found or every slot was tried (an error naming the range and the fix).
- The default range, 20000-32000, sits below Linux's default ephemeral range (32768-60999), where the
  kernel picks ports for outgoing connections; ``ephemeral_overlap`` lets the bootstrap warn about a
  configured range that reaches into it.

A *pinned* plan (``node_port_base`` set) gives node ``k`` the block ``node_port_base + k*ports_per_node``
with no derivation: for sites whose firewall opens fixed ports. The head's GCS and Ray-client ports sit
inside the head's block unless ``gcs_port``/``client_server_port`` pin them.

Block layout: +0 node manager, +1 object manager, +2 metrics export, +3 dashboard agent HTTP, +4
dashboard agent gRPC, +5 runtime-env agent, +6 GCS (head), +7 Ray client server (head), +10 ..
+ports_per_node-1 Ray worker ports.

The free check and ``ray start`` are not atomic: two jobs starting on one host in the same instant, with
colliding derived blocks, could both see the block free. Consecutive job ids never collide; anything
else needs ids that are a multiple of the slot count apart *and* simultaneous starts.
"""

from __future__ import annotations

import socket
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

DEFAULT_PORT_RANGE = (20000, 32000)
SERVICE_PORTS = 10  # +0 .. +9 of a block; Ray workers use the rest
GCS_OFFSET, CLIENT_SERVER_OFFSET = 6, 7


def parse_port_range(text: str, key: str = "launcher.ray_port_range") -> tuple[int, int]:
    """``"20000-32000"`` -> ``(20000, 32000)``; ValueError naming ``key`` otherwise."""
    parts = str(text).replace(" ", "").split("-")
    if len(parts) != 2 or not all(p.isdigit() for p in parts):
        raise ValueError(f"{key}: {text!r} is not a port range; allowed: LO-HI, e.g. 20000-32000")
    lo, hi = int(parts[0]), int(parts[1])
    if not 1024 <= lo < hi <= 65535:
        raise ValueError(f"{key}: {text!r} must satisfy 1024 <= LO < HI <= 65535")
    return lo, hi


def job_number(job_id: str) -> int:
    """A number for a job id: the Slurm id itself when numeric, else a stable hash (``local123``, ``77-1``)."""
    text = str(job_id)
    return int(text) if text.isdigit() else zlib.crc32(text.encode())


def ports_free(ports: list[int], host: str = "0.0.0.0") -> bool:
    """True when every port can be bound right now (SO_REUSEADDR, so TIME_WAIT leftovers do not count)."""
    for port in ports:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((host, port))
            except OSError:
                return False
    return True


def ephemeral_overlap(lo: int, hi: int, proc_file: str = "/proc/sys/net/ipv4/ip_local_port_range") -> tuple[int, int] | None:
    """The kernel's ephemeral port range when ``lo..hi`` overlaps it, else None."""
    try:
        e_lo, e_hi = (int(x) for x in Path(proc_file).read_text().split())
    except (OSError, ValueError):
        return None
    return (e_lo, e_hi) if lo <= e_hi and e_lo <= hi else None


@dataclass(frozen=True)
class PortPlan:
    """Where node ``k`` of a job takes its ports (see the module docstring)."""

    ports_per_node: int = 200
    port_range: tuple[int, int] = DEFAULT_PORT_RANGE
    node_port_base: int | None = None
    gcs_port: int | None = None
    client_server_port: int | None = None

    def __post_init__(self) -> None:
        if self.ports_per_node < SERVICE_PORTS + 10:
            raise ValueError(f"launcher.ray_ports_per_node must be >= {SERVICE_PORTS + 10} ({SERVICE_PORTS} service "
                             f"ports + workers), got {self.ports_per_node}")
        lo, hi = self.port_range
        if not 1024 <= lo < hi <= 65535:
            raise ValueError(f"launcher.ray_port_range {lo}-{hi} must satisfy 1024 <= LO < HI <= 65535")
        for name in ("gcs_port", "client_server_port", "node_port_base"):
            value = getattr(self, name)
            if value is not None and not 1024 <= value <= 65535:
                raise ValueError(f"port plan: {name}={value} must be in 1024..65535")
        if self.gcs_port is not None and self.gcs_port == self.client_server_port:
            raise ValueError(f"port plan: gcs_port and client_server_port are both {self.gcs_port}")

    @property
    def pinned(self) -> bool:
        return self.node_port_base is not None

    def layout(self, base: int, head: bool) -> dict[str, int]:
        """The ports of the block starting at ``base`` (the head also gets ``gcs_port``/``client_server_port``)."""
        top = base + self.ports_per_node - 1
        if top > 65535:
            raise ValueError(f"port plan: a block at {base} needs ports up to {top} > 65535; lower "
                             f"launcher.ray_node_port_base or launcher.ray_ports_per_node")
        ports = {"node_manager_port": base, "object_manager_port": base + 1, "metrics_export_port": base + 2,
                 "dashboard_agent_listen_port": base + 3, "dashboard_agent_grpc_port": base + 4,
                 "runtime_env_agent_port": base + 5, "min_worker_port": base + SERVICE_PORTS,
                 "max_worker_port": top}
        if head:
            for key, pinned, offset in (("gcs_port", self.gcs_port, GCS_OFFSET),
                                        ("client_server_port", self.client_server_port, CLIENT_SERVER_OFFSET)):
                if pinned is not None and base <= pinned <= top:
                    raise ValueError(f"port plan: {key} {pinned} falls inside the per-node block {base}-{top}; "
                                     f"move launcher.ray_{key.replace('_port', '')}_port or the block")
                ports[key] = base + offset if pinned is None else pinned
        return ports

    def node_ports(self, node_id: int) -> dict[str, int]:
        """The pinned plan's ports of node ``node_id`` (no free check)."""
        if self.node_port_base is None:
            raise ValueError("node_ports() needs a pinned plan (node_port_base); derived plans use choose()")
        return self.layout(self.node_port_base + node_id * self.ports_per_node, head=node_id == 0)

    def num_slots(self, num_nodes: int) -> int:
        lo, hi = self.port_range
        return (hi - lo + 1) // self.ports_per_node // max(num_nodes, 1)

    def candidate_bases(self, job_id: str, node_id: int, num_nodes: int) -> Iterator[int]:
        """Block starts for node ``node_id`` of job ``job_id``, most preferred first."""
        if self.node_port_base is not None:
            yield self.node_port_base + node_id * self.ports_per_node
            return
        slots = self.num_slots(num_nodes)
        lo, hi = self.port_range
        if slots < 1:
            raise ValueError(f"launcher.ray_port_range {lo}-{hi} holds {(hi - lo + 1) // self.ports_per_node} "
                             f"blocks of {self.ports_per_node} ports, but a {num_nodes}-node job needs {num_nodes}; "
                             f"widen the range or lower launcher.ray_ports_per_node")
        first = job_number(job_id) % slots
        for i in range(slots):
            slot = (first + i) % slots
            yield lo + (slot * num_nodes + node_id) * self.ports_per_node

    def choose(self, job_id: str, node_id: int, num_nodes: int,
               is_free: Callable[[list[int]], bool] = ports_free) -> dict[str, int]:
        """This node's ports: the first candidate block whose every port is free."""
        head = node_id == 0
        tried = []
        for base in self.candidate_bases(job_id, node_id, num_nodes):
            ports = self.layout(base, head)
            wanted = list(range(base, base + self.ports_per_node))
            wanted += [p for k, p in ports.items() if k in ("gcs_port", "client_server_port") and p not in wanted]
            if is_free(wanted):
                return ports
            tried.append(base)
        if self.node_port_base is not None:
            raise RuntimeError(f"node {node_id}: a port of the pinned block {tried[0]}-{tried[0] + self.ports_per_node - 1}"
                               f" (or the GCS/client port) is in use on {socket.gethostname()}; unset "
                               f"launcher.ray_node_port_base to derive free ports per job, or pick another base")
        lo, hi = self.port_range
        raise RuntimeError(f"node {node_id}: all {len(tried)} candidate port blocks of launcher.ray_port_range "
                           f"{lo}-{hi} have ports in use on {socket.gethostname()}; widen the range or lower "
                           f"launcher.ray_ports_per_node")
