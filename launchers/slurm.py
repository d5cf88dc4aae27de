"""Render and submit the sbatch script of a multi-node megatron-arpo job.

The script is thin: ``#SBATCH`` lines, exported environment, one ``srun`` step with one task per node
running ``python -m launchers ray-node`` (Ray bootstrap and handshake: ``megatron_arpo.cluster.bootstrap``;
the head node runs the driver command), and a preemption protocol:

1. ``#SBATCH --signal=B:USR1@<lead>`` makes Slurm send USR1 to the batch shell ``lead`` seconds before
   the time limit (an admin or test can send it any time with ``scancel --signal=USR1 --batch``).
2. The shell's trap forwards USR1 to ``srun``, which forwards it to every task; the head's ``ray-node``
   passes it to the driver, workers ignore it. The trainer checkpoints at its next safe point and exits
   with ``preempt_exit_code``.
3. When the step ends with that code, the shell runs ``scontrol requeue $SLURM_JOB_ID`` while
   ``SLURM_RESTART_COUNT`` < ``max_requeues`` (and ``requeue`` is on); the requeued job runs the same
   command, whose ``--resume auto`` picks up the checkpoint. Past the cap it exits with the code.

Any other exit code of the step is the exit code of the job. Per-node logs are
``<run_dir>/logs/<job_name>-<jobid>-node<k>.out``; the batch shell logs to ``<job_name>-<jobid>.out``;
Ray's session logs are copied to ``<run_dir>/logs/ray/<jobid>.<restart>/node<k>/``.

Resources (``launcher.exclusive``, ``cpus_per_task``, ``memory_per_node``): by default the job takes whole
nodes — ``--exclusive``, ``--mem=0`` (all memory) and no CPU count (a step then gets every CPU the job
holds on the node). Without them many sites run the task in a 1-CPU cgroup with ``DefMemPerCPU``, while
Ray would still advertise every host CPU; the bootstrap starts Ray with what the allocation really gives
(``megatron_arpo.cluster.allocation``). Shared nodes need explicit ``cpus_per_task`` and
``memory_per_node`` (the config validation says so). Ray ports come per job from
``launcher.ray_port_range`` (``megatron_arpo.cluster.ports``).

Containers (pyxis, ``launcher.container_image``): the step runs in the image with the submit directory
as its working directory, and the submit directory, the run directory and every absolute data/checkpoint
path of the config mounted at the same paths (``container_mount_paths``), plus ``container_mounts``.
"""

from __future__ import annotations

import logging
import os
import shlex
import subprocess
from pathlib import Path
from typing import Any, Mapping, Sequence

from launchers.options import LauncherOptions, launcher_options
from megatron_arpo.cluster.launch_options import ray_node_args
from megatron_arpo.fsutil import atomic_write

logger = logging.getLogger(__name__)


def default_command(run_dir_var: str = "$RUN_DIR", job: str = "train") -> list[str]:
    """``megatron-arpo train`` (or ``sft``) on the run dir's config, resuming from its newest checkpoint."""
    return ["megatron-arpo", job, "--config", f"{run_dir_var}/config.yaml", "--resume", "auto"]


def _quote_keep_vars(arg: str) -> str:
    """Shell-quote ``arg`` but keep ``$RUN_DIR``-style references expandable (double quotes)."""
    if "$" in arg:
        escaped = arg.replace("\\", "\\\\").replace('"', '\\"').replace("`", "\\`")
        return f'"{escaped}"'
    return shlex.quote(arg)


def _run_dir_expr(run_dir: str) -> str:
    if os.path.isabs(run_dir):
        return shlex.quote(run_dir)
    # Relative run dirs are relative to where sbatch was called (Slurm's default working directory).
    return '"$SUBMIT_DIR"/' + shlex.quote(run_dir)


def log_paths(opts: LauncherOptions, job_id: str, run_dir: str | None = None) -> list[str]:
    """The batch log and one log per node, for a submitted job."""
    logs = Path(run_dir or opts.run_dir) / "logs"
    return [str(logs / f"{opts.job_name}-{job_id}.out")] + [
        str(logs / f"{opts.job_name}-{job_id}-node{k}.out") for k in range(opts.nodes)]


def container_mount_paths(cfg: Any) -> list[str]:
    """Absolute host directories an experiment config reads or writes outside the submit directory
    (relative paths live under it, which the container mounts anyway): checkpoints, data, corpus, outputs."""
    if cfg is None:
        return []
    values = [cfg.model.hf_checkpoint, cfg.model.tokenizer, cfg.data.chat_template, cfg.tools.search.corpus,
              cfg.sft.output_dir, cfg.eval.data_dir, cfg.eval.output_dir,
              *cfg.data.train_files, *cfg.data.val_files, *cfg.sft.train_files]
    if cfg.tools.cache is not None:
        values.append(cfg.tools.cache.path)
    dirs: list[str] = []
    for value in values:
        if not value or not os.path.isabs(value):
            continue
        path = Path(value)
        directory = str(path if path.is_dir() or not path.suffix else path.parent)
        if directory not in dirs:
            dirs.append(directory)
    # A directory inside another one is mounted with it.
    return [d for d in dirs if not any(d != o and d.startswith(o.rstrip("/") + "/") for o in dirs)]


def render_sbatch(cfg: Any = None, cli_overrides: Mapping[str, Any] | None = None,
                  command: Sequence[str] | None = None, mounts: Sequence[str] = ()) -> str:
    """The sbatch script for the launcher config ``cfg`` with CLI overrides applied.

    ``command`` is the driver run on the head node once all Ray nodes registered (default:
    ``megatron-arpo train --config $RUN_DIR/config.yaml --resume auto``); ``$RUN_DIR`` in it expands in
    the job. ``mounts``: host directories the container must see at the same path (data, checkpoints;
    ``container_mount_paths``), besides the submit and run directories.
    """
    opts = cfg if isinstance(cfg, LauncherOptions) and not cli_overrides else launcher_options(cfg, cli_overrides)
    command = list(command) if command else default_command()
    run_dir = opts.run_dir.rstrip("/") or "/"
    batch_log = f"{run_dir}/logs/%x-%j.out"

    sb = [f"--job-name={opts.job_name}", f"--nodes={opts.nodes}", "--ntasks-per-node=1"]
    if opts.gpus_per_node:
        sb.append(f"--gpus-per-node={opts.gpus_per_node}")
    # Resources: without them many sites give the task one CPU and DefMemPerCPU of memory, while Ray
    # would still see the whole host. Default: whole nodes (--exclusive, all CPUs, --mem=0 = all memory).
    if opts.exclusive:
        sb.append("--exclusive")
    if opts.cpus_per_task:
        sb.append(f"--cpus-per-task={opts.cpus_per_task}")
    if opts.memory_per_node is not None:
        sb.append(f"--mem={0 if opts.memory_per_node == 'all' else opts.memory_per_node}")
    for key in ("partition", "account", "qos"):
        if getattr(opts, key):
            sb.append(f"--{key}={getattr(opts, key)}")
    sb += [f"--time={opts.time}", f"--output={batch_log}", "--open-mode=append"]
    if opts.signal_lead_seconds:
        sb.append(f"--signal=B:USR1@{opts.signal_lead_seconds}")
    sb.append("--requeue" if opts.requeue else "--no-requeue")
    sb += list(opts.extra_sbatch)

    srun = ["srun", f"--nodes={opts.nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=0",
            "--open-mode=append", '--output="$RUN_DIR/logs/%x-%j-node%n.out"']
    if opts.cpus_per_task:  # srun >= 22.05 does not inherit --cpus-per-task from sbatch
        srun.append(f"--cpus-per-task={opts.cpus_per_task}")
    # Without -c a step gets every CPU the job holds on each node (the whole node when exclusive).
    if opts.container_image:
        srun += [f"--container-image={shlex.quote(opts.container_image)}", '--container-mounts="$CONTAINER_MOUNTS"',
                 '--container-workdir="$SUBMIT_DIR"']
    node = [opts.python, "-m", "launchers", "ray-node",
            *ray_node_args(opts, run_dir='"$RUN_DIR"',
                           log_template='"$RUN_DIR/logs/${SLURM_JOB_NAME}-${SLURM_JOB_ID}-node{node_id}.out"',
                           quote=shlex.quote)]
    step = srun + [" ".join(node) + " \\\n      -- " + " ".join(_quote_keep_vars(a) for a in command)]

    lines = ["#!/bin/bash", f"# megatron-arpo job '{opts.job_name}': rendered by `megatron-arpo launch slurm`; "
             "edit the YAML, not this file."]
    lines += [f"#SBATCH {line}" for line in sb]
    lines += ["", "set -uo pipefail", 'SUBMIT_DIR="${SLURM_SUBMIT_DIR:-$PWD}"', f"RUN_DIR={_run_dir_expr(run_dir)}",
              f"PREEMPT_EXIT_CODE={opts.preempt_exit_code}", f"MAX_REQUEUES={opts.max_requeues}",
              f"REQUEUE={1 if opts.requeue else 0}", f"PREEMPT_GRACE={opts.preempt_grace_seconds}",
              'RESTART_COUNT="${SLURM_RESTART_COUNT:-0}"',
              "export MEGATRON_ARPO_RUN_DIR=\"$RUN_DIR\""]
    for key, value in opts.env.items():
        lines.append(f"export {key}={shlex.quote(str(value))}")
    if opts.container_image:
        # The container sees the submit dir (relative config paths), the run dir and the data paths at the
        # same paths as the host, and starts in the submit dir.
        parts = [opts.container_mounts] if opts.container_mounts else []
        parts += ['$SUBMIT_DIR:$SUBMIT_DIR', '$RUN_DIR:$RUN_DIR'] + [f"{m}:{m}" for m in mounts]
        lines.append(f'CONTAINER_MOUNTS={_quote_keep_vars(",".join(parts))}')
    lines += list(opts.setup_commands)
    lines += ['mkdir -p "$RUN_DIR/logs"',
              'echo "[launcher] job $SLURM_JOB_ID restart $RESTART_COUNT on $SLURM_JOB_NODELIST; logs in $RUN_DIR/logs"',
              "",
              "# Preemption notice (USR1, --signal=B:USR1@lead): srun forwards it to every task; the head",
              "# passes it to the trainer, which checkpoints and exits with PREEMPT_EXIT_CODE.",
              "STEP_PID=",
              "on_usr1() {",
              '  echo "[launcher] USR1: asking the trainer to checkpoint (srun pid ${STEP_PID:-none})"',
              '  [ -n "$STEP_PID" ] || return 0',
              '  kill -USR1 "$STEP_PID" 2>/dev/null',
              *(["  # launcher.preempt_grace_seconds: a hard limit for the checkpoint (a timeout, not ordering).",
                 '  ( sleep "$PREEMPT_GRACE"; kill -TERM "$STEP_PID" 2>/dev/null ) &']
                if opts.preempt_grace_seconds else []),
              "}",
              "on_term() {",
              '  echo "[launcher] TERM: stopping the job step"',
              '  [ -n "$STEP_PID" ] && kill -TERM "$STEP_PID" 2>/dev/null',
              "}",
              "trap on_usr1 USR1",
              "trap on_term TERM",
              "",
              " \\\n    ".join(step) + " &",
              "STEP_PID=$!",
              "# `wait` returns early whenever a trapped signal arrives: wait again until srun has ended.",
              "while true; do",
              '  wait "$STEP_PID"; CODE=$?',
              '  kill -0 "$STEP_PID" 2>/dev/null || break',
              "done",
              'echo "[launcher] job step exited with code $CODE"',
              'if [ "$CODE" -eq "$PREEMPT_EXIT_CODE" ]; then',
              '  if [ "$REQUEUE" -eq 1 ] && [ "$RESTART_COUNT" -lt "$MAX_REQUEUES" ]; then',
              '    echo "[launcher] trainer checkpointed for preemption: requeueing (restart $((RESTART_COUNT + 1)) of at most $MAX_REQUEUES)"',
              '    scontrol requeue "$SLURM_JOB_ID" && exit 0',
              '    echo "[launcher] scontrol requeue failed; resubmit by hand to resume"',
              "  else",
              '    echo "[launcher] trainer checkpointed for preemption; not requeueing (requeue=$REQUEUE, restarts $RESTART_COUNT, max $MAX_REQUEUES)"',
              "  fi",
              "fi",
              'exit "$CODE"',
              ""]
    return "\n".join(lines)


def submit(script: str, run_dir: str | os.PathLike, job_name: str = "megatron-arpo",
           sbatch_args: Sequence[str] = (), env: Mapping[str, str] | None = None) -> str:
    """Write ``script`` to ``<run_dir>/<job_name>.sbatch``, ``sbatch --parsable`` it; return the job id."""
    run_dir = Path(run_dir)
    (run_dir / "logs").mkdir(parents=True, exist_ok=True)
    path = run_dir / f"{job_name}.sbatch"
    with atomic_write(path) as fh:
        fh.write(script)
    cmd = ["sbatch", "--parsable", *sbatch_args, str(path)]
    result = subprocess.run(cmd, capture_output=True, text=True, env=None if env is None else dict(env))
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {result.returncode}: {result.stderr.strip()}")
    job_id = result.stdout.strip().split(";")[0]
    if not job_id.isdigit():
        raise RuntimeError(f"sbatch printed {result.stdout!r}; expected a job id")
    logger.info("submitted job %s (script %s)", job_id, path)
    return job_id
