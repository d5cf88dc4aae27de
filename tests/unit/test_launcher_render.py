"""sbatch rendering (`--dry-run`): key lines, overrides, validation, and a script bash accepts."""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import subprocess
import sys
from pathlib import Path

import pytest

from launchers.options import LauncherOptions, launcher_options
from launchers.slurm import log_paths, render_sbatch

REPO_ROOT = Path(__file__).resolve().parents[2]


def _lines(script: str) -> list[str]:
    return script.splitlines()


def test_sbatch_header_from_config_and_cli_overrides():
    cfg = {"launcher": {"nodes": 2, "gpus_per_node": 8, "partition": "batch", "time": "04:00:00",
                        "job_name": "qwq", "signal_lead_seconds": 600, "max_requeues": 5}}
    script = render_sbatch(cfg, {"nodes": 4, "account": "proj42", "partition": None})
    header = [line for line in _lines(script) if line.startswith("#SBATCH")]
    assert header[:3] == ["#SBATCH --job-name=qwq", "#SBATCH --nodes=4", "#SBATCH --ntasks-per-node=1"]
    for line in ("#SBATCH --gpus-per-node=8", "#SBATCH --partition=batch", "#SBATCH --account=proj42",
                 "#SBATCH --time=04:00:00", "#SBATCH --signal=B:USR1@600", "#SBATCH --requeue",
                 "#SBATCH --output=runs/megatron-arpo/logs/%x-%j.out", "#SBATCH --open-mode=append"):
        assert line in header
    assert "MAX_REQUEUES=5" in script and "PREEMPT_EXIT_CODE=42" in script


def test_one_srun_task_per_node_with_per_node_logs_and_default_trainer_command():
    script = render_sbatch({"nodes": 3, "network_interface": "ib0", "ray_gcs_port": 7000})
    assert "srun \\\n    --nodes=3 \\\n    --ntasks-per-node=1 \\" in script
    assert '--output="$RUN_DIR/logs/%x-%j-node%n.out"' in script
    node_line = next(line for line in _lines(script) if "-m launchers ray-node" in line)
    for flag in ('--run-dir="$RUN_DIR"', "--gcs-port=7000", "--interface=ib0", "--num-gpus=8"):
        assert flag in node_line
    assert '-- megatron-arpo train --config "$RUN_DIR/config.yaml" --resume auto &' in script
    assert "sleep" not in script  # no sleep-based ordering (a grace timer only when configured)


def test_relative_run_dir_resolves_against_the_submit_dir_and_no_machine_paths_leak():
    script = render_sbatch({"nodes": 2}, {"run_dir": "runs/exp1"})
    assert 'SUBMIT_DIR="${SLURM_SUBMIT_DIR:-$PWD}"' in script and 'RUN_DIR="$SUBMIT_DIR"/runs/exp1' in script
    for machine_path in (str(REPO_ROOT), os.path.expanduser("~"), sys.executable):
        assert machine_path not in script


def test_container_preemption_toggles_and_custom_command():
    script = render_sbatch({"container_image": "nvcr.io/nvidia/pytorch:25.01-py3", "container_mounts": "/scratch:/scratch",
                            "requeue": False, "signal_lead_seconds": 0, "preempt_grace_seconds": 120,
                            "env": {"NCCL_DEBUG": "WARN"}, "extra_sbatch": ["--constraint=h100"],
                            "setup_commands": ["module load cuda"]},
                           command=["python", "stand_in.py", "$RUN_DIR", "it's"], mounts=["/data/arpo", "/ckpt/qwq"])
    assert "--container-image=nvcr.io/nvidia/pytorch:25.01-py3 \\" in script
    # The container starts in the submit dir and sees it, the run dir and the data at their host paths.
    assert '--container-mounts="$CONTAINER_MOUNTS" \\' in script and '--container-workdir="$SUBMIT_DIR" \\' in script
    assert ('CONTAINER_MOUNTS="/scratch:/scratch,$SUBMIT_DIR:$SUBMIT_DIR,$RUN_DIR:$RUN_DIR,/data/arpo:/data/arpo,'
            '/ckpt/qwq:/ckpt/qwq"') in script
    assert script.index("CONTAINER_MOUNTS=") > script.index("RUN_DIR=")
    assert "#SBATCH --no-requeue" in script and "REQUEUE=0" in script
    assert "#SBATCH --signal" not in script
    assert "#SBATCH --constraint=h100" in script and "export NCCL_DEBUG=WARN" in script
    assert "module load cuda" in script and "PREEMPT_GRACE=120" in script
    assert "-- python stand_in.py \"$RUN_DIR\" 'it'\"'\"'s' &" in script
    assert "CONTAINER_MOUNTS" not in render_sbatch({})


def test_rendered_script_is_valid_bash(tmp_path):
    script = render_sbatch({"nodes": 2, "container_image": "img", "env": {"A": "b c"}})
    path = tmp_path / "job.sbatch"
    path.write_text(script)
    result = subprocess.run(["bash", "-n", str(path)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_dataclass_sections_and_unknown_keys():
    @dataclasses.dataclass(frozen=True)
    class Section:  # shaped like megatron_arpo.config's launcher section
        nodes: int = 2
        job_name: str = "from-dataclass"

    @dataclasses.dataclass(frozen=True)
    class Experiment:
        launcher: Section = dataclasses.field(default_factory=Section)

    assert launcher_options(Experiment()).job_name == "from-dataclass"
    assert "#SBATCH --nodes=2" in render_sbatch(Section())
    with pytest.raises(ValueError, match=r"unknown key\(s\) 'node' \(did you mean 'nodes'\?\)"):
        launcher_options({"node": 2})
    with pytest.raises(ValueError, match="launcher.preempt_exit_code: got 130"):
        LauncherOptions(preempt_exit_code=130)
    with pytest.raises(ValueError, match="launcher.nodes: got 0"):
        launcher_options({}, {"nodes": 0})


def test_log_paths_name_every_node():
    opts = launcher_options({"nodes": 2, "job_name": "j"}, {"run_dir": "runs/x"})
    assert log_paths(opts, "17") == ["runs/x/logs/j-17.out", "runs/x/logs/j-17-node0.out",
                                     "runs/x/logs/j-17-node1.out"]


def _cli_dry_run(tmp_path, *args: str) -> subprocess.CompletedProcess:
    """`python -m launchers slurm --dry-run` of a small 2-node CPU config."""
    cfg = tmp_path / "exp.yaml"
    cfg.write_text("name: exp\nmodel: {config: tiny-qwen3}\nrollout: {response_length: 256}\n"
                   "tools: {search: {enabled: false}}\nlauncher: {nodes: 2, gpus_per_node: 0}\n")
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    return subprocess.run([sys.executable, "-m", "launchers", "slurm", "--config", str(cfg), *args, "--dry-run"],
                          capture_output=True, text=True, env=env, cwd=tmp_path)


def test_cli_dry_run_prints_the_script_for_a_config(tmp_path):
    result = _cli_dry_run(tmp_path, "--nodes", "3", "--partition", "dev")
    assert result.returncode == 0, result.stderr
    assert "#SBATCH --nodes=3" in result.stdout and "#SBATCH --partition=dev" in result.stdout
    assert 'RUN_DIR="$SUBMIT_DIR"/runs/exp' in result.stdout
    assert not (tmp_path / "runs").exists()  # a dry run writes nothing


def test_the_32b_recipe_asks_for_whole_nodes_and_gets_per_job_ports_and_shared_logs(tmp_path):
    """The rendered 32B job: CPUs, memory, exclusivity, per-job ports and where every log goes."""
    from launchers.cli import main as launchers_main
    from megatron_arpo.cluster.bootstrap import plan_from_launcher
    from megatron_arpo.config import load_config

    recipe = "configs/qwq-32b-arpo-deepsearch.yaml"
    buf = io.StringIO()
    cwd = os.getcwd()
    os.chdir(REPO_ROOT)
    try:
        with contextlib.redirect_stdout(buf):
            assert launchers_main(["slurm", "--config", recipe, "--partition", "P", "--dry-run"]) == 0
        cfg = load_config(recipe)
    finally:
        os.chdir(cwd)
    script = buf.getvalue()
    header = [line for line in _lines(script) if line.startswith("#SBATCH")]
    # Whole nodes: exclusive, all memory (--mem=0), and no CPU cap on the batch or the step (every CPU).
    for line in ("#SBATCH --nodes=4", "#SBATCH --gpus-per-node=8", "#SBATCH --exclusive", "#SBATCH --mem=0"):
        assert line in header, line
    assert not any("cpus-per-task" in line for line in _lines(script))
    node_line = next(line for line in _lines(script) if "-m launchers ray-node" in line)
    # Ports: a per-job range, no fixed GCS/node ports; Ray counts the CPUs the allocation gives (no --num-cpus).
    assert "--port-range=20000-32000" in node_line and "--ports-per-node=200" in node_line
    for fixed in ("--gcs-port", "--node-port-base", "--client-server-port", "--num-cpus"):
        assert fixed not in node_line
    # Logs: the batch shell, each node, and Ray's session logs all end up in the run dir.
    assert "#SBATCH --output=runs/qwq-32b-arpo-deepsearch/logs/%x-%j.out" in header
    assert '--output="$RUN_DIR/logs/%x-%j-node%n.out"' in script
    assert '--ray-log-dir="$RUN_DIR"/logs/ray' in node_line and "--log-sync-seconds=60" in node_line
    assert '--temp-root=/tmp' in node_line  # sockets stay node-local and short
    # Two jobs of this recipe packed onto the same hosts never share a port.
    plan = plan_from_launcher(dataclasses.asdict(cfg.launcher))
    free = lambda ports: True  # noqa: E731
    blocks = [plan.choose(job, k, cfg.launcher.nodes, free) for job in ("81234", "81235") for k in range(4)]
    used = [set(range(b["node_manager_port"], b["max_worker_port"] + 1))
            | {p for key, p in b.items() if key in ("gcs_port", "client_server_port")} for b in blocks]
    assert all(not (a & b) for i, a in enumerate(used) for b in used[i + 1:])
    assert all(20000 <= min(u) and max(u) <= 32000 for u in used)


def test_launch_slurm_submits_sft_on_the_same_script(tmp_path):
    result = _cli_dry_run(tmp_path, "--job", "sft")
    assert result.returncode == 0, result.stderr
    assert '-- megatron-arpo sft --config "$RUN_DIR/config.yaml" --resume auto &' in result.stdout
    assert "#SBATCH --nodes=2" in result.stdout and "#SBATCH --exclusive" in result.stdout
