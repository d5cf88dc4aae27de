"""Rerunning a finished run says so and exits 0 without starting Ray or engines just to re-export; anything
that leaves work to do (another config, a newer checkpoint, a missing export, --resume none) starts it."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import yaml

from megatron_arpo import cli, train as train_module
from megatron_arpo.config import load_config
from megatron_arpo.tiny.checkpoint import tiny_checkpoint
from megatron_arpo.trainer import checkpointing


def _setup(tmp_path: Path, epochs: int = 1) -> tuple[str, object]:
    qa = tmp_path / "qa.jsonl"
    qa.write_text(json.dumps({"question": "q?", "answer": "a"}) + "\n")
    raw = {"name": "fin", "model": {"config": "tiny-qwen3", "hf_checkpoint": str(tiny_checkpoint("tiny-qwen3"))},
           "rollout": {"response_length": 256}, "tools": {"search": {"enabled": False}, "python": {"enabled": False}},
           "trainer": {"run_dir": str(tmp_path / "run"), "train_batch_size": 1, "total_epochs": epochs},
           "actor": {"mini_batch_size": 1}, "launcher": {"gpus_per_node": 0}, "data": {"train_files": [str(qa)]}}
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(raw))
    return str(path), load_config(path)


def _finish(cfg, step: int = 1) -> None:
    """What the end of `train` leaves: step-N complete, the HF export, finished.json."""
    run = Path(cfg.run_dir)
    (run / "checkpoints" / f"step-{step}" / "model").mkdir(parents=True)
    (run / "checkpoints" / f"step-{step}" / "COMPLETE").write_text(f"{step}\n")
    (run / "hf").mkdir(parents=True)
    (run / "hf" / "config.json").write_text("{}")
    rt = SimpleNamespace(cfg=cfg, run_dir=run.resolve(), checkpoint_root=run / "checkpoints", step=step, total_steps=step)
    checkpointing.write_finished(rt, run.resolve() / "hf")


@pytest.fixture
def no_training(monkeypatch):
    started = []
    monkeypatch.setattr(train_module, "train", lambda *a, **k: started.append(a) or 0)
    return started


def test_a_finished_run_is_not_started_again(tmp_path, no_training, capsys):
    config, cfg = _setup(tmp_path)
    _finish(cfg)
    assert cli.main(["train", "--config", config]) == 0
    assert no_training == []
    assert "already finished (1 of 1 steps, checkpoint step-1, final policy" in capsys.readouterr().out


@pytest.mark.parametrize("change", ["more epochs", "newer checkpoint", "export missing", "resume none"])
def test_work_left_starts_the_run(change, tmp_path, no_training):
    config, cfg = _setup(tmp_path)
    _finish(cfg)
    argv = ["train", "--config", config]
    if change == "more epochs":
        argv += ["--set", "trainer.total_epochs=2"]
    elif change == "newer checkpoint":
        (Path(cfg.run_dir) / "checkpoints" / "step-2").mkdir()
        (Path(cfg.run_dir) / "checkpoints" / "step-2" / "COMPLETE").write_text("2\n")
    elif change == "export missing":
        (Path(cfg.run_dir) / "hf" / "config.json").unlink()
    else:
        argv += ["--resume", "none"]
    cli.main(argv)
    assert len(no_training) == 1
