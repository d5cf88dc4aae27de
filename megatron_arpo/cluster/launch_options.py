"""The ``launcher`` section of an experiment config: Slurm and Ray launch knobs, with their defaults.

The one definition of these settings. The experiment config (:mod:`megatron_arpo.config_schema`) composes
:class:`LauncherSection`; the launchers extend it with the run directory and validate it
(``launchers.options.LauncherOptions``); the cluster helpers (ports, allocation) read its fields. Time is
Slurm's format (``HH:MM:SS`` or ``D-HH:MM:SS``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_arpo.config_field import setting

# Exit code of a trainer that saved a checkpoint because it was told to stop (SIGUSR1) and wants the job
# requeued. The trainer (megatron_arpo.train) must use the same value; it is configurable here.
PREEMPT_EXIT_CODE = 42


# Flat: ``launchers.options.LauncherOptions`` is this section plus ``run_dir`` (from ``trainer.run_dir``).
# The ray_* ports are megatron_arpo.cluster.ports.PortPlan: per-job blocks from ray_port_range, derived
# from the Slurm job id and checked free; ray_node_port_base pins node k to base + k * ray_ports_per_node.
@dataclass(frozen=True)
class LauncherSection:
    nodes: int = setting(1, ge=1)
    gpus_per_node: int = setting(8, ge=0, help="0 = CPU-only nodes")
    cpus_per_task: Optional[int] = setting(None, ge=1, help="CPUs of the one task per node; null = all (needs exclusive)")
    memory_per_node: Optional[str] = setting("all", help="all = --mem=0 (the whole node), a Slurm size (480G), null = site default")
    exclusive: bool = setting(True, help="--exclusive: whole nodes (other jobs' processes would share the GPUs' CPUs)")
    partition: Optional[str] = setting(None)
    account: Optional[str] = setting(None)
    qos: Optional[str] = setting(None)
    time: str = setting("24:00:00", help="Slurm time limit (HH:MM:SS or D-HH:MM:SS); quote it in YAML")
    job_name: str = setting("megatron-arpo")
    container_image: Optional[str] = setting(None, help="pyxis/enroot: srun --container-image")
    container_mounts: Optional[str] = setting(None, help="extra pyxis mounts; submit dir, run dir and data paths are added")
    signal_lead_seconds: int = setting(300, ge=0, le=65535, help="USR1 this long before the time limit")
    requeue: bool = setting(True, help="requeue after a preemption checkpoint")
    max_requeues: int = setting(3, ge=0)
    preempt_exit_code: int = setting(PREEMPT_EXIT_CODE, ge=1, le=125, help="trainer exit code meaning 'checkpointed, requeue me'")
    preempt_grace_seconds: int = setting(0, ge=0, help="wait for the step after forwarding USR1; 0 = no limit")
    python: str = setting("python", help="interpreter that runs `-m launchers` on the nodes")
    network_interface: Optional[str] = setting(None, help="NCCL/GLOO_SOCKET_IFNAME; null = env, default route")
    ray_port_range: str = setting("20000-32000", help="LO-HI: per-job port blocks, derived from the job id, checked free")
    ray_ports_per_node: int = setting(200, ge=20, help="10 service ports + worker ports per node")
    ray_node_port_base: Optional[int] = setting(None, ge=1024, le=65535, help="pin node 0's block here; null = per job")
    ray_gcs_port: Optional[int] = setting(None, ge=1024, le=65535, help="null = inside the head's block")
    ray_client_server_port: Optional[int] = setting(None, ge=1024, le=65535, help="null = inside the head's block")
    ray_log_sync_seconds: int = setting(60, ge=0, help="copy Ray session logs to <run_dir>/logs/ray this often; 0 = at the end")
    num_cpus: Optional[int] = setting(None, ge=1, help="CPUs Ray advertises per node; null = detected")
    object_store_memory: Optional[int] = setting(None, ge=1, help="bytes per node; null = Ray default")
    ready_timeout: float = setting(300.0, gt=0, help="seconds to wait for the head address and for all nodes")
    temp_root: str = setting("/tmp", help="per-node Ray temp dirs go under it (keep it short: socket paths)")
    env: dict[str, str] = setting(factory=dict, help="extra non-secret env vars exported on every node")
    extra_sbatch: list[str] = setting(factory=list, help="extra '#SBATCH' options, e.g. --exclusive")
    setup_commands: list[str] = setting(factory=list, help="shell lines run on every node before Ray starts")


def ray_node_args(opts, *, run_dir: str, log_template: str, quote=lambda text: text,
                  detect_gpus: bool = False) -> list[str]:
    """The ``python -m launchers ray-node`` options for a launcher config: the port plan, timeouts,
    temp root, NIC, resources and where Ray's session logs are copied. The sbatch script renders them
    (``quote=shlex.quote``, shell variables in ``run_dir``/``log_template``); ``connect_ray`` passes them
    to srun as a plain argv; ``launch local`` too, with ``detect_gpus`` (Ray counts this host's GPUs
    unless the config says 0)."""
    args = [f"--run-dir={run_dir}", f"--port-range={opts.ray_port_range}", f"--ports-per-node={opts.ray_ports_per_node}"]
    for key, flag in (("ray_node_port_base", "node-port-base"), ("ray_gcs_port", "gcs-port"),
                      ("ray_client_server_port", "client-server-port")):
        if getattr(opts, key) is not None:
            args.append(f"--{flag}={getattr(opts, key)}")
    args += [f"--ready-timeout={opts.ready_timeout:g}", f"--temp-root={quote(opts.temp_root)}",
             f"--node-log-template={log_template}", f"--ray-log-dir={run_dir}/logs/ray",
             f"--log-sync-seconds={opts.ray_log_sync_seconds}"]
    if opts.network_interface:
        args.append(f"--interface={quote(opts.network_interface)}")
    if opts.num_cpus is not None:
        args.append(f"--num-cpus={opts.num_cpus}")
    if not detect_gpus or opts.gpus_per_node == 0:
        args.append(f"--num-gpus={opts.gpus_per_node}")
    if opts.object_store_memory is not None:
        args.append(f"--object-store-memory={opts.object_store_memory}")
    return args
