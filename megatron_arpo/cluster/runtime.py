"""Connect the trainer to Ray: join the job's cluster, form one inside a Slurm allocation, or start a local one.

``connect_ray(cfg)`` is what ``megatron-arpo train`` calls before it builds actors and engines. It picks
one of four ways, in this order (``decide_ray_target`` is the pure, unit-tested part):

1. ``address`` — ``RAY_ADDRESS`` is set: the sbatch script's head node (``megatron_arpo.cluster.bootstrap``)
   and ``megatron-arpo launch local`` start the driver that way. Connect to it.
2. ``address_file`` — inside a Slurm allocation (``SLURM_JOB_ID``) whose bootstrap published a head
   address (``<run_dir>/ray/<jobid>[-k].<restart>/head.json``, no ``done`` file beside it) and whose GCS
   port answers: another process of this job formed the cluster. Connect to it.
3. ``slurm`` — inside an allocation (salloc, or one's own sbatch) with no Ray yet: form the cluster the
   way the sbatch script does — one ``srun`` task per node of the allocation running
   ``python -m launchers ray-node`` with the launcher config's port plan, NIC, temp root and
   ``ready_timeout`` (same readiness handshake, same errors). The head's driver is a small "hold"
   process (``python -m megatron_arpo.cluster.runtime hold``) that publishes the ready cluster's
   address and keeps the step alive until this process releases it in ``shutdown()``.
4. ``local`` — anywhere else: ``ray.init(address="local")`` (always a new instance, never someone
   else's cluster found through ``/tmp/ray``) with ``launcher.num_cpus``, ``launcher.object_store_memory``,
   no dashboard, and a private temp dir.

``RayConnection.shutdown()`` disconnects the driver and stops only what ``connect_ray`` started: the
local instance (``ray.shutdown`` ends it), or the ``srun`` step of a cluster it formed (release file,
then the step ends by itself; SIGTERM after a timeout). A cluster it merely joined is left running.

Notes:
- ``RAY_AUTH_MODE`` is set to ``disabled`` unless already set: with it unset Ray switches token auth
  on whenever ``~/.ray/auth_token`` exists, which another Ray user may create at any moment.
- Ray rewrites a ``127.0.0.1`` bootstrap address to the host's IP; a node bound to loopback (the local
  launcher, the test clusters) is found by passing ``_node_ip_address``, taken from
  ``MEGATRON_ARPO_NODE_IP`` (exported by the bootstrap to the driver) or from the head's address.
- Formation mode needs this process on a node of the allocation (the batch script of one's own
  sbatch, or a salloc whose shell runs on the first node): a Ray driver must share a host with a
  raylet. A warning says so when ``SLURMD_NODENAME`` is unset.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from megatron_arpo.cluster.bootstrap import port_open, write_json_atomic as _write
from megatron_arpo.cluster.launch_options import ray_node_args
from megatron_arpo.progress import is_terminal

logger = logging.getLogger(__name__)

MODES = ("address", "address_file", "slurm", "local")
PR_SET_PDEATHSIG = 1


# -- the decision ---------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RayTarget:
    """How to get a Ray cluster: ``mode`` (one of MODES), the address when known, and why."""

    mode: str
    address: str | None = None
    reason: str = ""
    head_file: Path | None = None


def _gcs_answers(address: str) -> bool:
    host, _, port = address.rpartition(":")
    return bool(host) and port.isdigit() and port_open(host, int(port))


def live_head_files(run_dir: str | os.PathLike, job_id: str, restart: int) -> list[Path]:
    """This job's published head addresses without a ``done`` beside them, newest first."""
    ray_dir = Path(run_dir) / "ray"
    found = [ray_dir / f"{job_id}.{restart}" / "head.json"]
    if ray_dir.is_dir():
        found += sorted(ray_dir.glob(f"{job_id}-*.{restart}/head.json"))
    live = [p for p in found if p.is_file() and not (p.parent / "done").exists()]
    return sorted(live, key=lambda p: p.stat().st_mtime, reverse=True)


def decide_ray_target(run_dir: str | os.PathLike, environ: Mapping[str, str] | None = None,
                      probe: Callable[[str], bool] = _gcs_answers) -> RayTarget:
    """Which Ray to use, from the environment and the run directory (see the module docstring).

    ``probe(address)`` says whether a published head still answers; a head file whose GCS is gone (a
    job killed before it could write ``done``) is skipped.
    """
    environ = os.environ if environ is None else environ
    address = (environ.get("RAY_ADDRESS") or "").strip()
    if address:
        return RayTarget("address", address, "RAY_ADDRESS is set")
    job_id = (environ.get("SLURM_JOB_ID") or "").strip()
    if not job_id:
        return RayTarget("local", None, "no RAY_ADDRESS and not inside a Slurm allocation (SLURM_JOB_ID unset)")
    restart = int(environ.get("SLURM_RESTART_COUNT") or 0)
    for head_file in live_head_files(run_dir, job_id, restart):
        try:
            published = json.loads(head_file.read_text())["address"]
        except (OSError, ValueError, KeyError) as exc:
            logger.warning("ignoring unreadable Ray head file %s: %s", head_file, exc)
            continue
        if probe(published):
            return RayTarget("address_file", published, f"Slurm job {job_id} published a Ray head", head_file)
        logger.warning("Ray head file %s names %s, which does not answer; ignoring it", head_file, published)
    return RayTarget("slurm", None, f"inside Slurm job {job_id} with no Ray cluster yet: forming one")


# -- process helpers ---------------------------------------------------------------------------------------

def set_parent_death_signal() -> None:
    """preexec_fn: the child gets SIGTERM when its parent dies (Linux), so nothing outlives a killed launcher."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    except (OSError, AttributeError):
        pass  # not Linux: the explicit cleanup paths still apply


def _ignore_usr1_and_set_pdeathsig() -> None:
    # USR1 is Slurm's preemption notice; its default action would end srun's tasks before the trainer
    # decides anything (see megatron_arpo.cluster.bootstrap).
    signal.signal(signal.SIGUSR1, signal.SIG_IGN)
    set_parent_death_signal()


def write_json_atomic(path: Path, data: Mapping) -> None:
    _write(path, data)


# -- forming a cluster inside an allocation ----------------------------------------------------------------

@dataclass
class SlurmRayStep:
    """An ``srun`` step running the Ray bootstrap on every node of the current allocation."""

    launcher: Any  # LauncherSection / LauncherOptions (attribute access)
    run_dir: Path
    environ: Mapping[str, str]
    proc: subprocess.Popen | None = None
    job_id: str = ""
    handshake_dir: Path | None = None
    log_template: str = ""

    def _num_nodes(self) -> int:
        value = self.environ.get("SLURM_JOB_NUM_NODES") or self.environ.get("SLURM_NNODES") or "1"
        return int(value)

    def _choose_job_id(self, base: str, restart: int) -> str:
        """This job's handshake id; a fresh suffix when an earlier cluster of the allocation left its dir."""
        candidate, k = base, 0
        while (self.run_dir / "ray" / f"{candidate}.{restart}").exists():
            k += 1
            candidate = f"{base}-{k}"
        return candidate

    def command(self) -> list[str]:
        la = self.launcher
        python = sys.executable
        srun = ["srun", f"--nodes={self._num_nodes()}", "--ntasks-per-node=1", "--overlap",
                "--kill-on-bad-exit=0", "--job-name=megatron-arpo-ray", "--open-mode=append",
                f"--output={self.log_template.replace('{node_id}', '%n')}"]
        if getattr(la, "cpus_per_task", None):
            srun.append(f"--cpus-per-task={la.cpus_per_task}")

        node = [python, "-m", "launchers", "ray-node", f"--job-id={self.job_id}",
                *ray_node_args(la, run_dir=str(self.run_dir), log_template=str(self.log_template))]
        hold = [python, "-m", "megatron_arpo.cluster.runtime", "hold", f"--ready-file={self.ready_file}",
                f"--release-file={self.release_file}"]
        return srun + node + ["--"] + hold

    @property
    def ready_file(self) -> Path:
        assert self.handshake_dir is not None
        return self.handshake_dir / "driver-ready.json"

    @property
    def release_file(self) -> Path:
        assert self.handshake_dir is not None
        return self.handshake_dir / "driver-release"

    def start(self, start_timeout: float = 180.0) -> dict:
        """Run the step; return the hold process's ready record (address, node IP) once all nodes joined."""
        if shutil.which("srun", path=self.environ.get("PATH")) is None:
            raise RuntimeError("inside a Slurm allocation (SLURM_JOB_ID is set) but `srun` is not on PATH; "
                               "fix PATH, or set RAY_ADDRESS to an existing Ray cluster")
        if not self.environ.get("SLURMD_NODENAME"):
            logger.warning("this process does not run on a node of Slurm job %s (SLURMD_NODENAME unset); a Ray "
                           "driver must share a host with a raylet, so run the trainer on the allocation's "
                           "first node (e.g. from the batch script, or `srun --nodes=1 --ntasks=1 ...`)",
                           self.environ.get("SLURM_JOB_ID"))
        restart = int(self.environ.get("SLURM_RESTART_COUNT") or 0)
        self.job_id = self._choose_job_id(self.environ["SLURM_JOB_ID"], restart)
        self.handshake_dir = self.run_dir / "ray" / f"{self.job_id}.{restart}"
        self.handshake_dir.mkdir(parents=True, exist_ok=True)
        (self.run_dir / "logs").mkdir(parents=True, exist_ok=True)
        self.log_template = str(self.run_dir / "logs" / f"ray-{self.job_id}-node{{node_id}}.out")
        cmd = self.command()
        env = dict(self.environ)
        env.update({k: str(v) for k, v in (self.launcher.env or {}).items()})
        env.setdefault("RAY_AUTH_MODE", "disabled")
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(Path(__file__).resolve().parents[2]),
                                                           env.get("PYTHONPATH")]))
        logger.info("forming a %d-node Ray cluster in Slurm job %s: %s", self._num_nodes(), self.job_id,
                    " ".join(cmd))
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL,
                                     preexec_fn=_ignore_usr1_and_set_pdeathsig)
        timeout = float(self.launcher.ready_timeout) + start_timeout
        deadline = time.monotonic() + timeout
        while not self.ready_file.exists():
            code = self.proc.poll()
            if code is not None:
                raise RuntimeError(
                    f"the Ray bootstrap step exited with code {code} before the cluster was ready; read "
                    f"{self.log_template.format(node_id=0)} (the head) and the other nodes' logs "
                    f"{self.log_template.format(node_id='<k>')}")
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"the Ray cluster of Slurm job {self.job_id} was not ready after {timeout:.0f} s "
                    f"(launcher.ready_timeout + {start_timeout:.0f} s start-up); read "
                    f"{self.log_template.format(node_id=0)}")
            time.sleep(0.25)
        return json.loads(self.ready_file.read_text())

    def stop(self, timeout: float = 60.0) -> int | None:
        """Release the hold process; the head then stops its node and tells the workers to leave."""
        if self.proc is None:
            return None
        if self.handshake_dir is not None:
            write_json_atomic(self.release_file, {"time": time.time()})
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            logger.warning("the Ray step did not end %.0f s after release; terminating srun (pid %d)",
                           timeout, self.proc.pid)
        self.proc.terminate()  # srun forwards it; every ray-node cleans up its own processes
        try:
            return self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            return self.proc.wait(timeout=10)


# -- the connection ------------------------------------------------------------------------------------------

@dataclass
class RayConnection:
    """The driver's Ray connection and what ``connect_ray`` started to get it."""

    mode: str
    address: str | None
    reason: str
    num_nodes: int = 0
    started: list[str] = field(default_factory=list)  # human-readable, for logs
    _step: SlurmRayStep | None = None
    _temp_dir: str | None = None
    _closed: bool = False

    def shutdown(self) -> None:
        """Disconnect; stop exactly what connect_ray started (idempotent)."""
        if self._closed:
            return
        self._closed = True
        # deferred: pulls in ray (heavy; this module imports without it)
        import ray

        if ray.is_initialized():
            ray.shutdown()  # in "local" mode this also stops the instance ray.init started
        if self._step is not None:
            code = self._step.stop()
            logger.info("Ray step of Slurm job %s ended (code %s)", self._step.job_id, code)
        if self._temp_dir:
            shutil.rmtree(self._temp_dir, ignore_errors=True)

    def __enter__(self) -> "RayConnection":
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()


def _init_kwargs(address: str, environ: Mapping[str, str]) -> dict:
    kwargs: dict[str, Any] = {"address": address, "logging_level": logging.WARNING}
    node_ip = environ.get("MEGATRON_ARPO_NODE_IP")
    host = address.rpartition(":")[0]
    if not node_ip and host in ("127.0.0.1", "localhost"):
        node_ip = "127.0.0.1"
    if node_ip:
        kwargs["_node_ip_address"] = node_ip
    return kwargs


def _alive_nodes() -> int:
    # deferred: pulls in ray (heavy; this module imports without it)
    import ray

    return sum(1 for n in ray.nodes() if n.get("Alive"))


def connect_ray(cfg: Any, environ: Mapping[str, str] | None = None, **init_kwargs: Any) -> RayConnection:
    """Connect this process to Ray as ``decide_ray_target`` says; see the module docstring.

    ``cfg`` is an ``ExperimentConfig`` (uses ``cfg.run_dir`` and ``cfg.launcher``); ``init_kwargs``
    (``namespace``, ``runtime_env``, ``log_to_driver``, ...) are passed to ``ray.init``.
    """
    # deferred: pulls in ray (heavy; this module imports without it)
    import ray

    environ = dict(os.environ if environ is None else environ)
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    environ.setdefault("RAY_AUTH_MODE", os.environ["RAY_AUTH_MODE"])
    if not is_terminal(sys.stdout):  # Ray prints actors' output with coloured prefixes; none into a log file
        os.environ.setdefault("RAY_COLOR_PREFIX", "0")
    if ray.is_initialized():
        raise RuntimeError("connect_ray: this process is already connected to Ray; call it once per driver")
    run_dir = Path(cfg.run_dir).resolve()
    target = decide_ray_target(run_dir, environ)
    logger.info("Ray: %s (%s)", target.mode, target.reason)
    la = cfg.launcher
    conn = RayConnection(mode=target.mode, address=target.address, reason=target.reason)
    try:
        if target.mode in ("address", "address_file"):
            ray.init(**{**_init_kwargs(target.address, environ), **init_kwargs})
        elif target.mode == "slurm":
            step = SlurmRayStep(la, run_dir, environ)
            conn._step = step
            conn.started.append(f"srun step of Slurm job {environ['SLURM_JOB_ID']} (Ray bootstrap)")
            ready = step.start()
            conn.address = ready["address"]
            ray.init(**{**_init_kwargs(conn.address, environ), **init_kwargs})
        else:
            conn._temp_dir = tempfile.mkdtemp(prefix="ma-ray-", dir=la.temp_root)
            ray.init(address="local", num_cpus=la.num_cpus, num_gpus=0 if la.gpus_per_node == 0 else None,
                     object_store_memory=la.object_store_memory, include_dashboard=False,
                     _temp_dir=conn._temp_dir, **{"logging_level": logging.WARNING, **init_kwargs})
            conn.started.append(f"local Ray instance (temp dir {conn._temp_dir})")
            conn.address = ray.get_runtime_context().gcs_address
    except BaseException:
        conn.shutdown()
        raise
    conn.num_nodes = _alive_nodes()
    logger.info("Ray connected: %s, %d node(s) alive%s", conn.address, conn.num_nodes,
                f"; started {', '.join(conn.started)}" if conn.started else "")
    return conn


# -- the hold process (the head's driver when forming a cluster for a trainer) ----------------------------

def hold_main(argv: Sequence[str] | None = None) -> int:
    """Publish the ready cluster's address, then wait for the release file (or SIGTERM)."""
    parser = argparse.ArgumentParser(prog="python -m megatron_arpo.cluster.runtime hold")
    parser.add_argument("--ready-file", required=True)
    parser.add_argument("--release-file", required=True)
    parser.add_argument("--poll", type=float, default=0.5)
    args = parser.parse_args(argv)
    set_parent_death_signal()  # the head's ray-node is the parent: if it dies, so does the hold
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(True))
    write_json_atomic(Path(args.ready_file), {"address": os.environ.get("RAY_ADDRESS", ""),
                                              "node_ip": os.environ.get("MEGATRON_ARPO_NODE_IP", ""),
                                              "pid": os.getpid()})
    release = Path(args.release_file)
    while not stop and not release.exists():
        time.sleep(args.poll)
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] != "hold":
        print("usage: python -m megatron_arpo.cluster.runtime hold --ready-file F --release-file F",
              file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return hold_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
