"""`megatron-arpo demo` end to end with tiny step counts: every stage runs for real (task build with the
real tools, Megatron SFT, vLLM evaluation with tools, ARPO training on a local Ray, evaluation of the
exported policy), the summary is produced, and a rerun skips every finished stage.

The smoke needs the pipeline to run, not to learn: after the demo's own data stage the test points SFT at
every 14th of its trajectories (129 rows, 3 optimizer steps of 64) and the training's validation at 2
prompts per data source, and starts its three vLLM engines eager (``rollout.enforce_eager=true``: no
torch.compile at each start), with ``--set`` overrides; configs/demo.yaml and the demo's stages are unchanged."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

SHORT = ["sft.epochs=1", "sft.global_batch_size=64", "trainer.total_steps=1", "trainer.train_batch_size=2",
         "actor.mini_batch_size=2", "rollout.n=2", "rollout.initial_rollouts=1", "trainer.val_every=1",
         "trainer.save_every=1", "eval.max_samples=4", "logging.wandb.mode=offline", "rollout.enforce_eager=true"]


def _demo(run_dir: Path, overrides: list[str], *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "megatron_arpo", "demo", "--config", str(REPO / "configs" / "demo.yaml"),
           "--run-dir", str(run_dir), "--seed", "3", *extra]
    for item in overrides:
        cmd += ["--set", item]
    env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1", WANDB_MODE="offline", RAY_AUTH_MODE="disabled")
    env.pop("RAY_ADDRESS", None)
    # Its own session: on a timeout the stage subprocess (and its vLLM/Ray children) die with the demo
    # instead of running on beside the rest of the suite.
    with subprocess.Popen(cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            out, err = proc.communicate(timeout=840)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            raise AssertionError(f"the demo timed out after 840 s\n{err[-3000:]}") from None
    return subprocess.CompletedProcess(cmd, proc.returncode, out, err)


def _subsets(data: Path, small: Path) -> list[str]:
    """Every 14th SFT row (tool and direct ones alike) and the first two val prompts per data source."""
    small.mkdir(parents=True, exist_ok=True)
    sft = (data / "demo_sft.jsonl").read_text().splitlines()[::14]
    (small / "demo_sft.jsonl").write_text("\n".join(sft) + "\n")
    val: dict[str, list[str]] = {}
    for line in (data / "demo_val.jsonl").read_text().splitlines():
        rows = val.setdefault(json.loads(line)["data_source"], [])
        if len(rows) < 2:
            rows.append(line)
    assert len(val) == 2 and len(sft) >= 64, (sorted(val), len(sft))
    (small / "demo_val.jsonl").write_text("\n".join(line for rows in val.values() for line in rows) + "\n")
    return [f"sft.train_files=[{small / 'demo_sft.jsonl'}]", f"data.val_files=[{small / 'demo_val.jsonl'}]"]


def test_demo_runs_every_stage_and_writes_the_summary(tmp_path):
    run_dir = tmp_path / "demo"
    small = tmp_path / "small"
    overrides = SHORT + [f"sft.train_files=[{small / 'demo_sft.jsonl'}]", f"data.val_files=[{small / 'demo_val.jsonl'}]"]
    first = _demo(run_dir, overrides, "--stages", "data")  # the demo's own task build, then the subsets of it
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert _subsets(run_dir / "data", small) == overrides[len(SHORT):]
    proc = _demo(run_dir, overrides)
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
    again = _demo(run_dir, overrides)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("skipping") == 5, again.stderr
