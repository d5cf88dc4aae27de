"""``megatron-arpo launch`` and ``megatron-arpo plan`` (also ``python -m launchers``, which the sbatch script runs).

``launch`` subcommands:
- ``slurm --config X.yaml [--nodes N --gpus-per-node G --partition P --account A --time T --container IMG]
  [--job train|sft] [--dry-run] [--no-preflight]``: render the sbatch script from the config's ``launcher``
  section (dry run: print it); otherwise run the job's pre-flight checks (``megatron_arpo.preflight``:
  refuse with every problem, exit 2), copy the config to ``<run_dir>/config.yaml``, write the script
  there, submit it, and print the job id, the log paths and how to follow and cancel the job.
- ``local --config X.yaml [--nodes N] [--set a.b=c] [--command CMD] [--dry-run] [--no-preflight]``: the
  same pre-flight, then start N Ray nodes on this host (``launchers.local``), run the job (default
  ``megatron-arpo train``) on them, return its exit code, stop what was started.
- ``ray-node [--run-dir D ...] [-- DRIVER ...]``: what each srun task runs: join or create the Ray
  cluster of this Slurm allocation (node role from ``SLURM_NODEID``), and on the head run the driver.
- ``plan``: a deprecated alias of ``megatron-arpo plan``.

``plan --config X.yaml | --model-config M [--gpu h100-80g] [--nodes N --gpus-per-node G] [--measure]``: the
per-GPU memory plan; ``--measure`` runs the worst pipeline stage at real shapes on fake CUDA
(``launchers.measure``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import shlex
import sys
from pathlib import Path
from typing import Any, Sequence

from megatron_arpo.command_args import PROG, DeprecatedAlias
from megatron_arpo.config import ConfigError, load_config, read_yaml_file
from megatron_arpo.errors import InputError
from megatron_arpo.fsutil import atomic_write

logger = logging.getLogger(__name__)

SLURM_FLAGS = {  # CLI flag -> (type, help); each overrides the launcher option of the same name
    "nodes": (int, "nodes to allocate (default: launcher.nodes)"),
    "gpus_per_node": (int, "GPUs per node (default: launcher.gpus_per_node)"),
    "partition": (str, "Slurm partition (default: launcher.partition)"),
    "account": (str, "Slurm account (default: launcher.account)"),
    "time": (str, "time limit, e.g. 48:00:00 (default: launcher.time)"),
    "container_image": (str, "pyxis container image the step runs in (default: launcher.container_image)"),
    "job_name": (str, "Slurm job name (default: launcher.job_name)"),
    "run_dir": (str, "run directory: config, script, logs, checkpoints (default: trainer.run_dir, else runs/NAME)"),
}
PREFLIGHT_JOBS = ("train", "sft", "eval")


def _load_yaml(path: str) -> dict[str, Any]:
    data = read_yaml_file(path, "config file") or {}
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: expected a mapping at the top level, got {type(data).__name__}"])
    return data


def _add_slurm(sub) -> None:
    p = sub.add_parser("slurm", help="render (--dry-run) or submit the sbatch script of a multi-node job",
                       description="Check the job (pre-flight), then write and submit its sbatch script.")
    p.add_argument("--config", required=True, metavar="YAML", help="experiment YAML with a `launcher:` section")
    for name, (kind, help_text) in SLURM_FLAGS.items():
        flag = "--container" if name == "container_image" else f"--{name.replace('_', '-')}"
        p.add_argument(flag, dest=name, type=kind, default=None, help=help_text)
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set rollout.n=8 (repeatable)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the script; submit nothing and skip the pre-flight (`megatron-arpo config validate "
                        "--paths train` runs it)")
    _add_no_preflight(p)
    p.add_argument("--job", choices=("train", "sft"), default="train",
                   help="what the head node runs: `megatron-arpo train` (RL, default) or `megatron-arpo sft` "
                        "(cold-start SFT on the same actor group), each with --config $RUN_DIR/config.yaml "
                        "--resume auto")
    p.add_argument("--command", default=None, help="any other driver command run on the head node ($RUN_DIR "
                                                   "expands to the run directory)")


def _add_no_preflight(p) -> None:
    p.add_argument("--no-preflight", action="store_true",
                   help="skip the pre-flight checks (paths, checkpoint vs model.config, tokenizer, tools, sandbox, "
                        "retriever, data); default: run them and refuse with every problem found")


def job_of(command: Sequence[str]) -> str | None:
    """``train``/``sft``/``eval`` when ``command`` runs that megatron-arpo command, else None."""
    for i, word in enumerate(command[:-1]):
        if Path(word).name == "megatron-arpo" or (word == "-m" and command[i + 1] == "megatron_arpo"):
            following = command[i + 1:] if word != "-m" else command[i + 2:]
            if following and following[0] in PREFLIGHT_JOBS:
                return following[0]
    return None


def run_preflight(cfg, command: Sequence[str], skip: bool) -> None:
    """The pre-flight of the job ``command`` runs; PreflightError (exit 2) listing every problem."""
    # deferred: pulls in asyncio, ctypes, urllib, which this module's importers need not load
    from megatron_arpo.preflight import preflight

    job = job_of(command)
    if skip:
        logger.warning("pre-flight skipped (--no-preflight): problems surface when the job starts")
    elif job is None:
        logger.info("the job command is not `megatron-arpo train|sft|eval`: no pre-flight")
    else:
        preflight(cfg, job)


def _run_slurm(args) -> int:
    # deferred: only this subcommand needs it (keeps `launch --help` light)
    from launchers.options import launcher_options
    from launchers.slurm import container_mount_paths, default_command, log_paths, render_sbatch, submit

    cfg = load_config(args.config, args.set or ())
    overrides = {"run_dir": str(cfg.run_dir)}
    overrides.update({k: getattr(args, k) for k in SLURM_FLAGS if getattr(args, k) is not None})
    opts = launcher_options(cfg.launcher, overrides)
    command = shlex.split(args.command) if args.command else default_command(job=args.job)
    mounts = container_mount_paths(cfg)
    if args.dry_run:
        print(render_sbatch(opts, command=command, mounts=mounts))
        return 0
    run_preflight(cfg, command, args.no_preflight)
    run_dir = Path(opts.run_dir).resolve()
    opts = dataclasses.replace(opts, run_dir=str(run_dir))
    run_dir.mkdir(parents=True, exist_ok=True)
    # The job trains from the resolved config (base: chains and --set applied), written atomically.
    with atomic_write(run_dir / "config.yaml") as fh:
        fh.write(cfg.dump_yaml())
    job_id = submit(render_sbatch(opts, command=command, mounts=mounts), run_dir, opts.job_name)
    print(f"submitted job {job_id}")
    print(f"script: {run_dir / (opts.job_name + '.sbatch')}")
    logs = log_paths(opts, job_id, str(run_dir))
    for path in logs:
        print(f"log: {path}")
    print(f"follow: tail -F {shlex.quote(logs[1] if len(logs) > 1 else logs[0])}   (the head node: driver and "
          f"trainer); queue state: squeue -j {job_id}")
    print(f"cancel: scancel {job_id}")
    return 0


def _add_local(sub) -> None:
    p = sub.add_parser("local", help="start a Ray cluster on this host and run the job on it",
                       description="Check the job (pre-flight), start Ray nodes on this host, run the job on them.")
    p.add_argument("--config", required=True, metavar="YAML", help="experiment YAML")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="override one config key, e.g. --set rollout.n=8 (repeatable)")
    p.add_argument("--nodes", type=int, default=1,
                   help="Ray nodes (raylets) to start on this host, each with its own ports and temp dir (default: "
                        "%(default)s)")
    p.add_argument("--dry-run", action="store_true",
                   help="print the node and job commands; start nothing and skip the pre-flight")
    p.add_argument("--command", default=None,
                   help="job command (default: megatron-arpo train --config $RUN_DIR/config.yaml --resume auto); "
                        "the pre-flight runs for a megatron-arpo train|sft|eval command only")
    _add_no_preflight(p)


def _run_local(args) -> int:
    # deferred: only this subcommand needs it (keeps `launch --help` light)
    from launchers.local import launch_local

    command = shlex.split(args.command) if args.command else None
    return launch_local(args.config, args.set or (), num_nodes=args.nodes, command=command, dry_run=args.dry_run,
                        check=lambda cfg, job: run_preflight(cfg, job, args.no_preflight))


def _add_ray_node(sub) -> None:
    p = sub.add_parser("ray-node", help="bootstrap this node's part of the Ray cluster (run by srun)")
    p.add_argument("--run-dir", default=os.environ.get("MEGATRON_ARPO_RUN_DIR", "."),
                   help="the job's run directory (default: $MEGATRON_ARPO_RUN_DIR, else .)")
    p.add_argument("--num-nodes", type=int, default=None, help="nodes of the job (default: SLURM_NNODES)")
    p.add_argument("--node-id", type=int, default=None, help="this node's index, 0 = head (default: SLURM_NODEID)")
    p.add_argument("--job-id", default=None, help="default: SLURM_JOB_ID")
    p.add_argument("--port-range", default="20000-32000",
                   help="LO-HI: this job's port blocks are derived from the job id inside it and checked free "
                        "(default: %(default)s)")
    p.add_argument("--ports-per-node", type=int, default=200, help="ports in each node's block (default: %(default)s)")
    p.add_argument("--node-port-base", type=int, default=None, help="pin node 0's block here (no derivation)")
    p.add_argument("--gcs-port", type=int, default=None, help="default: inside the head's block")
    p.add_argument("--client-server-port", type=int, default=None, help="default: inside the head's block")
    p.add_argument("--log-sync-seconds", type=float, default=60.0,
                   help="copy Ray's session logs to <run-dir>/logs/ray this often (0: only at the end; default: "
                        "%(default)s)")
    p.add_argument("--ray-log-dir", default=None, help="default: <run-dir>/logs/ray")
    p.add_argument("--interface", default=None, help="NIC for Ray/NCCL/Gloo (default: NCCL_SOCKET_IFNAME, "
                                                     "GLOO_SOCKET_IFNAME, default route, lo)")
    p.add_argument("--num-cpus", type=int, default=None, help="CPUs Ray advertises (default: what the allocation gives)")
    p.add_argument("--num-gpus", type=int, default=None, help="GPUs Ray advertises (default: the visible ones)")
    p.add_argument("--object-store-memory", type=int, default=None, help="bytes (default: Ray's own choice)")
    p.add_argument("--ready-timeout", type=float, default=300.0,
                   help="seconds to wait for every node to join (default: %(default)s)")
    p.add_argument("--temp-root", default="/tmp", help="parent of Ray's temp directory (default: %(default)s)")
    p.add_argument("--node-log-template", default="",
                   help="per-node log path with {node_id} (default: none, the step's output)")
    p.add_argument("driver", nargs=argparse.REMAINDER, help="-- command the head node runs")


def _run_ray_node(args) -> int:
    # deferred: only this subcommand needs it (keeps `launch --help` light)
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
        print(f"{PROG} launch ray-node: error: {exc}", file=sys.stderr, flush=True)
        return 2
    try:
        return run_ray_node(opts, driver)
    except (TimeoutError, RuntimeError, ValueError) as exc:
        logger.error("%s", exc)
        print(f"{PROG} launch ray-node (node {opts.node_id}): error: {exc}", file=sys.stderr, flush=True)
        return 2


def add_plan_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", default=None, metavar="YAML", help="experiment YAML (model, actor, rollout sections)")
    p.add_argument("--model-config", dest="model", default=None, metavar="NAME",
                   help="model config name or YAML (default: model.config of --config)")
    p.add_argument("--model", dest="model", metavar="NAME", action=DeprecatedAlias, new="--model-config")
    p.add_argument("--gpu", default="h100-80g", help="GPU type: h100-80g, h200-141g, a100-80g, ... (default: %(default)s)")
    p.add_argument("--nodes", type=int, default=None, help="default: launcher.nodes of --config")
    p.add_argument("--gpus-per-node", type=int, default=None, help="default: launcher.gpus_per_node of --config")
    p.add_argument("--tp", type=int, default=None, help="actor tensor parallel (default: the config's)")
    p.add_argument("--pp", type=int, default=None, help="actor pipeline parallel (default: the config's)")
    p.add_argument("--engine-tp", type=int, default=None, help="rollout engine tensor parallel (default: the config's)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("--measure", action="store_true",
                   help="measure the actor's peak memory on fake CUDA at real shapes (a minute per stage)")
    p.add_argument("--stages", default="worst",
                   help="with --measure: 'worst' (the formula's worst stage), 'all', or a stage number "
                        "(default: %(default)s)")


def _add_plan(sub) -> None:
    p = sub.add_parser("plan", help=f"deprecated alias of `{PROG} plan`")
    add_plan_arguments(p)


def _run_plan(args) -> int:
    # deferred: only this subcommand needs it (keeps `launch --help` light)
    from launchers.planner import format_plan, make_plan, plan_input_from_config

    if args.cmd == "plan":
        print(f"{PROG} launch plan: warning: deprecated; use `{PROG} plan`", file=sys.stderr)
    cfg = _load_yaml(args.config) if args.config else {}
    try:
        inputs = plan_input_from_config(cfg, model=args.model, gpu=args.gpu, nodes=args.nodes,
                                        gpus_per_node=args.gpus_per_node, tp=args.tp, pp=args.pp,
                                        engine_tp=args.engine_tp)
        result = make_plan(inputs)
    except (ValueError, FileNotFoundError) as exc:
        raise InputError(str(exc)) from exc
    measured = None
    if args.measure:
        # deferred: only this subcommand needs it (keeps `launch --help` light)
        from launchers.measure import as_dict, format_measured, measure

        try:
            measured = measure(cfg, inputs, result, stages=args.stages, model=args.model)
        except (ValueError, RuntimeError) as exc:
            raise InputError(f"--measure: {exc}") from exc
    if args.json:
        out = result.to_dict() | ({"measured": as_dict(measured)} if measured else {})
        print(json.dumps(out, indent=2))
    else:
        print(format_plan(result))
        if measured:
            print(format_measured(measured))
    return 0 if (measured["fits"] if measured else result.fits) else 1


def build_parser() -> argparse.ArgumentParser:
    """``megatron-arpo launch``'s parser (``python -m launchers`` is the same command)."""
    parser = argparse.ArgumentParser(prog=f"{PROG} launch", description="Launch a job: slurm (sbatch, multi-node) "
                                                                       "or local (Ray on this host).")
    sub = parser.add_subparsers(dest="cmd", required=True, metavar="{slurm,local,ray-node}")
    _add_slurm(sub)
    _add_local(sub)
    _add_ray_node(sub)
    _add_plan(sub)
    return parser


def build_plan_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=f"{PROG} plan", description="Per-GPU memory plan of the actor and the "
                                                                     "rollout engines: does this config fit?")
    add_plan_arguments(parser)
    parser.set_defaults(cmd="memory-plan")
    return parser


def _dispatch(args, prog: str) -> int:
    handlers = {"slurm": _run_slurm, "local": _run_local, "ray-node": _run_ray_node, "plan": _run_plan,
                "memory-plan": _run_plan}
    try:
        return handlers[args.cmd](args)
    except InputError as exc:  # a bad config or launcher option: one message, exit 2 (as `megatron-arpo` does)
        print(f"{prog}: error: {exc}", file=sys.stderr)
        return 2


def _setup_logging() -> None:
    logging.basicConfig(level=os.environ.get("MEGATRON_ARPO_LOG_LEVEL", "INFO"),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")


def main(argv: Sequence[str] | None = None) -> int:
    _setup_logging()
    args = build_parser().parse_args(argv)
    return _dispatch(args, f"{PROG} launch {args.cmd}")


def launch_main(argv: Sequence[str]) -> int:
    """``megatron-arpo launch slurm|local|ray-node ...``."""
    return main(list(argv))


def plan_main(argv: Sequence[str]) -> int:
    """``megatron-arpo plan ...``: the memory planner."""
    _setup_logging()
    return _dispatch(build_plan_parser().parse_args(list(argv)), f"{PROG} plan")
