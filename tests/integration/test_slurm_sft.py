"""Cold-start SFT on the real 2-node Slurm test cluster, submitted with `megatron-arpo launch slurm --job sft`:
the Megatron actor group at TP=2 x PP=2 (4 ranks, 2 on each slurmd "node"), formed by the sbatch script's
Ray bootstrap, trains, checkpoints and exports an HF checkpoint; the loss falls."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from slurm_cluster import job_env, slurm_cluster  # noqa: F401 (fixture)
from test_slurm_ray_cluster import _logs

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


def _conversation(i: int) -> dict:
    a, b = 3 + i, 11 + 2 * i
    answer = (f"<think>I will compute {a}*{b} with python.</think><python>print({a}*{b})</python>"
              f" <result>\n{a * b}\n</result><answer>The product is \\boxed{{{a * b}}}.</answer>")
    return {"system": "You can use <python> to run code.",
            "conversations": [{"from": "human", "value": f"What is {a} times {b}?"},
                              {"from": "gpt", "value": answer}]}


def test_sft_at_tp2_pp2_across_two_slurm_nodes_through_launch_slurm(slurm_cluster, tmp_path):
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    data = tmp_path / "sft.jsonl"
    data.write_text("".join(json.dumps(_conversation(i)) + "\n" for i in range(8)))
    run_dir = tmp_path / "run"
    config = {
        "name": "slurm-sft", "model": {"config": "tiny-qwen3", "hf_checkpoint": str(tiny_checkpoint("tiny-qwen3"))},
        "tools": {"search": {"enabled": False}},
        "data": {"max_prompt_tokens": 64}, "rollout": {"response_length": 64, "n": 2, "initial_rollouts": 2},
        "trainer": {"run_dir": str(run_dir), "train_batch_size": 4},
        "actor": {"tensor_parallel": 2, "pipeline_parallel": 2, "params_dtype": "fp32", "micro_batch_tokens": 256,
                  "mini_batch_size": 2, "optimizer": {"weight_decay": 0.0}},
        "sft": {"train_files": [str(data)], "max_seq_tokens": 128, "epochs": 4, "global_batch_size": 4, "lr": 3e-3,
                "lr_schedule": "constant", "warmup_fraction": 0.0, "save_every": 4},
        # Whole nodes (the defaults: --exclusive, --mem=0): Ray advertises the 2 CPUs Slurm gives each node.
        "launcher": {"nodes": 2, "gpus_per_node": 0, "time": "00:14:00", "job_name": "ma-sft", "python": sys.executable,
                     "network_interface": "lo", "object_store_memory": 128 * 1024 * 1024, "ready_timeout": 120,
                     "requeue": False, "signal_lead_seconds": 0,
                     "env": {"GLOO_SOCKET_IFNAME": "lo", "WANDB_MODE": "offline", "RAY_AUTH_MODE": "disabled"}},
    }
    cfg_path = tmp_path / "sft.yaml"
    cfg_path.write_text(yaml.safe_dump(config))
    proc = subprocess.run([sys.executable, "-m", "megatron_arpo", "launch", "slurm", "--config", str(cfg_path),
                           "--job", "sft"], capture_output=True, text=True, env=job_env(), cwd=tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr
    job_id = re.search(r"submitted job (\d+)", proc.stdout).group(1)
    script = (run_dir / "ma-sft.sbatch").read_text()
    assert '-- megatron-arpo sft --config "$RUN_DIR/config.yaml" --resume auto &' in script
    assert "#SBATCH --exclusive" in script and "#SBATCH --mem=0" in script
    info = slurm_cluster.wait_job(job_id, timeout=800)
    opts = {**config["launcher"], "run_dir": str(run_dir)}
    logs = _logs(opts, job_id)
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", logs

    # 4 ranks, 2 on each Slurm node; each raylet advertised the 2 CPUs of its node.
    ranks = json.loads((run_dir / "placement.json").read_text())["actor"]
    assert len(ranks) == 4 and sorted(sum(r["node_id"] == n for r in ranks) for n in {r["node_id"] for r in ranks}) == [2, 2]
    for k in (0, 1):
        assert json.loads((run_dir / "ray" / f"{job_id}.0" / f"node-{k}.json").read_text())["num_cpus"] == 2
    out = run_dir / "sft"
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, 9)), logs  # 4 epochs x 8 conversations / 4
    losses = [r["loss"] for r in rows]
    assert losses[-1] < 0.7 * losses[0], losses
    assert (out / "checkpoints" / "step-4" / "COMPLETE").exists() and (out / "checkpoints" / "step-8" / "COMPLETE").exists()
    state = json.loads((out / "checkpoints" / "step-8" / "state.json").read_text())
    assert state["layout"] == {"tp": 2, "pp": 2, "dp": 1} and state["extra"]["stage"] == "sft"
    assert (out / "hf" / "model.safetensors").is_file() and (out / "hf" / "config.json").is_file()
    head_log = Path(run_dir / "logs" / f"ma-sft-{job_id}-node0.out").read_text()
    assert "SFT on 4 ranks (tp=2 pp=2 dp=1) over 2 Ray node(s)" in head_log, logs
    print(f"SFT TP=2 PP=2 on 2 Slurm nodes: losses {[round(x, 3) for x in losses]}")
