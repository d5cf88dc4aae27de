"""metrics.jsonl, wandb offline with a redacted config, step summaries."""

import json
import os
from pathlib import Path

import pytest

from megatron_arpo.config import load_config
from megatron_arpo.tracking import MetricsLogger, format_step_summary, read_metrics


def test_metrics_jsonl_and_resume_truncation(tmp_path):
    log = MetricsLogger(tmp_path, {}, wandb_mode="disabled")
    for step in range(1, 5):
        log.log(step, {"reward/mean": step / 10})
    log.close()
    with open(tmp_path / "metrics.jsonl", "a") as fh:
        fh.write('{"step": 5, "reward/me')  # torn line from a SIGKILL
    resumed = MetricsLogger(tmp_path, {}, wandb_mode="disabled", resume_step=2)
    resumed.log(3, {"reward/mean": 0.99})
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["reward/mean"] == 0.99


def test_wandb_offline_gets_redacted_config(tmp_path, monkeypatch, caplog):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("MY_SECRET", "sk-live-123")
    cfg = load_config("configs/demo.yaml")
    raw = cfg.to_dict()
    raw["eval"]["judge"]["api_key"] = "sk-live-123"  # a secret pasted where it does not belong
    from megatron_arpo.config import redact

    log = MetricsLogger(tmp_path, redact(raw), wandb_mode="auto", project="t", name="unit")
    log.log(1, {"reward/mean": 0.5, "note": "text is kept out of wandb"})
    with caplog.at_level("INFO", logger="megatron_arpo.tracking"):
        log.close()
    hint = next(r.getMessage() for r in caplog.records if "wandb sync" in r.getMessage())
    offline_dir = Path(hint.split("wandb sync ", 1)[1])  # the directory `wandb sync` uploads
    assert offline_dir.name.startswith("offline-run-") and any(offline_dir.glob("*.wandb")), hint
    files = [p for p in (tmp_path / "wandb").rglob("*") if p.is_file()]
    assert any(p.name.endswith(".wandb") for p in files), files
    blob = b"".join(p.read_bytes() for p in files)
    assert b"sk-live-123" not in blob
    assert b"megatron-arpo-demo" in blob or b"demo" in blob  # the config did reach wandb
    assert json.loads((tmp_path / "metrics.jsonl").read_text())["reward/mean"] == 0.5


def test_step_summary_shows_known_metrics_only():
    line = format_step_summary(3, {"reward/mean": 0.4123, "actor/grad_norm": 1234567.0, "other": 1}, 20)
    assert line == "step 3/20 | reward 0.412 | gnorm 1.23e+06"


def _scalars(log_dir):
    # tensorboard's own reader, as `tensorboard --logdir` loads the files
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir))
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def test_tensorboard_scalars_read_back_and_a_resume_purges_the_redone_steps(tmp_path):
    log = MetricsLogger(tmp_path, {}, wandb_mode="disabled", tensorboard=True, resume_step=-1)
    for step in range(1, 5):
        log.log(step, {"reward/mean": step / 10, "time/step_s": 2.0 * step, "data/prompt_uids": ["a"],
                       "actor/entropy": "nan"})
    log.close()
    scalars = _scalars(tmp_path / "tensorboard")
    assert set(scalars) == {"reward/mean", "time/step_s"}  # numbers only: no list, no "nan" string, no step
    assert [s for s, _ in scalars["reward/mean"]] == [1, 2, 3, 4]
    assert [v for _, v in scalars["reward/mean"]] == pytest.approx([0.1, 0.2, 0.3, 0.4])

    # Killed after step 4 with the checkpoint at step 2: the resumed run redoes 3 and 4 with new values.
    resumed = MetricsLogger(tmp_path, {}, wandb_mode="disabled", tensorboard=True, resume_step=2)
    for step in (3, 4, 5):
        resumed.log(step, {"reward/mean": 1.0 + step})
    resumed.close()
    after = _scalars(tmp_path / "tensorboard")
    assert [s for s, _ in after["reward/mean"]] == [1, 2, 3, 4, 5]  # one value per step: the old 3 and 4 are gone
    assert [v for _, v in after["reward/mean"]] == pytest.approx([0.1, 0.2, 4.0, 5.0, 6.0])
    assert [s for s, _ in after["time/step_s"]] == [1, 2]
    assert [r["step"] for r in read_metrics(tmp_path)] == [1, 2, 3, 4, 5]


def test_no_tensorboard_without_the_setting(tmp_path):
    log = MetricsLogger(tmp_path, {}, wandb_mode="disabled")
    log.log(1, {"reward/mean": 0.5})
    log.close()
    assert not (tmp_path / "tensorboard").exists()
