"""The ``launcher`` section of an experiment config: typed options, validation, and CLI overrides.

``launcher_options(cfg, overrides)`` accepts a plain mapping (the YAML ``launcher:`` section, or a whole
experiment dict that has one), a dataclass instance with the same field names (e.g. the ``launcher``
section of ``megatron_arpo.config``), or a ``LauncherOptions``; CLI overrides (``--nodes 4``) win.
Unknown keys are errors that list the allowed keys.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from typing import Any, Mapping

from megatron_arpo.errors import InputError

# Exit code of a trainer that saved a checkpoint because it was told to stop (SIGUSR1) and wants the job
# requeued. The trainer (megatron_arpo.train) must use the same value; it is configurable here.
PREEMPT_EXIT_CODE = 42


@dataclass
class LauncherOptions:
    """Slurm and Ray launch knobs. Time is Slurm's format (``HH:MM:SS`` or ``D-HH:MM:SS``)."""

    nodes: int = 1
    gpus_per_node: int = 8
    # Resources of the one task per node. The defaults give the job whole nodes: --exclusive, every CPU
    # (no --cpus-per-task: the step gets all CPUs of an exclusive node) and --mem=0 (all memory).
    cpus_per_task: int | None = None
    memory_per_node: str | None = "all"  # "all" = --mem=0, a Slurm size ("480G"), or None = site default
    exclusive: bool = True
    partition: str | None = None
    account: str | None = None
    qos: str | None = None
    time: str = "24:00:00"
    job_name: str = "megatron-arpo"
    # Relative paths are relative to the submit directory; logs go to <run_dir>/logs.
    run_dir: str = "runs/megatron-arpo"
    container_image: str | None = None  # pyxis/enroot: srun --container-image
    # Extra pyxis mounts; the submit dir, the run dir and the config's data paths are always mounted.
    container_mounts: str | None = None
    # Preemption: Slurm sends USR1 to the batch shell this many seconds before the time limit.
    signal_lead_seconds: int = 300
    requeue: bool = True
    max_requeues: int = 3
    preempt_exit_code: int = PREEMPT_EXIT_CODE
    # How long the launcher waits for the batch step to end after forwarding USR1 (0 = no limit).
    preempt_grace_seconds: int = 0
    python: str = "python"  # interpreter that runs `-m launchers` on the nodes
    # Ray bootstrap
    network_interface: str | None = None
    # Per-job port blocks from this range, derived from the job id and checked free
    # (megatron_arpo.cluster.ports); ray_node_port_base pins node 0's block instead.
    ray_port_range: str = "20000-32000"
    ray_ports_per_node: int = 200
    ray_node_port_base: int | None = None
    ray_gcs_port: int | None = None  # None = inside the head's block
    ray_client_server_port: int | None = None
    ray_log_sync_seconds: int = 60  # copy Ray's node-local session logs to <run_dir>/logs/ray this often
    num_cpus: int | None = None
    object_store_memory: int | None = None
    ready_timeout: float = 300.0
    temp_root: str = "/tmp"
    env: dict[str, str] = field(default_factory=dict)
    extra_sbatch: list[str] = field(default_factory=list)
    setup_commands: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        validate_launcher_options(self)


class LauncherError(InputError):
    """A bad ``launcher`` setting or CLI override (the CLI exits 2)."""


def validate_launcher_options(opts: LauncherOptions) -> None:
    def bad(key: str, value: Any, allowed: str) -> LauncherError:
        return LauncherError(f"launcher.{key}: got {value!r}; allowed: {allowed}")

    for key in ("nodes", "gpus_per_node"):
        value = getattr(opts, key)
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if key == "nodes" else 0):
            raise bad(key, value, "an integer >= 1" if key == "nodes" else "an integer >= 0")
    if not isinstance(opts.max_requeues, int) or opts.max_requeues < 0:
        raise bad("max_requeues", opts.max_requeues, "an integer >= 0")
    if not isinstance(opts.signal_lead_seconds, int) or not 0 <= opts.signal_lead_seconds <= 65535:
        raise bad("signal_lead_seconds", opts.signal_lead_seconds, "an integer in 0..65535 (Slurm's limit)")
    if not isinstance(opts.preempt_exit_code, int) or not 1 <= opts.preempt_exit_code <= 125:
        raise bad("preempt_exit_code", opts.preempt_exit_code, "an integer in 1..125 (126+ mean shell/signal)")
    if not opts.job_name or any(c.isspace() for c in opts.job_name):
        raise bad("job_name", opts.job_name, "a non-empty name without spaces")
    if not opts.run_dir:
        raise bad("run_dir", opts.run_dir, "a directory path")
    if not isinstance(opts.ready_timeout, (int, float)) or opts.ready_timeout <= 0:
        raise bad("ready_timeout", opts.ready_timeout, "a positive number of seconds")
    if not isinstance(opts.env, dict) or not all(isinstance(k, str) for k in opts.env):
        raise bad("env", opts.env, "a mapping of environment variable names to values")
    from megatron_arpo.cluster.allocation import resource_problems
    from megatron_arpo.cluster.ports import parse_port_range

    for problem in resource_problems(opts):
        raise LauncherError(problem)
    try:
        parse_port_range(opts.ray_port_range)
    except ValueError as exc:
        raise LauncherError(str(exc)) from None


def _as_mapping(cfg: Any) -> dict[str, Any]:
    if cfg is None:
        return {}
    if isinstance(cfg, LauncherOptions):
        return dataclasses.asdict(cfg)
    if dataclasses.is_dataclass(cfg) and not isinstance(cfg, type):
        if hasattr(cfg, "launcher"):  # a whole experiment config
            return _as_mapping(getattr(cfg, "launcher"))
        return dataclasses.asdict(cfg)
    if isinstance(cfg, Mapping):
        if "launcher" in cfg:  # a whole experiment config
            return _as_mapping(cfg["launcher"])
        return dict(cfg)
    raise LauncherError(f"launcher config must be a mapping or a dataclass, got {type(cfg).__name__}")


def launcher_options(cfg: Any = None, overrides: Mapping[str, Any] | None = None) -> LauncherOptions:
    """Build validated ``LauncherOptions``; ``overrides`` with value None are ignored (unset CLI flags)."""
    data = _as_mapping(cfg)
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    allowed = {f.name for f in dataclasses.fields(LauncherOptions)}
    unknown = [k for k in data if k not in allowed]
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(allowed), n=1)
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise LauncherError(f"launcher: unknown key(s) {', '.join(hints)}; allowed keys: {sorted(allowed)}")
    return LauncherOptions(**data)
