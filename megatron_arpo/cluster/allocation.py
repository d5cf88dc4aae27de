"""What a Slurm job asks for and really gets on one node, and getting Ray's node-local logs back to the run dir.

``resource_problems(launcher)``: the ``launcher`` CPU/memory/exclusivity settings that would starve a node
(a shared node with no CPU count gets one CPU from Slurm; ``--mem=0`` on a shared node takes it all).

``allocated_cpus()``: Ray sizes its scheduler from ``--num-cpus`` or, without it, from every CPU of the
host. Inside a Slurm step the job may own far fewer (``--cpus-per-task``, a site's ``DefCpuPerGPU``, a
shared node), and then 8 actor ranks, 8 vLLM workers, the driver and the tool sandboxes would all be
scheduled as if they had the whole machine, with nothing warning about it. So the bootstrap starts Ray
with the smallest of what each layer grants:

- the CPU affinity mask of this process (Slurm's task/affinity and task/cgroup cpusets show up here),
- the cgroup CPU quota (cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us``; containers use these),
- ``SLURM_CPUS_ON_NODE`` (what Slurm allocated to the job on this node, enforced or not).

``RayLogSync``: Ray writes its session logs (raylet, GCS, every worker's stdout/stderr) under the node's
temp dir, which must be short and node-local (unix socket paths; see ``bootstrap``). A job that dies
takes them with its node-local ``/tmp``. The sync copies new and grown files to
``<run_dir>/logs/ray/<job>.<restart>/node<k>/`` every ``interval`` seconds and once more when the node
stops, so they survive the job on the shared filesystem.
"""

from __future__ import annotations

import logging
import math
import os
import re
import shutil
import threading
from pathlib import Path
from typing import Mapping

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
SLURM_SIZE = re.compile(r"^(\d+)([KMGT]?)$")  # a Slurm memory size: 480G, 400M, 2T; no suffix = MiB


def slurm_size_bytes(value: object) -> int | None:
    """Bytes of a Slurm memory size (``480G``, ``400M``, ``2T``; no suffix = MiB); None for anything else."""
    match = SLURM_SIZE.match(str(value)) if value is not None else None
    if not match:
        return None
    return int(match.group(1)) * 1024 ** ("KMGT".index(match.group(2) or "M") + 1)


def resource_problems(la) -> list[str]:
    """CPU/memory/exclusivity settings that would starve a node (shared by the config validation)."""
    problems = []
    if la.cpus_per_task is not None and (not isinstance(la.cpus_per_task, int) or la.cpus_per_task < 1):
        problems.append(f"launcher.cpus_per_task: got {la.cpus_per_task!r}; allowed: an integer >= 1 or null (all)")
    mem = la.memory_per_node
    if mem is not None and mem != "all" and not SLURM_SIZE.match(str(mem)):
        problems.append(f"launcher.memory_per_node: got {mem!r}; allowed: all, a Slurm size such as 480G, or null")
    if not la.exclusive:
        if la.cpus_per_task is None:
            problems.append("launcher.cpus_per_task: null means every CPU of the node, which needs "
                            "launcher.exclusive: true; on shared nodes give a number (otherwise Slurm gives the task "
                            "one CPU)")
        if mem == "all":
            problems.append("launcher.memory_per_node: 'all' (--mem=0) takes the whole node's memory, which needs "
                            "launcher.exclusive: true; on shared nodes give a size such as 200G")
    return problems


def _cgroup_paths(proc_cgroup: str = "/proc/self/cgroup") -> dict[str, str]:
    """Controller (``""`` for the v2 unified hierarchy) -> this process's cgroup path."""
    out: dict[str, str] = {}
    try:
        lines = Path(proc_cgroup).read_text().splitlines()
    except OSError:
        return out
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(",") if parts[1] else [""]:
                out[controller] = parts[2]
    return out


def _ancestors(root: Path, rel: str) -> list[Path]:
    """``root/rel`` and every parent up to ``root`` (a limit anywhere above applies too)."""
    path = root / rel.lstrip("/")
    chain = [path]
    while path != root and root in path.parents:
        path = path.parent
        chain.append(path)
    return chain


def cgroup_cpu_limit(cgroup_root: Path = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> float | None:
    """The tightest CPU quota (in CPUs) over this process's cgroup and its parents, or None."""
    paths = _cgroup_paths(proc_cgroup)
    limits: list[float] = []
    if "" in paths:  # cgroup v2: "max 100000" or "<quota> <period>"
        for directory in _ancestors(cgroup_root, paths[""]):
            try:
                quota, period = (directory / "cpu.max").read_text().split()
            except (OSError, ValueError):
                continue
            if quota != "max" and int(period) > 0:
                limits.append(int(quota) / int(period))
    for controller in ("cpu", "cpu,cpuacct"):
        if controller not in paths:
            continue
        for base in (cgroup_root / "cpu", cgroup_root / "cpu,cpuacct"):
            for directory in _ancestors(base, paths[controller]):
                try:
                    quota = int((directory / "cpu.cfs_quota_us").read_text())
                    period = int((directory / "cpu.cfs_period_us").read_text())
                except (OSError, ValueError):
                    continue
                if quota > 0 and period > 0:
                    limits.append(quota / period)
    return min(limits) if limits else None


def allocated_cpus(environ: Mapping[str, str] | None = None, cgroup_root: Path = CGROUP_ROOT,
                   proc_cgroup: str = "/proc/self/cgroup") -> tuple[int, str]:
    """``(cpus, how)``: the CPUs this node's job may use, and which limit decided it."""
    environ = os.environ if environ is None else environ
    found: list[tuple[int, str]] = []
    try:
        found.append((len(os.sched_getaffinity(0)), "CPU affinity"))
    except (AttributeError, OSError):
        found.append((os.cpu_count() or 1, "os.cpu_count"))
    quota = cgroup_cpu_limit(cgroup_root, proc_cgroup)
    if quota is not None:
        found.append((max(1, math.floor(quota)), "cgroup CPU quota"))
    slurm = (environ.get("SLURM_CPUS_ON_NODE") or "").strip()
    if slurm.isdigit() and int(slurm) > 0:
        found.append((int(slurm), "SLURM_CPUS_ON_NODE"))
    cpus, source = min(found, key=lambda item: item[0])
    return cpus, f"{source} ({', '.join(f'{name} {n}' for n, name in found)})"


def _sync_tree(src: Path, dst: Path) -> int:
    """Copy files of ``src`` that are new or changed (size/mtime) to ``dst``; returns how many were copied."""
    copied = 0
    for root, _dirs, files in os.walk(src):
        rel = Path(root).relative_to(src)
        for name in files:
            source = Path(root) / name
            target = dst / rel / name
            try:
                st = source.stat()
                if target.exists():
                    tt = target.stat()
                    if tt.st_size == st.st_size and tt.st_mtime >= st.st_mtime:
                        continue
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(source, target)
                copied += 1
            except OSError:  # a file rotated or removed while we copy: the next pass gets it
                continue
    return copied


class RayLogSync:
    """Copy ``<temp_dir>/session_latest/logs`` to ``dest`` periodically and at ``stop()``."""

    def __init__(self, temp_dir: str | os.PathLike, dest: str | os.PathLike, interval: float = 60.0):
        self.source = Path(temp_dir) / "session_latest" / "logs"
        self.dest = Path(dest)
        self.interval = float(interval)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sync(self) -> int:
        if not self.source.is_dir():
            return 0
        try:
            return _sync_tree(self.source.resolve(), self.dest)
        except OSError as exc:
            logger.warning("copying Ray logs %s -> %s failed: %s", self.source, self.dest, exc)
            return 0

    def start(self) -> "RayLogSync":
        if self.interval > 0:
            self._thread = threading.Thread(target=self._run, name="ray-log-sync", daemon=True)
            self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.sync()

    def stop(self) -> int:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=self.interval + 5)
        copied = self.sync()
        logger.info("Ray session logs copied to %s", self.dest)
        return copied
