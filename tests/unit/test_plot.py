"""``megatron-arpo plot RUN_DIR``: PNG learning curves from metrics.jsonl, through the real CLI entry point.

The run is synthesised from a real one: ``tests/support/demo_metrics.jsonl`` is the metrics.jsonl of a demo
run (the trainer's real keys); its step-1 row is repeated over 30 steps with moving values."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from PIL import Image

from megatron_arpo.cli import main
from megatron_arpo.plot import RL_PANELS

FIXTURE = Path(__file__).resolve().parents[1] / "support" / "demo_metrics.jsonl"


def write_run(run_dir: Path, steps: int = 30, val_every: int = 5) -> list[dict]:
    real = [json.loads(line) for line in FIXTURE.read_text().splitlines()]
    template = next(r for r in real if "reward/mean" in r)
    rows = []
    for step in range(1, steps + 1):
        row = {}
        for key, value in template.items():
            if key.startswith("val/"):
                continue
            if isinstance(value, (int, float)) and not isinstance(value, bool):
                value = float(value) + 0.1 * math.sin(step / 2.0) + step / steps
            row[key] = value
        row["step"] = step
        row["reward/mean"] = -0.8 + 1.5 * step / steps + 0.1 * math.sin(step)
        row["actor/entropy"] = 2.5 - step / steps  # falls
        if step % val_every == 0:
            row.update({k: 0.1 + step / steps / 2 for k in template if k.startswith("val/")})
        rows.append(row)
    rows[3]["actor/entropy"] = "nan"  # a NaN is stored as a string: left out, not plotted as 0
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 31, "rew')
    return rows


def _check_png(path: Path) -> None:
    assert path.is_file(), path
    assert path.stat().st_size > 10_000, (path, path.stat().st_size)
    with Image.open(path) as img:
        assert img.format == "PNG"
        width, height = img.size
        assert width >= 400 and height >= 250, img.size
        colours = img.convert("RGB").getcolors(maxcolors=1 << 20)
        assert colours is None or len(colours) > 50, len(colours)  # axes, text and curves, not a blank canvas


def test_plot_writes_every_learning_curve(tmp_path, capsys):
    run = tmp_path / "run"
    write_run(run)
    assert main(["plot", str(run)]) == 0
    printed = capsys.readouterr().out.split()
    names = {p.name for p in (run / "plots").glob("*.png")}
    assert names == {f"{p.name}.png" for p in RL_PANELS} | {"curves.png"}
    assert sorted(printed) == sorted(str(run / "plots" / n) for n in names)
    for name in names:
        _check_png(run / "plots" / name)
    with Image.open(run / "plots" / "curves.png") as overview, Image.open(run / "plots" / "reward.png") as one:
        assert overview.size[0] > 2 * one.size[0]  # the panels side by side
    assert not list((run / "plots").glob("*.tmp"))


def test_plot_out_dir_sft_curve_and_missing_panels(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "reward/mean": s / 10, "time/step_s": 5.0})
                                               + "\n" for s in range(1, 6)))
    (run / "sft").mkdir()
    (run / "sft" / "metrics.jsonl").write_text("".join(
        json.dumps({"step": s, "epoch": 0, "loss": 3.0 / s, "grad_norm": 1.0}) + "\n" for s in range(1, 9)))
    assert main(["plot", str(run), "--out", str(tmp_path / "png")]) == 0
    names = {p.name for p in (tmp_path / "png").glob("*.png")}
    assert names == {"reward.png", "step_time.png", "curves.png", "sft_loss.png"}  # no data, no panel
    _check_png(tmp_path / "png" / "sft_loss.png")
    # An SFT output directory on its own is plotted as SFT.
    assert main(["plot", str(run / "sft")]) == 0
    assert {p.name for p in (run / "sft" / "plots").glob("*.png")} == {"sft_loss.png"}


@pytest.mark.parametrize("content", [None, '{"step": 1, "data/epoch": 0}\n'])
def test_plot_without_metrics_is_an_input_error(tmp_path, capsys, content):
    if content is not None:
        (tmp_path / "metrics.jsonl").write_text(content)
    assert main(["plot", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "megatron-arpo plot: error:" in err and str(tmp_path) in err
    assert ("no metrics.jsonl" in err) == (content is None)
    assert main(["plot", str(tmp_path / "absent")]) == 2


def test_demo_summary_embeds_its_curve(tmp_path):
    from types import SimpleNamespace

    from megatron_arpo.demo import write_summary

    write_run(tmp_path, steps=6, val_every=3)
    demo = SimpleNamespace(run_dir=tmp_path, config="configs/demo.yaml", seed=0, stage_seconds=lambda stage: None,
                           cfg=SimpleNamespace(data=SimpleNamespace(reward="deep_research")))
    text = write_summary(demo)["markdown"]
    assert "](plots/curves.png)" in text and text == (tmp_path / "summary.md").read_text()
    _check_png(tmp_path / "plots" / "curves.png")


def test_train_and_the_cli_do_not_import_matplotlib_or_tensorboard():
    import subprocess
    import sys

    code = ("import sys, megatron_arpo.cli, megatron_arpo.train, megatron_arpo.tracking, megatron_arpo.plot, "
            "megatron_arpo.demo, megatron_arpo.trainer.runtime; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('matplotlib', 'tensorboard')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=300)
    assert out.stdout.strip() == "[]", out.stdout
