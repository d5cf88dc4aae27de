"""A real two-node Slurm cluster on one machine, for the integration tests.

``LocalSlurmCluster(workdir)`` writes its own ``slurm.conf`` under ``workdir`` (never /etc/slurm) and
starts, in the foreground under its own ``Popen`` handles, ``slurmctld`` and two ``slurmd`` daemons
(``-N node1`` / ``-N node2``) that share this host: Debian's Slurm build has ``MULTIPLE_SLURMD``, so the
"nodes" differ only by name, port, spool/pid/log files. Client commands find the private config through
``SLURM_CONF``; ``cluster.env`` holds it and ``start()`` exports it into ``os.environ`` (restored by
``stop()``), so ``sbatch`` from the tests — and jobs, which inherit the submitter's environment — use it.

Facts this relies on are in ``docs/design/slurm_local.md``. What it does besides:
- ``munged`` is started only when no munge daemon answers already; ``stop()`` stops it only if it
  started it.
- ``127.0.0.1 node1 node2`` is appended to /etc/hosts in place when missing (it may be a bind mount, so
  it is never replaced by a new file).
- Every PID it starts is recorded in ``workdir/pids.json``. A later ``start()`` on the same ``workdir``
  (after a crashed run) stops those stale daemons — only if their command line still names this
  workdir's config — and wipes the state directory before starting afresh.
- ``stop()`` terminates exactly the PIDs it started and waits for them.

Needs root and the ``slurmctld``/``slurmd``/``munged`` binaries; ``missing_requirements()`` says what is
missing so tests can skip with the reason.
"""

from __future__ import annotations

import fcntl
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

logger = logging.getLogger(__name__)

NODE_NAMES = ("node1", "node2")
REQUIRED_BINARIES = ("slurmctld", "slurmd", "munged", "munge", "sinfo", "sbatch", "scontrol")
MUNGE_SOCKET = "/run/munge/munge.socket.2"

_CONF_TEMPLATE = """\
# Written by support.slurm_local for a throwaway 2-node test cluster; do not edit.
ClusterName=ma-local
SlurmctldHost={host}(127.0.0.1)
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port0}
AuthType=auth/munge
SlurmUser=root
SlurmdUser=root
StateSaveLocation={state}/ctld
SlurmdSpoolDir={state}/spool/%n
SlurmctldPidFile={state}/run/slurmctld.pid
SlurmdPidFile={state}/run/slurmd-%n.pid
SlurmctldLogFile={state}/log/slurmctld.log
SlurmdLogFile={state}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SlurmdParameters=config_overrides
MpiDefault=none
MailProg=/bin/true
AccountingStorageType=accounting_storage/none
JobCompType=jobcomp/none
JobAcctGatherType=jobacct_gather/none
ReturnToService=2
JobRequeue=1
KillWait=5
InactiveLimit=0
MinJobAge=600
SchedulerParameters=sched_interval=2
NodeName=node[1-2] NodeHostname={host} NodeAddr=127.0.0.1 Port=[{slurmd_port0}-{slurmd_port1}] CPUs={cpus} RealMemory=1000 State=UNKNOWN
PartitionName=debug Nodes=node[1-2] Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES
"""


def missing_requirements() -> str | None:
    """Why a local Slurm cluster cannot run here, or None when it can."""
    if os.geteuid() != 0:
        return "the local Slurm cluster needs root (slurmd runs jobs as any user)"
    missing = [b for b in REQUIRED_BINARIES if shutil.which(b) is None
               and not Path("/usr/sbin", b).exists()]
    if missing:
        return (f"Slurm binaries not found: {missing}; install them with `make slurm-packages` "
                "(apt-get install slurmd slurmctld slurm-client munge)")
    return None


def _which(name: str) -> str:
    found = shutil.which(name)
    if found:
        return found
    candidate = Path("/usr/sbin", name)
    if candidate.exists():
        return str(candidate)
    raise FileNotFoundError(f"{name} not found on PATH or in /usr/sbin; install the Slurm/munge packages")


def _pid_cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie is dead for our purposes.
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _terminate_pids(pids: list[int], timeout: float = 15.0) -> None:
    """SIGTERM the given PIDs, wait, then SIGKILL whatever is left."""
    for pid in pids:
        try:
            os.kill(pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and any(_pid_alive(p) for p in pids):
        time.sleep(0.1)
    for pid in pids:
        if _pid_alive(pid):
            logger.warning("pid %d ignored SIGTERM for %.0f s; sending SIGKILL", pid, timeout)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass


def munge_is_running() -> bool:
    """True when a munge daemon answers on the default socket."""
    if not Path(MUNGE_SOCKET).exists():
        return False
    try:
        result = subprocess.run([_which("munge"), "-n"], capture_output=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return result.returncode == 0


def ensure_hosts_entry(names: tuple[str, ...] = NODE_NAMES, hosts_path: str = "/etc/hosts") -> bool:
    """Make ``names`` resolve to 127.0.0.1 by appending to /etc/hosts in place. Returns True if it wrote."""
    with open(hosts_path, "r+") as fh:  # r+ keeps the inode: /etc/hosts may be a bind mount
        text = fh.read()
        known = set()
        for line in text.splitlines():
            fields = line.split("#", 1)[0].split()
            if len(fields) >= 2 and fields[0] == "127.0.0.1":
                known.update(fields[1:])
        missing = [n for n in names if n not in known]
        if not missing:
            return False
        fh.seek(0, os.SEEK_END)
        prefix = "" if text.endswith("\n") or not text else "\n"
        fh.write(f"{prefix}127.0.0.1 {' '.join(missing)}\n")
        fh.flush()
    logger.info("appended '127.0.0.1 %s' to %s", " ".join(missing), hosts_path)
    return True


class LocalSlurmCluster:
    """Two slurmd "nodes" (node1, node2) and a slurmctld on this host, configured under ``workdir``.

    Use as a context manager or call ``start()``/``stop()``. Ports default to ones unlikely to clash with
    a site Slurm (slurmctld 16817, slurmd 17001-17002).
    """

    def __init__(self, workdir: str | os.PathLike, ctld_port: int = 16817,
                 slurmd_ports: tuple[int, int] = (17001, 17002), cpus_per_node: int = 2,
                 start_timeout: float = 30.0):
        self.workdir = Path(workdir).resolve()
        self.state_dir = self.workdir / "state"
        self.conf_path = self.workdir / "etc" / "slurm.conf"
        self.ctld_port = ctld_port
        self.slurmd_ports = slurmd_ports
        self.cpus_per_node = cpus_per_node
        self.start_timeout = start_timeout
        self.hostname = socket.gethostname().split(".")[0]
        self._procs: dict[str, subprocess.Popen] = {}
        self._munge_pid: int | None = None
        self._lock_fh = None
        self._saved_env: dict[str, str | None] = {}

    # -- public ---------------------------------------------------------------------------------------
    @property
    def env(self) -> dict[str, str]:
        """Environment additions that point Slurm client commands at this cluster."""
        return {"SLURM_CONF": str(self.conf_path)}

    @property
    def log_dir(self) -> Path:
        return self.state_dir / "log"

    def start(self) -> "LocalSlurmCluster":
        problem = missing_requirements()
        if problem:
            raise RuntimeError(problem)
        self.workdir.mkdir(parents=True, exist_ok=True)
        self._acquire_lock()
        try:
            self._stop_stale()
            if self.state_dir.exists():
                shutil.rmtree(self.state_dir)
            for sub in ("ctld", "run", "log", *(f"spool/{n}" for n in NODE_NAMES)):
                (self.state_dir / sub).mkdir(parents=True, exist_ok=True)
            self._write_conf()
            ensure_hosts_entry()
            self._start_munge()
            self._export_env()
            self._spawn("slurmctld", [_which("slurmctld"), "-D", "-c", "-i", "-f", str(self.conf_path)])
            for node in NODE_NAMES:
                self._spawn(f"slurmd-{node}", [_which("slurmd"), "-D", "-N", node, "-f", str(self.conf_path)])
            self.wait_idle()
        except BaseException:
            self.stop()
            raise
        return self

    def cancel_all_jobs(self, timeout: float = 30.0) -> None:
        """scancel every job of this cluster and wait until none is left (their processes have ended)."""
        if self._procs.get("slurmctld") is None or self._procs["slurmctld"].poll() is not None:
            return
        jobs = self.run("squeue", "-h", "-o", "%i", check=False).stdout.split()
        if not jobs:
            return
        logger.info("cancelling jobs %s", jobs)
        self.run("scancel", *jobs, check=False)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if not self.run("squeue", "-h", "-o", "%i", check=False).stdout.split():
                return
            time.sleep(0.3)
        logger.warning("jobs still listed %.0f s after scancel; stopping the daemons anyway", timeout)

    def stop(self) -> None:
        try:
            self.cancel_all_jobs()
        except (OSError, subprocess.SubprocessError) as exc:
            logger.warning("could not cancel jobs before stopping: %s", exc)
        started = [p for p in self._procs.values() if p.poll() is None]
        if started:
            logger.info("stopping local Slurm daemons (pids %s)", [p.pid for p in started])
        # slurmds first, so they do not log the controller vanishing under running steps.
        for name in sorted(self._procs, key=lambda n: n == "slurmctld"):
            proc = self._procs[name]
            if proc.poll() is None:
                proc.terminate()
        for name, proc in self._procs.items():
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                logger.warning("%s (pid %d) ignored SIGTERM; killing it", name, proc.pid)
                proc.kill()
                proc.wait(timeout=10)
        self._procs.clear()
        if self._munge_pid is not None:
            _terminate_pids([self._munge_pid])
            self._munge_pid = None
        self._write_pids()
        self._restore_env()
        self._release_lock()

    def __enter__(self) -> "LocalSlurmCluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def run(self, *args: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess:
        """Run a Slurm client command against this cluster and return the completed process."""
        env = {**os.environ, **self.env}
        result = subprocess.run(list(args), env=env, capture_output=True, text=True, timeout=timeout)
        if check and result.returncode != 0:
            raise RuntimeError(f"{' '.join(args)} exited {result.returncode}: {result.stderr.strip()}")
        return result

    def wait_idle(self, timeout: float | None = None) -> None:
        """Poll ``sinfo`` until both nodes are idle; on timeout raise with the daemon logs to read."""
        timeout = self.start_timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            for name, proc in self._procs.items():
                if proc.poll() is not None:
                    raise RuntimeError(
                        f"{name} exited with code {proc.returncode} while the local Slurm cluster was "
                        f"starting; read {self._log_path(name)}")
            result = self.run("sinfo", "-h", "-o", "%T %D", check=False, timeout=10)
            last = (result.stdout.strip() or result.stderr.strip())
            if result.returncode == 0 and last == f"idle {len(NODE_NAMES)}":
                return
            time.sleep(0.2)
        raise TimeoutError(
            f"local Slurm cluster not idle after {timeout:.0f} s (last sinfo: {last!r}); read "
            f"{self._log_path('slurmctld')} and {self.log_dir}/slurmd-node*.log")

    def job_info(self, job_id: str) -> dict[str, str]:
        """``scontrol show job`` as a dict (JobState, ExitCode, Restarts, ...); jobs stay visible 600 s."""
        out = self.run("scontrol", "show", "job", "-o", str(job_id)).stdout
        info: dict[str, str] = {}
        for token in out.split():
            if "=" in token:
                key, value = token.split("=", 1)
                info.setdefault(key, value)
        return info

    def wait_job(self, job_id: str, timeout: float = 60.0,
                 final_states: tuple[str, ...] = ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT",
                                                  "NODE_FAIL", "OUT_OF_MEMORY", "PREEMPTED")) -> dict:
        """Poll until the job reaches a final state; return its ``job_info``."""
        deadline = time.monotonic() + timeout
        info: dict[str, str] = {}
        while time.monotonic() < deadline:
            info = self.job_info(job_id)
            if info.get("JobState") in final_states:
                return info
            time.sleep(0.3)
        raise TimeoutError(f"job {job_id} still {info.get('JobState')!r} after {timeout:.0f} s; "
                           f"slurmctld log: {self._log_path('slurmctld')}")

    # -- internals ------------------------------------------------------------------------------------
    def _log_path(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _write_conf(self) -> None:
        self.conf_path.parent.mkdir(parents=True, exist_ok=True)
        text = _CONF_TEMPLATE.format(host=self.hostname, ctld_port=self.ctld_port,
                                     slurmd_port0=self.slurmd_ports[0], slurmd_port1=self.slurmd_ports[1],
                                     state=self.state_dir, cpus=self.cpus_per_node)
        self.conf_path.write_text(text)

    def _spawn(self, name: str, argv: list[str]) -> None:
        out = open(self._log_path(name) if name == "slurmctld" else self.log_dir / f"{name}.stdout", "ab")
        try:
            proc = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, **self.env}, start_new_session=True)
        finally:
            out.close()
        self._procs[name] = proc
        self._write_pids()
        logger.info("started %s (pid %d)", name, proc.pid)

    def _start_munge(self) -> None:
        if munge_is_running():
            logger.info("munged already running; using it")
            return
        Path("/run/munge").mkdir(parents=True, exist_ok=True)
        shutil.chown("/run/munge", "munge", "munge")
        subprocess.run(["runuser", "-u", "munge", "--", _which("munged")], check=True, timeout=30)
        pid_file = Path("/run/munge/munged.pid")
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (pid_file.exists() and munge_is_running()):
            time.sleep(0.1)
        if not munge_is_running():
            raise RuntimeError("munged did not come up; check /var/log/munge/munged.log")
        self._munge_pid = int(pid_file.read_text().split()[0])
        self._write_pids()

    def _write_pids(self) -> None:
        if not self.workdir.exists():
            return
        record = {"conf": str(self.conf_path),
                  "daemons": {name: p.pid for name, p in self._procs.items() if p.poll() is None},
                  "munged": self._munge_pid}
        tmp = self.workdir / "pids.json.tmp"
        tmp.write_text(json.dumps(record))
        os.replace(tmp, self.workdir / "pids.json")

    def _stop_stale(self) -> None:
        """Stop daemons a crashed earlier run of this workdir left behind (checked by command line)."""
        path = self.workdir / "pids.json"
        if not path.exists():
            return
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            return
        stale = [pid for pid in record.get("daemons", {}).values()
                 if _pid_alive(pid) and str(self.conf_path) in _pid_cmdline(pid)]
        if stale:
            logger.warning("stopping stale Slurm daemons from an earlier run of %s: %s", self.workdir, stale)
            _terminate_pids(stale)
        munge_pid = record.get("munged")
        if munge_pid and _pid_alive(munge_pid) and "munged" in _pid_cmdline(munge_pid):
            # We started it last time and never stopped it; adopt it so stop() ends it this time.
            self._munge_pid = munge_pid

    def _export_env(self) -> None:
        for key, value in self.env.items():
            self._saved_env.setdefault(key, os.environ.get(key))
            os.environ[key] = value

    def _restore_env(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env.clear()

    def _acquire_lock(self) -> None:
        """One cluster per workdir at a time: a second pytest session waits, then fails clearly."""
        if self._lock_fh is not None:
            return
        fh = open(self.workdir / "cluster.lock", "w")
        deadline = time.monotonic() + 120
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() > deadline:
                    fh.close()
                    raise RuntimeError(f"another process holds {self.workdir}/cluster.lock (a local Slurm "
                                       "cluster is running from this workdir); use another workdir") from None
                time.sleep(0.5)
        self._lock_fh = fh

    def _release_lock(self) -> None:
        if self._lock_fh is not None:
            fcntl.flock(self._lock_fh, fcntl.LOCK_UN)
            self._lock_fh.close()
            self._lock_fh = None
