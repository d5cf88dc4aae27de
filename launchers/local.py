"""``megatron-arpo launch local``: a Ray cluster on this host, the job on top, and a clean exit.

What ``launch_local`` does:

1. Writes the resolved config (``base:`` chains and ``--set`` applied) to ``<run_dir>/config.yaml``
   atomically; the job reads that file.
2. Starts ``--nodes`` processes of ``python -m launchers ray-node`` on this host — what ``srun`` runs on
   each Slurm node — with node ids 0..N-1 and a job id ``local<pid>``. So the local cluster is formed by
   the same code as the Slurm one (``megatron_arpo.cluster.bootstrap``): the launcher config's port
   plan gives each raylet its own block of ports (derived from the job id and checked free), each node its own short temp dir
   (``<temp_root>/ma-local<pid>-<k>``), workers wait for the head's published address, the head waits
   until all nodes are alive (``launcher.ready_timeout``) and then runs the job with ``RAY_ADDRESS``.
   The NIC is ``launcher.network_interface`` or, for a one-host cluster, loopback.
3. Streams the head's output — the bootstrap's log lines and the job's stdout/stderr — to the console
   and to ``<run_dir>/logs/<job_name>-local<pid>-node0.out``; node k logs to ``...-node<k>.out``.
4. Returns the job's exit code (2 when the cluster did not form; 128+N when killed by signal N).
5. Stops only what it started. Each node stops its own Ray processes (the bootstrap never runs
   ``ray stop``); the launcher then checks that nothing naming its temp dirs is left, and kills any
   such leftover. The node processes get SIGTERM if the launcher itself dies (PR_SET_PDEATHSIG).

Signals: the first SIGINT/SIGTERM is passed to the head as SIGTERM (it forwards it to the job, which may
checkpoint and exit; then everything is stopped); a second one kills the job and the nodes at once.
SIGUSR1 (the preemption notice) goes to the head, which forwards it to the job.

The node processes run in their own session, so a Ctrl-C in the terminal reaches only the launcher, which
then stops things in order. ``SLURM_*`` variables are removed from their environment: a local cluster
started inside an allocation is still a local cluster.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shlex
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any, Callable, Sequence

import psutil

from megatron_arpo.cluster.bootstrap import NodeOptions, plan_from_launcher
from megatron_arpo.cluster.launch_options import ray_node_args
from megatron_arpo.cluster.runtime import set_parent_death_signal
from megatron_arpo.config import load_config
from megatron_arpo.fsutil import atomic_write
from megatron_arpo.progress import is_terminal, strip_ansi_bytes

logger = logging.getLogger(__name__)

DEFAULT_INTERFACE = "lo"


def default_local_command(run_dir: Path) -> list[str]:
    """``megatron-arpo train --config <run_dir>/config.yaml --resume auto`` with this interpreter."""
    return [sys.executable, "-m", "megatron_arpo", "train", "--config", str(run_dir / "config.yaml"),
            "--resume", "auto"]


def expand_run_dir(command: Sequence[str], run_dir: Path) -> list[str]:
    """Replace ``$RUN_DIR`` / ``${RUN_DIR}`` (as in ``launch slurm --command``) with the run directory."""
    return [arg.replace("${RUN_DIR}", str(run_dir)).replace("$RUN_DIR", str(run_dir)) for arg in command]


@dataclass
class LocalLaunch:
    """Everything one local launch runs; ``node_commands`` and ``job_command`` are what a dry run prints."""

    run_dir: Path
    num_nodes: int
    job_id: str
    job_name: str
    job_command: list[str]
    node_commands: list[list[str]]
    env: dict[str, str]
    temp_dirs: list[str]
    head_log: Path
    node_logs: list[Path] = field(default_factory=list)

    def describe(self) -> str:
        lines = [f"# megatron-arpo launch local: {self.num_nodes} Ray node(s) on this host, job id {self.job_id}",
                 f"# run dir: {self.run_dir} (the resolved config is written to {self.run_dir / 'config.yaml'})",
                 f"# head output and job output: {self.head_log}"]
        for k, cmd in enumerate(self.node_commands):
            tail = "" if k == 0 else f"  > {self.node_logs[k]}"
            lines.append(f"node {k}: {shlex.join(cmd)}{tail}")
        lines.append(f"job (run by node 0 once all nodes are up, with RAY_ADDRESS set): {shlex.join(self.job_command)}")
        return "\n".join(lines)


def plan_local_launch(cfg, num_nodes: int = 1, command: Sequence[str] | None = None,
                      job_id: str | None = None) -> LocalLaunch:
    """The commands of a local launch of experiment config ``cfg`` (an ``ExperimentConfig``)."""
    if num_nodes < 1:
        raise ValueError(f"launch local: --nodes {num_nodes}; allowed: an integer >= 1")
    la = cfg.launcher
    run_dir = Path(cfg.run_dir).resolve()
    job_id = job_id or f"local{os.getpid()}"
    ports = plan_from_launcher(dataclasses.asdict(la))
    for k in range(num_nodes):  # raises naming the launcher key when the plan cannot fit
        ports.layout(next(ports.candidate_bases(job_id, k, num_nodes)), head=k == 0)
    logs = run_dir / "logs"
    template = str(logs / f"{la.job_name}-{job_id}-node{{node_id}}.out")
    node_logs = [Path(template.format(node_id=k)) for k in range(num_nodes)]
    head_log = node_logs[0]  # as on Slurm, node 0's log holds the job's output
    job_command = expand_run_dir(command, run_dir) if command else default_local_command(run_dir)
    shared = ray_node_args(la, run_dir=str(run_dir), log_template=template, detect_gpus=True)
    if not la.network_interface:
        shared.append(f"--interface={DEFAULT_INTERFACE}")
    node_commands, temp_dirs = [], []
    for k in range(num_nodes):
        opts = NodeOptions(run_dir=run_dir, num_nodes=num_nodes, node_id=k, job_id=job_id, ports=ports,
                           temp_root=la.temp_root)  # validates the temp dir's socket-path length
        temp_dirs.append(opts.temp_dir)
        cmd = [sys.executable, "-m", "launchers", "ray-node", f"--num-nodes={num_nodes}", f"--node-id={k}",
               f"--job-id={job_id}", *shared]
        if k == 0:
            cmd += ["--", *job_command]
        node_commands.append(cmd)
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    env.update({k: str(v) for k, v in la.env.items()})
    env.setdefault("RAY_AUTH_MODE", "disabled")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    env["MEGATRON_ARPO_RUN_DIR"] = str(run_dir)
    repo = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [repo, env.get("PYTHONPATH")]))
    return LocalLaunch(run_dir=run_dir, num_nodes=num_nodes, job_id=job_id, job_name=la.job_name,
                       job_command=job_command, node_commands=node_commands, env=env, temp_dirs=temp_dirs,
                       head_log=head_log, node_logs=node_logs)


def _write_config(cfg, run_dir: Path) -> Path:
    run_dir.mkdir(parents=True, exist_ok=True)
    path = run_dir / "config.yaml"
    with atomic_write(path) as fh:
        fh.write(cfg.dump_yaml())
    return path


def _pump(src: IO[bytes], sinks: Sequence[IO[bytes]]) -> None:
    """Copies each line to every sink; a sink that is not a terminal (the log file) gets it without the ANSI
    colour codes that Ray's worker-output prefixes and some libraries' loggers carry."""
    plain = [not is_terminal(sink) for sink in sinks]
    for line in iter(src.readline, b""):
        for sink, strip in zip(sinks, plain):
            try:
                sink.write(strip_ansi_bytes(line) if strip else line)
                sink.flush()
            except (OSError, ValueError):
                pass  # a closed console must not stop the log


def _processes_naming(markers: Sequence[str]) -> list:
    found = []
    for p in psutil.process_iter(["pid", "cmdline"]):
        cmdline = " ".join(p.info.get("cmdline") or [])
        if p.pid != os.getpid() and any(m + os.sep in cmdline or cmdline.endswith(m) for m in markers):
            found.append(p)
    return found


def _tree(procs: Sequence[subprocess.Popen]) -> list:
    out = []
    for proc in procs:
        try:
            root = psutil.Process(proc.pid)
            out += [root, *root.children(recursive=True)]
        except psutil.NoSuchProcess:
            pass
    return out


def _kill(victims: Sequence) -> None:
    for p in victims:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(list(victims), timeout=10)


class _LaunchSignals:
    def __init__(self):
        self.head: subprocess.Popen | None = None
        self.nodes: list[subprocess.Popen] = []
        self.count = 0
        self.previous = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1)}
        for s in self.previous:
            signal.signal(s, self._handle)

    def restore(self) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        if signum == signal.SIGUSR1:
            if self.head is not None and self.head.poll() is None:
                logger.info("SIGUSR1: forwarding the preemption notice to the head (pid %d)", self.head.pid)
                self.head.send_signal(signal.SIGUSR1)
            return
        self.count += 1
        if self.count == 1:
            logger.warning("%s: stopping the job and the local Ray cluster (again to kill at once)", name)
            if self.head is not None and self.head.poll() is None:
                self.head.send_signal(signal.SIGTERM)
        else:
            logger.warning("%s again: killing the job and the Ray nodes", name)
            _kill(_tree(self.nodes))


def run_local_launch(launch: LocalLaunch, console: IO[bytes] | None = None, worker_exit_timeout: float = 30.0) -> int:
    """Start the nodes, stream the head's output, wait, clean up; return the job's exit code."""
    console = console if console is not None else sys.stdout.buffer
    (launch.run_dir / "logs").mkdir(parents=True, exist_ok=True)
    signals = _LaunchSignals()
    procs: list[subprocess.Popen] = []
    code = 1
    try:
        with open(launch.head_log, "ab") as head_log:
            for k in range(launch.num_nodes - 1, -1, -1):  # workers first: they wait for the head's address
                cmd = launch.node_commands[k]
                if k == 0:
                    proc = subprocess.Popen(cmd, env=launch.env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                            stderr=subprocess.STDOUT, start_new_session=True,
                                            preexec_fn=_pdeathsig)
                    signals.head = proc
                else:
                    with open(launch.node_logs[k], "ab") as out:
                        proc = subprocess.Popen(cmd, env=launch.env, stdin=subprocess.DEVNULL, stdout=out,
                                                stderr=subprocess.STDOUT, start_new_session=True,
                                                preexec_fn=_pdeathsig)
                procs.append(proc)
                signals.nodes = list(procs)
                logger.info("started Ray node %d (pid %d)", k, proc.pid)
            head = signals.head
            assert head is not None and head.stdout is not None
            pump = threading.Thread(target=_pump, args=(head.stdout, [console, head_log]), daemon=True)
            pump.start()
            code = head.wait()
            pump.join(timeout=10)  # a grandchild still holding the pipe must not hold the launcher
        code = code if code >= 0 else 128 - code
        logger.info("job finished with exit code %d", code)
        deadline = time.monotonic() + worker_exit_timeout
        for proc in procs:
            try:
                proc.wait(timeout=max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                logger.warning("Ray node process %d still up %.0f s after the head ended; terminating it",
                               proc.pid, worker_exit_timeout)
                proc.terminate()
        for proc in procs:
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                _kill(_tree([proc]))
        return code
    finally:
        if any(p.poll() is None for p in procs):
            _kill(_tree(procs))
        leftovers = _processes_naming(launch.temp_dirs)
        if leftovers:
            logger.warning("killing %d leftover Ray process(es) of this launch: %s", len(leftovers),
                           [p.pid for p in leftovers])
            _kill(leftovers)
        signals.restore()


def _pdeathsig() -> None:
    set_parent_death_signal()


def launch_local(config: str, overrides: Sequence[str] = (), num_nodes: int = 1, command: Sequence[str] | None = None,
                 dry_run: bool = False, check: Callable[[Any, Sequence[str]], None] | None = None) -> int:
    """``megatron-arpo launch local``: returns the job's exit code (0 for a dry run). ``check(cfg, job_command)``
    (the pre-flight) runs before anything starts and raises on a problem."""
    cfg = load_config(config, overrides)
    launch = plan_local_launch(cfg, num_nodes=num_nodes, command=command)
    if dry_run:
        print(launch.describe())
        return 0
    if check is not None:
        check(cfg, launch.job_command)
    _write_config(cfg, launch.run_dir)
    print(launch.describe(), flush=True)
    return run_local_launch(launch)
