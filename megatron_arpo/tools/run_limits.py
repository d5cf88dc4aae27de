"""Limits on one python-tool run as a whole: a memory cgroup where one can be had, and a usage meter.

What bounds a run (containment.py sets the rlimits):

| resource  | run-wide, enforced by the kernel                     | run-wide, enforced by the meter | per process        |
|-----------|------------------------------------------------------|---------------------------------|--------------------|
| processes | RLIMIT_NPROC in the run's own user namespace; pids.max (cgroup v2) | -                  | -                  |
| memory    | memory cgroup (v2 `memory.max`, or v1 `memory.limit_in_bytes` as root) | anonymous + shmem PSS of all its processes, their open memfds, scratch tmpfs usage and files | RLIMIT_AS |
| CPU time  | -                                                    | user+system time of all its processes | RLIMIT_CPU   |
| disk      | size of the scratch tmpfs (/tmp), plus 16 MiB /dev/shm | files in them (`MAX_SCRATCH_FILES`) | RLIMIT_FSIZE, RLIMIT_NOFILE |

The meter (`sample_usage`) walks the run's process tree through /proc every `METER_INTERVAL_S` and the
tool stops the run once the total is over the limit; so without a cgroup, memory is bounded run-wide
only to within one sampling interval (and per process always by RLIMIT_AS). CPU time has no kernel
run-wide limit in any configuration (a cgroup's cpu.max limits a rate, not a total), so the meter is
the run-wide bound there, with RLIMIT_CPU per process as a hard backstop.

Cgroups (`find_cgroup_parent`): a run gets its own child cgroup under
- `cgroup_parent` when configured: a cgroup v2 directory this user may write, with `memory` in its
  `cgroup.subtree_control` (e.g. a systemd unit with `Delegate=yes`; see docs/sandbox.md);
- otherwise the trainer's own cgroup v2 when it already delegates `memory` to children;
- otherwise, as root on a cgroup v1 (hybrid) host, a child of the trainer's own v1 memory cgroup.
The child is always nested under what the trainer is given, so every outer limit still applies. It
is created before the run starts; bwrap's PID 1 is moved into it while bwrap waits on `--block-fd`, so
nothing of the run ever executes outside it. After the run every task left in it is killed (v2
`cgroup.kill`, v1 each pid of `cgroup.procs`) and it is removed; leftovers of a killed trainer (named
`arpo-sbx-<pid>-<n>`) are removed at the next start.
"""

from __future__ import annotations

import asyncio
import errno
import itertools
import logging
import os
import select
import signal
import time
from dataclasses import dataclass
from typing import Optional

logger = logging.getLogger(__name__)

METER_INTERVAL_S = 0.1
# Files (inodes) a run may have in its scratch tmpfs mounts at once: bwrap cannot pass `nr_inodes`, so
# the meter counts them, and charges each to the run's memory at about what the kernel spends on it.
MAX_SCRATCH_FILES = 65536
INODE_BYTES = 1024
_CLK_TCK = os.sysconf("SC_CLK_TCK")
_PREFIX = "arpo-sbx-"
_counter = itertools.count()


# ------------------------------------------------------------------------------------ meter
@dataclass
class Usage:
    cpu_s: float = 0.0
    memory_bytes: int = 0
    tasks: int = 0
    files: int = 0  # inodes in the run's scratch tmpfs mounts


def _children(pid: int) -> list[int]:
    out = []
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/children") as handle:
            out += [int(c) for c in handle.read().split()]
    return out


def _pss(pid: int) -> int:
    """Anonymous and shared (shmem: shared anonymous mmap, mapped memfd and tmpfs files) PSS. File-backed
    PSS is left out: the only files a run can map are the read-only interpreter and libraries."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as handle:
        for line in handle:
            if line.startswith(("Pss_Anon:", "Pss_Shmem:")):
                total += int(line.split()[1]) * 1024
    return total


def _memfd_bytes(pid: int, seen: set[int]) -> int:
    """Memory of the memfds `pid` holds open (counted once per file): unmapped ones are in no smaps."""
    total = 0
    directory = f"/proc/{pid}/fd"
    for fd in os.listdir(directory):
        try:
            if not os.readlink(f"{directory}/{fd}").startswith("/memfd:"):
                continue
            st = os.stat(f"{directory}/{fd}")
        except OSError:
            continue
        if st.st_ino not in seen:
            seen.add(st.st_ino)
            total += st.st_blocks * 512
    return total


def sample_usage(root_pid: int) -> Usage:
    """CPU seconds (own + reaped children), anonymous and shared PSS and open memfds of `root_pid` and
    all its descendants."""
    usage = Usage()
    stack = [root_pid]
    memfds: set[int] = set()
    while stack:
        pid = stack.pop()
        try:
            with open(f"/proc/{pid}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            # fields[0] is the state; utime, stime, cutime, cstime are fields 14-17 of stat(5)
            usage.cpu_s += sum(int(v) for v in fields[11:15]) / _CLK_TCK
            usage.tasks += int(fields[17])
            usage.memory_bytes += _pss(pid) + _memfd_bytes(pid, memfds)
            stack += _children(pid)
        except (OSError, ValueError, IndexError):
            continue  # exited meanwhile (or a zombie without smaps): its time moves to the parent
    return usage


# ------------------------------------------------------------------------------------ the run's init
class SandboxInit:
    """bwrap's init (PID 1 of a run), held through a pidfd: killing it ends the run's PID namespace and
    every process in it, and a pidfd never names a reused pid. `pid` is what `--json-status-fd` reports;
    it is taken only while it is still the child of the bwrap monitor `monitor_pid`."""

    def __init__(self, pid: int, monitor_pid: int):
        self.pid = pid
        try:
            self.fd = os.pidfd_open(pid)
        except OSError:  # exited and reaped already: the run is over
            self.fd = -1
            return
        try:
            with open(f"/proc/{pid}/stat") as handle:
                ppid = int(handle.read().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            ppid = -1
        if ppid != monitor_pid:  # gone already and its pid reused: nothing to hold
            self.close()

    def alive(self) -> bool:
        return self.fd >= 0 and not select.select([self.fd], [], [], 0)[0]

    def kill(self) -> None:
        if self.fd >= 0:
            try:
                signal.pidfd_send_signal(self.fd, signal.SIGKILL)
            except ProcessLookupError:
                pass

    async def wait(self, timeout_s: float) -> bool:
        """Until the init has exited, which the kernel signals only once its whole namespace is gone."""
        if not self.alive():
            return True
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        loop.add_reader(self.fd, lambda: done.done() or done.set_result(None))
        try:
            await asyncio.wait_for(done, timeout_s)
            return True
        except asyncio.TimeoutError:
            return False
        finally:
            loop.remove_reader(self.fd)

    def scratch_usage(self) -> tuple[int, int]:
        """(bytes, inodes) used in the run's /tmp and /dev/shm; (0, 0) before bwrap has set them up."""
        root = f"/proc/{self.pid}/root"
        used = inodes = 0
        try:
            if os.stat(root).st_dev == os.stat("/").st_dev:
                return 0, 0  # the sandbox's own root is not mounted yet
            for mount in ("tmp", "dev/shm"):
                st = os.statvfs(f"{root}/{mount}")
                used += (st.f_blocks - st.f_bfree) * st.f_frsize
                inodes += st.f_files - st.f_ffree
        except OSError:
            return 0, 0
        if not self.alive():  # the pid may have been reused meanwhile: these numbers are not the run's
            return 0, 0
        return used, inodes

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ------------------------------------------------------------------------------------ cgroups
def _own_cgroups() -> dict[str, str]:
    """controller (or '' for v2) -> path of this process's cgroup, from /proc/self/cgroup."""
    out = {}
    with open("/proc/self/cgroup") as handle:
        for line in handle:
            num, controllers, path = line.rstrip("\n").split(":", 2)
            if num == "0" and controllers == "":
                out[""] = path
            for name in controllers.split(","):
                if name:
                    out[name] = path
    return out


def _cgroup_mounts() -> list[tuple[str, str, str, set[str]]]:
    """(fstype, mount root, mount point, super options) of every cgroup/cgroup2 mount."""
    mounts = []
    with open("/proc/self/mountinfo") as handle:
        for line in handle:
            head, _, tail = line.partition(" - ")
            fields, rest = head.split(), tail.split()
            if rest and rest[0] in ("cgroup", "cgroup2"):
                mounts.append((rest[0], fields[3], fields[4], set(rest[2].split(",")) if len(rest) > 2 else set()))
    return mounts


def _below(mount_root: str, mount_point: str, path: str) -> Optional[str]:
    if mount_root != "/" and not (path == mount_root or path.startswith(mount_root + "/")):
        return None
    relative = path[len(mount_root):] if mount_root != "/" else path
    return os.path.normpath(os.path.join(mount_point, relative.lstrip("/")))


def _read(path: str) -> str:
    with open(path) as handle:
        return handle.read()


def _write(path: str, value: str) -> None:
    with open(path, "w") as handle:
        handle.write(value)


@dataclass(frozen=True)
class CgroupParent:
    """A directory under which per-run cgroups are created."""

    path: str
    version: int  # 1 or 2

    def describe(self) -> str:
        return f"cgroup v{self.version} under {self.path}"

    def create(self, memory_bytes: int, max_tasks: int) -> "RunCgroup":
        path = os.path.join(self.path, f"{_PREFIX}{os.getpid()}-{next(_counter)}")
        os.mkdir(path)
        try:
            if self.version == 2:
                _write(os.path.join(path, "memory.max"), str(memory_bytes))
                for name, value in (("memory.swap.max", "0"), ("pids.max", str(max_tasks))):
                    if os.path.exists(os.path.join(path, name)):
                        _write(os.path.join(path, name), value)
            else:
                _write(os.path.join(path, "memory.limit_in_bytes"), str(memory_bytes))
                if os.path.exists(os.path.join(path, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(path, "memory.memsw.limit_in_bytes"), str(memory_bytes))
        except OSError:
            _remove_dir(path)
            raise
        return RunCgroup(path, self.version)

    def sweep_stale(self) -> None:
        """Remove per-run cgroups left by trainers that were killed before they could clean up."""
        try:
            names = os.listdir(self.path)
        except OSError:
            return
        for name in names:
            if not name.startswith(_PREFIX):
                continue
            try:
                pid = int(name[len(_PREFIX):].split("-")[0])
                os.kill(pid, 0)
                continue  # its trainer still runs
            except ProcessLookupError:
                pass
            except (ValueError, PermissionError):
                continue
            _remove_dir(os.path.join(self.path, name), wait_s=0.0)


@dataclass
class RunCgroup:
    path: str
    version: int

    def add(self, pid: int) -> None:
        _write(os.path.join(self.path, "cgroup.procs"), str(pid))

    def oom_kills(self) -> int:
        name = "memory.events" if self.version == 2 else "memory.oom_control"
        try:
            for line in _read(os.path.join(self.path, name)).splitlines():
                key, _, value = line.partition(" ")
                if key == "oom_kill":
                    return int(value)
        except (OSError, ValueError):
            pass
        return 0

    def kill(self) -> None:
        """SIGKILL every task of the cgroup: v2 `cgroup.kill` (Linux 5.14+), else each pid of `cgroup.procs`."""
        if self.version == 2 and os.path.exists(os.path.join(self.path, "cgroup.kill")):
            try:
                _write(os.path.join(self.path, "cgroup.kill"), "1")
                return
            except OSError:
                pass
        for pid in self.pids():
            try:
                fd = os.pidfd_open(pid)
            except OSError:
                continue
            try:
                if pid in self.pids():  # still this cgroup's, so the pidfd names the run's task
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
            except OSError:
                pass
            finally:
                os.close(fd)

    def pids(self) -> list[int]:
        try:
            return [int(p) for p in _read(os.path.join(self.path, "cgroup.procs")).split()]
        except (OSError, ValueError):
            return []

    def remove(self) -> None:
        """Kill what is left in the cgroup until it is empty, then remove it."""
        deadline = time.monotonic() + 5.0
        while True:
            self.kill()
            if not self.pids() or time.monotonic() > deadline:
                break
            time.sleep(0.01)
        _remove_dir(self.path)


def _remove_dir(path: str, wait_s: float = 2.0) -> None:
    deadline = time.monotonic() + wait_s
    while True:
        try:
            os.rmdir(path)
            return
        except FileNotFoundError:
            return
        except OSError as exc:
            # EBUSY while the last processes of the run are still being reaped
            if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                logger.warning("python sandbox: could not remove cgroup %s: %s", path, exc)
                return
            time.sleep(0.01)


def _usable_v2(path: str) -> Optional[str]:
    """None when `path` can hold per-run memory cgroups, else why not."""
    try:
        controllers = _read(os.path.join(path, "cgroup.subtree_control")).split()
    except OSError as exc:
        return f"{path} is not a cgroup v2 directory ({exc.strerror})"
    if "memory" not in controllers:
        return f"{path}/cgroup.subtree_control does not enable the memory controller"
    if not os.access(path, os.W_OK) or not os.access(os.path.join(path, "cgroup.procs"), os.W_OK):
        return f"{path} is not writable by this user (it is not delegated)"
    return None


def find_cgroup_parent(configured: Optional[str]) -> tuple[Optional[CgroupParent], str]:
    """(parent, explanation): where per-run cgroups can be made, or None and why none can."""
    if configured:
        problem = _usable_v2(configured)
        if problem:
            return None, f"tools.python.cgroup_parent: {problem}"
        return CgroupParent(configured, 2), f"configured cgroup v2 {configured}"
    try:
        own = _own_cgroups()
        mounts = _cgroup_mounts()
    except OSError as exc:
        return None, f"cannot read this process's cgroups: {exc}"
    reasons = []
    if "" in own:
        for fstype, root, point, _ in mounts:
            if fstype == "cgroup2":
                path = _below(root, point, own[""])
                if path is None:
                    continue
                problem = _usable_v2(path)
                if problem is None:
                    return CgroupParent(path, 2), f"cgroup v2 {path}"
                reasons.append(problem)
    if "memory" in own:
        for fstype, root, point, options in mounts:
            if fstype == "cgroup" and "memory" in options:
                path = _below(root, point, own["memory"])
                if path is None:
                    continue
                if os.geteuid() == 0 and os.access(path, os.W_OK):
                    return CgroupParent(path, 1), f"cgroup v1 memory {path}"
                reasons.append(f"{path} (cgroup v1 memory) is writable only by root")
    if not reasons:
        reasons.append("no cgroup v1/v2 memory controller is mounted")
    return None, "; ".join(reasons)
