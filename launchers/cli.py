"""``python -m launchers``: the launcher CLI (also reachable as ``megatron-arpo launch|plan``).

Subcommands:
- ``slurm --config X.yaml [--nodes N --gpus-per-node G --partition P --account A --time T --container IMG]
  [--job train|sft] [--dry-run]``: render the sbatch script from the config's ``launcher`` section (dry run: print it),
  otherwise copy the config to ``<run_dir>/config.yaml``, write the script there, submit it, print the
  job id and the log paths.
- ``local --config X.yaml [--nodes N] [--set a.b=c] [--command CMD] [--dry-run]``: start N Ray nodes on
  this host (``launchers.local``), run the job (default ``megatron-arpo train``) on them, return its exit
  code, stop what was started.
- ``ray-node [--run-dir D ...] [-- DRIVER ...]``: what each srun task runs: join or create the Ray
  cluster of this Slurm allocation (node role from ``SLURM_NODEID``), and on the head run the driver.
- ``plan --config X.yaml | --model M [--gpu h100-80g] [--nodes N --gpus-per-node G] [--measure]``: memory
  plan; ``--measure`` runs the worst pipeline stage at real shapes on fake CUDA (``launchers.measure``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
from pathlib import Path
from typing import Any, Sequence

from megatron_arpo.errors import InputError
from megatron_arpo.fsutil import atomic_write

logger = logging.getLogger(__name__)

SLURM_FLAGS = {  # CLI flag -> launcher option
    "nodes": int, "gpus_per_node": int, "partition": str, "account": str, "time": str,
    "container_image": str, "job_name": str, "run_dir": str,
}


def _load_yaml(path: str) -> dict[str, Any]:
    from megatron_arpo.config import ConfigError, read_yaml_file

    data = read_yaml_file(path, "config file") or {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping at the top level, got {type(data).__name__}"])
    return data


def _add_slurm(sub) -> None:
    p = sub.add_parser("slurm", help="render (--dry-run) or submit the sbatch script of a multi-node job")
    p.add_argument("--config", required=True, help="experiment YAML with a `launcher:` section")
    for name, kind in SLURM_FLAGS.items():
        flag = "--container" if name == "container_image" else f"--{name.replace('_', '-')}"
        p.add_argument(flag, dest=name, type=kind, default=None)
    p.add_argument("--set", action="append", default=[], metavar="a.b=c", help="config override (repeatable)")
    p.add_argument("--dry-run", action="store_true", help="print the script; submit nothing")
    p.add_argument("--job", choices=("train", "sft"), default="train",
                   help="what the head node runs: `megatron-arpo train` (RL, default) or `megatron-arpo sft` "
                        "(cold-start SFT on the same actor group), each with --config $RUN_DIR/config.yaml "
                        "--resume auto")
    p.add_argument("--command", default=None, help="any other driver command run on the head node ($RUN_DIR "
                                                   "expands to the run directory)")


def _run_slurm(args) -> int:
    import shlex

    from launchers.options import launcher_options
    from launchers.slurm import container_mount_paths, default_command, log_paths, render_sbatch, submit

    from megatron_arpo.config import load_config

    cfg = load_config(args.config, args.set or ())
    overrides = {"run_dir": str(cfg.run_dir)}
    overrides.update({k: getattr(args, k) for k in SLURM_FLAGS if getattr(args, k) is not None})
    opts = launcher_options(cfg.launcher, overrides)
    command = shlex.split(args.command) if args.command else default_command(job=args.job)
    mounts = container_mount_paths(cfg)
    if args.dry_run:
        print(render_sbatch(opts, command=command, mounts=mounts))
        return 0
    run_dir = Path(opts.run_dir).resolve()
    opts = dataclasses.replace(opts, run_dir=str(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    # The job trains from the resolved config (base: chains and --set applied), written atomically.
    with atomic_write(run_dir / "config.yaml") as fh:
        fh.write(cfg.dump_yaml())
    job_id = submit(render_sbatch(opts, command=command, mounts=mounts), run_dir, opts.job_name)
    print(f"submitted job {job_id}")
    print(f"script: {run_dir / (opts.job_name + '.sbatch')}")
    for path in log_paths(opts, job_id, str(run_dir)):
        print(f"log: {path}")
    return 0


def _add_local(sub) -> None:
    p = sub.add_parser("local", help="start a Ray cluster on this host and run the job on it")
    p.add_argument("--config", required=True, help="experiment YAML")
    p.add_argument("--set", action="append", default=[], metavar="a.b=c", help="config override (repeatable)")
    p.add_argument("--nodes", type=int, default=1,
                   help="Ray nodes (raylets) to start on this host, each with its own ports and temp dir")
    p.add_argument("--dry-run", action="store_true", help="print the node and job commands; start nothing")
    p.add_argument("--command", default=None,
                   help="job command (default: megatron-arpo train --config $RUN_DIR/config.yaml --resume auto)")


def _run_local(args) -> int:
    import shlex

    from launchers.local import launch_local

    command = shlex.split(args.command) if args.command else None
    return launch_local(args.config, args.set or (), num_nodes=args.nodes, command=command, dry_run=args.dry_run)


def _add_ray_node(sub) -> None:
    p = sub.add_parser("ray-node", help="bootstrap this node's part of the Ray cluster (run by srun)")
    p.add_argument("--run-dir", default=os.environ.get("MEGATRON_ARPO_RUN_DIR", "."))
    p.add_argument("--num-nodes", type=int, default=None, help="default: SLURM_NNODES")
    p.add_argument("--node-id", type=int, default=None, help="default: SLURM_NODEID")
    p.add_argument("--job-id", default=None, help="default: SLURM_JOB_ID")
    p.add_argument("--port-range", default="20000-32000",
                   help="LO-HI: this job's port blocks are derived from the job id inside it and checked free")
    p.add_argument("--ports-per-node", type=int, default=200)
    p.add_argument("--node-port-base", type=int, default=None, help="pin node 0's block here (no derivation)")
    p.add_argument("--gcs-port", type=int, default=None, help="default: inside the head's block")
    p.add_argument("--client-server-port", type=int, default=None, help="default: inside the head's block")
    p.add_argument("--log-sync-seconds", type=float, default=60.0,
                   help="copy Ray's session logs to <run-dir>/logs/ray this often (0: only at the end)")
    p.add_argument("--ray-log-dir", default=None, help="default: <run-dir>/logs/ray")
    p.add_argument("--interface", default=None, help="NIC for Ray/NCCL/Gloo (default: NCCL_SOCKET_IFNAME, "
                                                     "GLOO_SOCKET_IFNAME, default route, lo)")
    p.add_argument("--num-cpus", type=int, default=None)
    p.add_argument("--num-gpus", type=int, default=None)
    p.add_argument("--object-store-memory", type=int, default=None)
    p.add_argument("--ready-timeout", type=float, default=300.0)
    p.add_argument("--temp-root", default="/tmp")
    p.add_argument("--node-log-template", default="")
    p.add_argument("driver", nargs=argparse.REMAINDER, help="-- command the head node runs")


def _run_ray_node(args) -> int:
    from megatron_arpo.cluster.bootstrap import NodeOptions, PortPlan, run_ray_node
    from megatron_arpo.cluster.ports import parse_port_range

    driver = list(args.driver)
    if driver and driver[0] == "--":
        driver = driver[1:]
    try:
        opts = NodeOptions.from_slurm_env(
            args.run_dir, num_nodes=args.num_nodes, node_id=args.node_id, job_id=args.job_id,
            ports=PortPlan(ports_per_node=args.ports_per_node, port_range=parse_port_range(args.port_range),
                           node_port_base=args.node_port_base, gcs_port=args.gcs_port,
                           client_server_port=args.client_server_port),
            interface=args.interface, num_cpus=args.num_cpus, num_gpus=args.num_gpus,
            object_store_memory=args.object_store_memory, ready_timeout=args.ready_timeout,
            temp_root=args.temp_root, node_log_template=args.node_log_template,
            log_sync_seconds=args.log_sync_seconds, ray_log_root=args.ray_log_dir)
    except ValueError as exc:
        print(f"[ray-node] ERROR: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        return run_ray_node(opts, driver)
    except (TimeoutError, RuntimeError, ValueError) as exc:
        logger.error("%s", exc)
        print(f"[ray-node {opts.node_id}] ERROR: {exc}", file=sys.stderr, flush=True)
        return 2


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help="per-GPU memory plan for the actor and rollout engines")
    p.add_argument("--config", default=None, help="experiment YAML (model, actor, rollout sections)")
    p.add_argument("--model", default=None, help="model config name or YAML (default: from --config)")
    p.add_argument("--gpu", default="h100-80g")
    p.add_argument("--nodes", type=int, default=None)
    p.add_argument("--gpus-per-node", type=int, default=None)
    p.add_argument("--tp", type=int, default=None, help="actor tensor parallel")
    p.add_argument("--pp", type=int, default=None, help="actor pipeline parallel")
    p.add_argument("--engine-tp", type=int, default=None, help="rollout engine tensor parallel")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--measure", action="store_true",
                   help="measure the actor's peak memory on fake CUDA at real shapes (a minute per stage)")
    p.add_argument("--stages", default="worst",
                   help="with --measure: 'worst' (the formula's worst stage), 'all', or a stage number")


def _run_plan(args) -> int:
    from launchers.planner import format_plan, make_plan, plan_input_from_config

    cfg = _load_yaml(args.config) if args.config else {}
    try:
        inputs = plan_input_from_config(cfg, model=args.model, gpu=args.gpu, nodes=args.nodes,
                                        gpus_per_node=args.gpus_per_node, tp=args.tp, pp=args.pp,
                                        engine_tp=args.engine_tp)
        result = make_plan(inputs)
    except (ValueError, FileNotFoundError) as exc:
        print(f"plan: {exc}", file=sys.stderr)
        return 2
    measured = None
    if args.measure:
        from launchers.measure import as_dict, format_measured, measure

        try:
            measured = measure(cfg, inputs, result, stages=args.stages, model=args.model)
        except (ValueError, RuntimeError) as exc:
            print(f"plan --measure: {exc}", file=sys.stderr)
            return 2
    if args.json:
        out = result.to_dict() | ({"measured": as_dict(measured)} if measured else {})
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(result))
        if measured:
            print(format_measured(measured))
    return 0 if (measured["fits"] if measured else result.fits) else 1


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m launchers", description=__doc__.split("\n")[0])
    sub = parser.add_subparsers(dest="cmd", required=True)
    _add_slurm(sub)
    _add_local(sub)
    _add_ray_node(sub)
    _add_plan(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=os.environ.get("MEGATRON_ARPO_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    args = build_parser().parse_args(argv)
    handlers = {"slurm": _run_slurm, "local": _run_local, "ray-node": _run_ray_node, "plan": _run_plan}
    try:
        return handlers[args.cmd](args)
    except InputError as exc:  # a bad config or launcher option: one line, exit 2 (as `megatron-arpo` does)
        print(f"python -m launchers {args.cmd}: error: {exc}", file=sys.stderr)
        return 2


def launch_main(argv: Sequence[str]) -> int:
    """``megatron-arpo launch slurm|local|ray-node ...``."""
    return main(list(argv))


def plan_main(argv: Sequence[str]) -> int:
    """``megatron-arpo plan ...``: the memory planner."""
    return main(["plan", *argv])
