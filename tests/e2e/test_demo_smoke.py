"""`megatron-arpo demo` end to end with tiny step counts: every stage runs for real (task build with the
real tools, Megatron SFT, vLLM evaluation with tools, ARPO training on a local Ray, evaluation of the
exported policy), the summary is produced, and a rerun skips every finished stage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SHORT = ["sft.epochs=1", "sft.global_batch_size=64", "trainer.total_steps=1", "trainer.train_batch_size=2",
         "actor.mini_batch_size=2", "rollout.n=2", "rollout.initial_rollouts=1", "trainer.val_every=1",
         "trainer.save_every=1", "eval.max_samples=4", "logging.wandb.mode=offline"]


def _demo(run_dir: Path, overrides: list[str]) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_arpo", "demo", "--config", str(REPO / "configs" / "demo.yaml"),
           "--run-dir", str(run_dir), "--seed", "3"]
    for item in overrides:
        cmd += ["--set", item]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", WANDB_MODE="offline", RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=840)


def test_demo_runs_every_stage_and_writes_the_summary(tmp_path):
    run_dir = tmp_path / "demo"
    proc = _demo(run_dir, SHORT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    for stage in ("data", "sft", "before", "train", "after"):
        assert (run_dir / f"stage-{stage}.done.json").is_file(), stage
    assert (run_dir / "sft" / "hf" / "config.json").is_file()
    assert (run_dir / "hf" / "config.json").is_file()
    summary = json.loads((run_dir / "summary.json").read_text())
    for side in ("before", "after"):
        assert set(summary[side]) == {"demo_arith", "demo_search", "all"}, summary[side]
        for stats in summary[side].values():
            assert stats["n"] == 4 or stats["n"] == 8
            assert -1.0 <= stats["reward"] <= 1.1 and 0.0 <= stats["accuracy"] <= 1.0
    assert summary["train"]["steps"] == 1
    assert summary["train"]["branches_per_prompt"] is not None
    text = (run_dir / "summary.md").read_text()
    assert "reward before" in text and "branches per prompt" in text
    assert "](plots/curves.png)" in text and (run_dir / "plots" / "curves.png").stat().st_size > 10_000
    # Every stage's progress reaches the demo's console; its log files hold no escape codes.
    for stage, what in (("sft", "sft"), ("before", "eval "), ("train", "train")):
        assert f"[{stage}] {what}" in proc.stderr, (stage, proc.stderr[-3000:])
    for log in (run_dir / "logs").glob("*.log"):
        assert b"\x1b" not in log.read_bytes() and b"\r" not in log.read_bytes(), log
    # vLLM's rotary warning after each weight sync is filtered in its worker processes.
    assert "Failed to load weights" not in (run_dir / "logs" / "train.log").read_text()
    assert "| all |" in proc.stdout

    # Resumable: a second run finds every stage complete and only rewrites the summary.
    again = _demo(run_dir, SHORT)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("skipping") == 5, again.stderr
