"""Containment of one python-tool run on bubblewrap (`bwrap`), and the plain fallback for `best_effort`.

Each run of model-written code is one fresh bubblewrap sandbox (bubblewrap is the namespace tool that
flatpak is built on; Debian package `bubblewrap`). What the run gets:

- namespaces: its own user, PID, mount, IPC, network, UTS and cgroup namespaces (`--unshare-all
  --unshare-user`); creating further user namespaces inside is disabled (`--disable-userns`); a new
  session (no terminal to inject into); `--die-with-parent`.
- filesystem: an empty tmpfs root holding read-only binds of the interpreter only: the executable, the
  entries of its `sys.path` that lie under its prefix (stdlib, lib-dynload, its own site-packages),
  its LIBDIR and `pyvenv.cfg`, plus the system library directories the dynamic loader needs (/usr/lib,
  /usr/lib64 and the /lib, /lib64 links). Then a fresh /proc of the run's own PID namespace, a minimal
  /dev, a size-capped tmpfs /tmp (the working directory and HOME) and a small /dev/shm. The project,
  data, checkpoints, tool cache, /home, /root, /etc and the host's /tmp are simply not there.
- privileges: no_new_privs and no capabilities (bwrap does both); the code runs as the trainer's own
  user, or as `user` (default nobody) when the trainer is root, so it is never host root. A seccomp
  filter (seccomp.py, `--seccomp`) denies ptrace, other processes' memory, the kernel keyrings the run
  inherits (and /proc/keys is unreadable), perf, userfaultfd, bpf and SysV shared memory.
- processes: bwrap's init is PID 1 of the run. When the program exits, or when the tool kills the init
  (timeout, output cap, a limit; python_sandbox.py), PID 1 dies and the kernel kills every process of
  the namespace, however it detached. The next run cannot meet any of them.
- limits set inside the sandbox by util-linux `prlimit` right before the interpreter starts (see
  run_limits.py for the run-wide view): RLIMIT_NPROC counts the tasks of the run's own user namespace,
  so it bounds the run as a whole and does not touch other runs; RLIMIT_AS, RLIMIT_CPU,
  RLIMIT_FSIZE and RLIMIT_NOFILE are per process; no core dumps.

Unprivileged operation: bwrap is not setuid here; it needs unprivileged user namespaces, for a non-root
trainer and for a root trainer alike (root hands the sandbox to `user` first). When a root trainer's
interpreter lies under a directory that `user` cannot traverse (pyenv under /root), bwrap cannot bind
it; `MountView` then prepares once a private mount namespace in which only those paths are reachable,
and each run enters it with `nsenter` while switching to `user`.

`best_effort` fallback (`RlimitsCommand`): when bwrap or user namespaces are unavailable, the code runs
as a plain process under the same rlimits, in a throw-away directory, with a clean environment and as
`user` when the trainer is root. There is no namespace isolation at all then, and the tool warns at
every start.
"""

from __future__ import annotations

import json
import logging
import os
import pwd
import shutil
import stat
import subprocess
import sys
from dataclasses import dataclass
from typing import Optional

from megatron_arpo.tools.seccomp import SeccompUnavailable, build_filter, filter_pipe

logger = logging.getLogger(__name__)

_VIEW_HELPER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_sandbox_view.py")
# The environment bwrap itself runs with. The sandbox's PID 1 is bwrap, and the code can read its
# /proc/1/environ: nothing of the trainer's environment may be in it.
BWRAP_ENV = {"PATH": "/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8"}
SHM_BYTES = 16 * 1024 * 1024
# Bound only with `isolate_network: false`.
_NETWORK_FILES = ("/etc/resolv.conf", "/etc/hosts", "/etc/nsswitch.conf", "/etc/ssl", "/etc/ca-certificates",
                  "/usr/share/ca-certificates")
# Tasks of a run that are not the code's own: bwrap's init (PID 1) and the interpreter itself.
BASE_TASKS = 2
# Open files of each process of a run (RLIMIT_NOFILE): what it may hold open, memfds included.
NOFILE = 1024

_SYSCTL_HINTS = (
    ("/proc/sys/kernel/unprivileged_userns_clone", "0",
     "kernel.unprivileged_userns_clone = 0 (a Debian kernel switch): unprivileged user namespaces are off; "
     "an admin must run `sysctl -w kernel.unprivileged_userns_clone=1` (and persist it in /etc/sysctl.d)"),
    ("/proc/sys/user/max_user_namespaces", "0",
     "user.max_user_namespaces = 0: user namespaces are off; an admin must run "
     "`sysctl -w user.max_user_namespaces=15000` (and persist it in /etc/sysctl.d)"),
    ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", "1",
     "kernel.apparmor_restrict_unprivileged_userns = 1 (Ubuntu 23.10+): AppArmor denies unprivileged user "
     "namespaces; an admin must allow them for /usr/bin/bwrap with an AppArmor profile granting `userns,` "
     "or set the sysctl to 0"),
)


class SandboxUnavailable(RuntimeError):
    """The full sandbox cannot run on this machine; the message says why and what to change."""


def userns_diagnosis() -> list[str]:
    """The kernel switches that currently forbid unprivileged user namespaces, each with its fix."""
    found = []
    for path, bad, hint in _SYSCTL_HINTS:
        try:
            with open(path) as handle:
                value = handle.read().strip()
        except OSError:
            continue  # this kernel does not have the switch
        if value == bad:
            found.append(hint)
    return found


def find_program(name: str) -> Optional[str]:
    found = shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/sbin:/usr/bin:/sbin:/bin")
    return os.path.realpath(found) if found else None


@dataclass(frozen=True)
class SandboxUser:
    """Who runs the code on the host: the trainer's user, or `name` when the trainer is root."""

    uid: int
    gid: int
    name: str
    switch: bool  # True when the trainer is root and must switch to this user

    @classmethod
    def resolve(cls, user: Optional[str]) -> "SandboxUser":
        if os.geteuid() != 0:
            uid = os.getuid()
            try:
                name = pwd.getpwuid(uid).pw_name
            except KeyError:
                name = str(uid)
            return cls(uid, os.getgid(), name, False)
        if not user:
            raise ValueError("python sandbox: running as root needs an unprivileged user for the code; "
                             "set tools.python.user (e.g. 'nobody')")
        try:
            entry = pwd.getpwnam(user)
        except KeyError as exc:
            raise ValueError(f"python sandbox: user {user!r} does not exist; set tools.python.user to an "
                             "existing unprivileged account (e.g. 'nobody')") from exc
        if entry.pw_uid == 0:
            raise ValueError(f"python sandbox: user {user!r} is root; choose an unprivileged account (e.g. 'nobody')")
        return cls(entry.pw_uid, entry.pw_gid, user, True)

    def spawn_kwargs(self) -> dict:
        """Extra arguments for subprocess creation: the switch happens in the child, before exec."""
        return {"user": self.uid, "group": self.gid, "extra_groups": []} if self.switch else {}


# ------------------------------------------------------------------------------------ interpreter
_QUERY = ("import json, sys, sysconfig; print(json.dumps({'executable': sys.executable, 'path': sys.path, "
          "'prefix': sys.prefix, 'base_prefix': sys.base_prefix, 'libdir': sysconfig.get_config_var('LIBDIR')}))")


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def interpreter_files(python: str) -> tuple[list[str], list[tuple[str, str]]]:
    """(paths to bind read-only, (target, link) symlinks to create) for running `python -s -B -c` in a
    sandbox: the interpreter's own files plus the system library directories. Paths are deduplicated
    (a path inside another bound directory is dropped). `sys.path` entries outside the interpreter's
    prefixes (added by .pth files, e.g. an editable checkout) are left out on purpose."""
    try:
        out = subprocess.run([python, "-s", "-B", "-c", _QUERY], capture_output=True, text=True, timeout=60,
                             env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd="/", check=True).stdout
        info = json.loads(out.strip().splitlines()[-1])
    except (OSError, subprocess.SubprocessError, ValueError, IndexError) as exc:
        raise ValueError(f"python sandbox: cannot run the interpreter {python}: {exc}; "
                         "set tools.python.python_executable to a working Python 3 interpreter") from exc
    prefixes = {info["prefix"], info["base_prefix"]}
    prefixes |= {os.path.realpath(p) for p in prefixes}
    wanted = [python, os.path.realpath(python)]
    venv_cfg = os.path.join(os.path.dirname(os.path.dirname(python)), "pyvenv.cfg")
    if os.path.isfile(venv_cfg):
        wanted.append(venv_cfg)
    if info.get("libdir") and os.path.isdir(info["libdir"]):
        wanted.append(info["libdir"])
    skipped = []
    for entry in info["path"]:
        if not entry or not os.path.exists(entry):
            continue
        if any(_inside(entry, p) or _inside(os.path.realpath(entry), p) for p in prefixes):
            wanted.append(entry)
        else:
            skipped.append(entry)
    if skipped:
        logger.info("python sandbox: not exposing sys.path entries outside the interpreter's prefix: %s", skipped)
    links = []
    for top in ("/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(top):
            links.append((os.readlink(top), top))
        elif os.path.isdir(top):
            wanted.append(top)
    wanted += [p for p in ("/usr/lib", "/usr/lib64", "/usr/lib32", "/usr/libx32") if os.path.isdir(p)]
    binds: list[str] = []
    for path in sorted({os.path.abspath(p) for p in wanted}, key=lambda p: (p.count("/"), p)):
        if not any(_inside(path, kept) and os.path.isdir(kept) for kept in binds):
            binds.append(path)
    return sorted(binds), links


def _traversable(path: str, user: SandboxUser) -> bool:
    """Whether `user` can reach `path` (search permission on every ancestor, by mode bits)."""
    parts = os.path.abspath(path).strip("/").split("/")
    for depth in range(len(parts)):
        ancestor = "/" + "/".join(parts[:depth])
        try:
            st = os.stat(ancestor)
        except OSError:
            return False
        if st.st_uid == user.uid:
            bit = stat.S_IXUSR
        elif st.st_gid == user.gid:
            bit = stat.S_IXGRP
        else:
            bit = stat.S_IXOTH
        if not st.st_mode & bit:
            return False
    return True


class MountView:
    """A private mount namespace (made once, by root) in which paths `user` cannot traverse are reachable.

    The helper `_sandbox_view.py` unshares a mount namespace, covers each blocking ancestor directory
    with a small tmpfs and binds back exactly the needed paths. This process keeps a handle on that
    namespace (an open /proc/PID/ns/mnt) and the helper exits; each run enters the namespace with
    `nsenter`, which also switches to `user`. Nothing changes in the host's mount namespace.
    """

    def __init__(self, paths: list[str], user: SandboxUser):
        self.paths = paths
        self.user = user
        helper = subprocess.Popen([sys.executable, "-I", "-S", _VIEW_HELPER,
                                   json.dumps({"paths": paths, "uid": user.uid, "gid": user.gid})],
                                  stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                  env={"PATH": "/usr/bin:/bin", "LANG": "C.UTF-8"}, cwd="/")
        try:
            line = helper.stdout.readline().strip()
            if line != "ready":
                raise SandboxUnavailable(f"could not prepare the interpreter view for user {user.name!r}: "
                                         f"{helper.stderr.read().strip() or line}")
            self.fd = os.open(f"/proc/{helper.pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            helper.stdin.close()
            helper.wait(timeout=30)
            helper.stdout.close()
            helper.stderr.close()

    def argv_prefix(self, nsenter: str) -> list[str]:
        # The handle is read through this process's /proc entry (nsenter still runs as root there), so
        # it is never inherited: an fd passed down would reach the sandboxed code.
        return [nsenter, f"--mount=/proc/{os.getpid()}/fd/{self.fd}", "-S", str(self.user.uid), "-G", str(self.user.gid), "--"]

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


# ------------------------------------------------------------------------------------ commands
@dataclass(frozen=True)
class Limits:
    cpu_s: int
    memory_bytes: int
    file_size_bytes: int
    nproc: int
    disk_bytes: int

    def prlimit_args(self, nproc: int) -> list[str]:
        return [f"--cpu={self.cpu_s}:{self.cpu_s + 1}", f"--as={self.memory_bytes}",
                f"--fsize={self.file_size_bytes}", f"--nproc={nproc}", f"--nofile={NOFILE}", "--core=0"]


def sandbox_environment(python: str, home: str) -> dict[str, str]:
    return {
        "PATH": f"{os.path.dirname(python)}:/usr/bin:/bin",
        "HOME": home,
        "TMPDIR": home,
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "PYTHONHASHSEED": "0",
        "PYTHONIOENCODING": "utf-8",
        "PYTHONUNBUFFERED": "1",
        "PYTHONDONTWRITEBYTECODE": "1",
        "OMP_NUM_THREADS": "1",
        "OPENBLAS_NUM_THREADS": "1",
        "MKL_NUM_THREADS": "1",
        "NUMEXPR_NUM_THREADS": "1",
        "MPLBACKEND": "Agg",
    }


class BwrapCommand:
    """Builds the argv of one bubblewrap run (see the module docstring); raises SandboxUnavailable."""

    kind = "bwrap"

    def __init__(self, python: str, user: SandboxUser, limits: Limits, *, isolate_network: bool = True):
        self.bwrap = find_program("bwrap")
        if self.bwrap is None:
            raise SandboxUnavailable("bubblewrap (bwrap) is not installed; install the Debian/Ubuntu package "
                                     "`bubblewrap` (`make test` and `make demo` do it when run as root)")
        self.prlimit = find_program("prlimit")
        if self.prlimit is None:
            raise SandboxUnavailable("prlimit (util-linux) is not installed; install the package `util-linux`")
        self.python = python
        self.user = user
        self.limits = limits
        self.isolate_network = isolate_network
        try:
            self.seccomp: Optional[bytes] = build_filter()
        except SeccompUnavailable as exc:
            raise SandboxUnavailable(f"the seccomp filter cannot be built: {exc}") from exc
        binds, links = interpreter_files(python)
        binds.append(self.prlimit)
        self.view: Optional[MountView] = None
        self.nsenter: Optional[str] = None
        blocked = [p for p in binds if user.switch and not _traversable(p, user)]
        if blocked:
            self.nsenter = find_program("nsenter")
            if self.nsenter is None:
                raise SandboxUnavailable("nsenter (util-linux) is needed to expose the interpreter to the sandbox "
                                         "user; install `util-linux` or use an interpreter outside /root")
            self.view = MountView(blocked, user)
        self.binds = binds
        # The scratch mounts come first, so that an interpreter living under /tmp is bound on top of
        # the scratch tmpfs instead of being hidden by it.
        # /proc/keys lists the descriptions of keys of the same user (the payloads are behind keyctl,
        # which the seccomp filter denies).
        mounts = ["--proc", "/proc", "--ro-bind", "/dev/null", "/proc/keys", "--dev", "/dev",
                  "--size", str(limits.disk_bytes), "--tmpfs", "/tmp",
                  "--size", str(SHM_BYTES), "--tmpfs", "/dev/shm"]
        for target, link in links:
            mounts += ["--symlink", target, link]
        for path in binds:
            mounts += ["--ro-bind", path, path]
        if not isolate_network:  # the host network is shared: names must resolve and TLS must verify
            for path in _NETWORK_FILES:
                mounts += ["--ro-bind-try", path, path]
        self._mounts = mounts
        self._env: list[str] = []
        for key, value in sandbox_environment(python, "/tmp").items():
            self._env += ["--setenv", key, value]

    def seccomp_fd(self) -> Optional[int]:
        """A fresh pipe holding the filter for one run (bwrap reads it whole), or None without one."""
        return filter_pipe(self.seccomp) if self.seccomp is not None else None

    def argv(self, code: str, *, status_fd: int, block_fd: Optional[int] = None,
             seccomp_fd: Optional[int] = None) -> list[str]:
        head = self.view.argv_prefix(self.nsenter) if self.view is not None else []
        argv = [*head, self.bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent",
                "--new-session", "--hostname", "sandbox", "--json-status-fd", str(status_fd)]
        if seccomp_fd is not None:
            argv += ["--seccomp", str(seccomp_fd)]
        if not self.isolate_network:
            argv.append("--share-net")
        if block_fd is not None:
            argv += ["--block-fd", str(block_fd)]
        argv += self._mounts
        argv += ["--chdir", "/tmp", "--clearenv", *self._env, "--",
                 self.prlimit, *self.limits.prlimit_args(self.limits.nproc + BASE_TASKS), "--",
                 self.python, "-s", "-B", "-c", code]
        return argv

    def spawn_kwargs(self) -> dict:
        """subprocess arguments: the user switch (nsenter does it when a view is used) and fds to pass."""
        kwargs = {} if self.view is not None else self.user.spawn_kwargs()
        kwargs["pass_fds"] = ()
        return kwargs

    def probe(self) -> None:
        """Run `print(1)` in the sandbox once; raise SandboxUnavailable naming the cause if it fails."""
        read_fd, write_fd = os.pipe()
        seccomp_fd = self.seccomp_fd()
        kwargs = self.spawn_kwargs()
        kwargs["pass_fds"] = tuple(kwargs["pass_fds"]) + (write_fd,) + ((seccomp_fd,) if seccomp_fd is not None else ())
        try:
            done = subprocess.run(self.argv("print(1)", status_fd=write_fd, seccomp_fd=seccomp_fd),
                                  capture_output=True, text=True, timeout=60, env=BWRAP_ENV, cwd="/", **kwargs)
        except (OSError, subprocess.SubprocessError) as exc:
            raise SandboxUnavailable(f"bubblewrap could not start: {exc}") from exc
        finally:
            for fd in (write_fd, read_fd, seccomp_fd):
                if fd is not None:
                    os.close(fd)
        if done.returncode == 0 and done.stdout.strip() == "1":
            return
        reasons = userns_diagnosis()
        detail = done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"exit status {done.returncode}"
        if reasons:
            raise SandboxUnavailable(f"unprivileged user namespaces are disabled ({detail}): " + "; ".join(reasons))
        raise SandboxUnavailable(f"bubblewrap failed a trivial run as user {self.user.name!r}: {detail}")

    def describe(self) -> str:
        via = f", interpreter exposed through a private mount view ({', '.join(self.view.paths)})" if self.view else ""
        return (f"bubblewrap {self.bwrap}: user/pid/mount/ipc/net/uts/cgroup namespaces, code runs as "
                f"{self.user.name} (uid {self.user.uid}){via}")

    def close(self) -> None:
        if self.view is not None:
            self.view.close()


def count_tasks(uid: int) -> int:
    """Tasks (threads included) the user owns now: RLIMIT_NPROC counts them in the fallback mode."""
    count = 0
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/status") as handle:
                fields = dict(line.split(":", 1) for line in handle if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"].strip())
        except (OSError, KeyError, ValueError):
            continue
    return count


class RlimitsCommand:
    """`best_effort` fallback: rlimits, a clean environment and a scratch directory; no namespaces."""

    kind = "rlimits-only"

    def __init__(self, python: str, user: SandboxUser, limits: Limits):
        self.prlimit = find_program("prlimit")
        if self.prlimit is None:
            raise ValueError("python sandbox: prlimit (util-linux) is not installed; install the package `util-linux`")
        self.python = os.path.realpath(python) if user.switch else python
        self.user = user
        self.limits = limits

    def argv(self, code: str, *, scratch: str) -> list[str]:
        # RLIMIT_NPROC counts every task of the user here (no user namespace of its own).
        nproc = count_tasks(self.user.uid) + self.limits.nproc + 1
        return [self.prlimit, *self.limits.prlimit_args(nproc), "--", self.python, "-s", "-B", "-c", code]

    def environment(self, scratch: str) -> dict[str, str]:
        return sandbox_environment(self.python, scratch)

    def describe(self) -> str:
        return (f"NO ISOLATION (best_effort): plain process as {self.user.name} with rlimits; it can read what "
                f"that user can read, reach the network, and processes that leave its session may survive")

    def close(self) -> None:
        pass
