"""Shared pieces of the training e2e tests: a tiny task, the command line, the environment, waiting.

The task is six JSONL questions (two data sources). Its reward, ``letter_share`` (share of vowels in
the response), is not a quality measure: it only gives a random tiny model rewards that differ within
a group, so the GRPO advantages are non-zero and the update really moves the weights.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

REPO = Path(__file__).resolve().parents[2]
CONFIG = REPO / "configs" / "test-e2e.yaml"

# Wall-clock measurements (seconds, rates, and the shares derived from them) differ between equal runs.
WALL_CLOCK = re.compile(r"^time/|_s$|per_s$|^sync/seconds$|_frac$|latency|/seconds")
DETERMINISTIC_FRACTIONS = {"reward/format_error_frac", "actor/clip_frac", "actor/padding_fraction"}

QUESTIONS = [
    ("What is the capital of Veloria?", "Marisport", "facts"),
    ("Who founded Marisport?", "Ilsa Brandt", "facts"),
    ("What is 17 * 23?", "391", "arith"),
    ("What is 12 + 30?", "42", "arith"),
    ("Where was Ilsa Brandt born?", "Kessel", "facts"),
    ("What is 9 * 9?", "81", "arith"),
]

REWARD_MODULE = '''
def letter_share(solution_str, ground_truth, data_source=None, extra_info=None):
    return sum(c in "aeiou" for c in solution_str) / max(len(solution_str), 1)
'''


def write_task(root: Path) -> Path:
    """``root/data`` with train.jsonl, val.jsonl and the reward module; returns that directory."""
    data = root / "data"
    data.mkdir(parents=True, exist_ok=True)
    rows = [json.dumps({"question": q, "answer": a, "data_source": s}) for q, a, s in QUESTIONS]
    (data / "train.jsonl").write_text("\n".join(rows) + "\n")
    (data / "val.jsonl").write_text("\n".join(rows[:2]) + "\n")
    (data / "rewards_e2e.py").write_text(REWARD_MODULE)
    return data


def train_command(hf_dir: str, data: Path, run_dir: Path, *overrides: str, resume: str | None = None) -> list[str]:
    sets = [f"model.hf_checkpoint={hf_dir}", f"data.train_files=[{data / 'train.jsonl'}]",
            f"data.val_files=[{data / 'val.jsonl'}]", "data.reward=rewards_e2e:letter_share",
            f"trainer.run_dir={run_dir}", *overrides]
    cmd = [sys.executable, "-m", "megatron_arpo", "train", "--config", str(CONFIG)]
    for item in sets:
        cmd += ["--set", item]
    if resume is not None:
        cmd += ["--resume", resume]
    return cmd


def train_env(data: Path, ray_address: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    if ray_address:
        env["RAY_ADDRESS"] = ray_address
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(data), env.get("PYTHONPATH")]))
    env.update({"GLOO_SOCKET_IFNAME": "lo", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
                "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "WANDB_MODE": "offline",
                "WANDB_SILENT": "true"})
    return env


def run_train(cmd: list[str], data: Path, log: Path, ray_address: str | None = None, timeout: float = 720) -> None:
    """Run a ``megatron-arpo train`` command line to its end, its output in ``log``; fail with the log's tail."""
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=train_env(data, ray_address), stdout=out, stderr=subprocess.STDOUT,
                              timeout=timeout)
    assert proc.returncode == 0, log_tail(log)


def comparable_values(row: dict) -> dict:
    """A metrics row without its wall-clock entries: what two equal runs must agree on."""
    return {k: v for k, v in row.items() if k in DETERMINISTIC_FRACTIONS or not WALL_CLOCK.search(k)}


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            break  # a line being written
    return rows


def wait_for(condition: Callable[[], bool], timeout: float, proc=None, log: Path | None = None,
             what: str = "condition") -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc is not None and proc.poll() is not None:
            tail = log.read_text()[-4000:] if log is not None and log.exists() else ""
            raise AssertionError(f"the trainer exited with {proc.returncode} while waiting for {what}\n{tail}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(0.1)


def log_tail(path: Path, chars: int = 6000) -> str:
    return path.read_text(errors="replace")[-chars:] if path.exists() else ""
