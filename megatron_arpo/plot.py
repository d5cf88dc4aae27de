"""``megatron-arpo plot RUN_DIR [--out DIR]``: PNG learning curves from a run's ``metrics.jsonl``.

One PNG per panel (reward, accuracy, tool calls, entropy, KL, step time), each with the training curve
and, where the run validated, the validation points; ``curves.png`` holds every panel on one figure (the
demo's summary embeds it). A run directory with ``sft/metrics.jsonl`` also gets ``sft_loss.png``. Panels
whose keys the run never wrote are skipped; values that are not finite numbers (a NaN is stored as
``"nan"``) are left out. The keys are explained in docs/metrics.md.
"""

from __future__ import annotations

import argparse
import json
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from megatron_arpo.command_args import PROG
from megatron_arpo.errors import InputError


@dataclass(frozen=True)
class Panel:
    name: str  # the PNG's file name without .png
    title: str
    ylabel: str
    series: tuple[tuple[str, str], ...]  # (metrics.jsonl key, legend label)


RL_PANELS = (
    Panel("reward", "Reward", "mean reward", (("reward/mean", "train"), ("val/reward", "validation"))),
    Panel("accuracy", "Accuracy", "fraction correct", (("reward/accuracy", "train"), ("val/accuracy", "validation"))),
    Panel("tool_calls", "Tool calls", "calls per trajectory",
          (("tools/calls_per_traj", "train"), ("val/tool_calls_per_traj", "validation"))),
    Panel("entropy", "Policy entropy", "nats per token",
          (("actor/entropy", "response tokens"), ("actor/entropy_after_tool", "after tool results"))),
    Panel("kl", "KL", "nats per token", (("actor/approx_kl", "to the rollout policy"), ("actor/ref_kl", "to the reference"))),
    Panel("step_time", "Step time", "seconds",
          (("time/step_s", "step"), ("time/rollout_s", "rollout"), ("time/update_s", "update"), ("time/sync_s", "sync"))),
)
SFT_PANELS = (Panel("sft_loss", "SFT loss", "token-mean NLL", (("loss", "train"),)),)
OVERVIEW = "curves"


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The rows of a metrics.jsonl; a torn last line (a killed run) is skipped."""
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return [r for r in rows if isinstance(r, dict)]


def series(rows: Sequence[dict[str, Any]], key: str) -> tuple[list[int], list[float]]:
    """(steps, values) of ``key``, finite numbers only."""
    steps, values = [], []
    for row in rows:
        value = row.get(key)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            continue
        steps.append(int(row.get("step", len(steps) + 1)))
        values.append(float(value))
    return steps, values


def _draw(ax: Any, panel: Panel, rows: Sequence[dict[str, Any]]) -> bool:
    drawn = False
    for key, label in panel.series:
        xs, ys = series(rows, key)
        if not xs:
            continue
        style = "o-" if key.startswith("val/") or len(xs) < 20 else "-"
        ax.plot(xs, ys, style, label=f"{label} ({key})", markersize=4, linewidth=1.5)
        drawn = True
    if drawn:
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.set_ylabel(panel.ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize="small")
    return drawn


def _save(fig: Any, path: Path) -> Path:
    tmp = path.with_name(path.name + ".tmp")
    fig.savefig(tmp, format="png", dpi=100, bbox_inches="tight")
    os.replace(tmp, path)
    return path


def plot_rows(rows: Sequence[dict[str, Any]], out_dir: Path, panels: Sequence[Panel],
              overview: str | None = None) -> list[Path]:
    """One PNG per panel with data (and the overview of them all); returns the paths written."""
    # Imported here: matplotlib is heavy and only this command and the demo summary draw. Figure with the
    # Agg canvas, not pyplot: no global state, no display needed.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    out_dir.mkdir(parents=True, exist_ok=True)
    written, with_data = [], []
    for panel in panels:
        fig = Figure(figsize=(6.4, 4.0))
        FigureCanvasAgg(fig)
        if _draw(fig.add_subplot(), panel, rows):
            written.append(_save(fig, out_dir / f"{panel.name}.png"))
            with_data.append(panel)
    if overview and with_data:
        cols = min(3, len(with_data))
        nrows = math.ceil(len(with_data) / cols)
        fig = Figure(figsize=(5.0 * cols, 3.6 * nrows))
        FigureCanvasAgg(fig)
        for i, panel in enumerate(with_data):
            _draw(fig.add_subplot(nrows, cols, i + 1), panel, rows)
        fig.tight_layout()
        written.append(_save(fig, out_dir / f"{overview}.png"))
    return written


def plot_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike | None = None) -> list[Path]:
    """The learning curves of an RL run (``metrics.jsonl``) and its SFT stage (``sft/metrics.jsonl``)."""
    run_dir = Path(run_dir)
    out = Path(out_dir) if out_dir is not None else run_dir / "plots"
    rl, sft = run_dir / "metrics.jsonl", run_dir / "sft" / "metrics.jsonl"
    if not run_dir.is_dir():
        raise InputError(f"{run_dir}: no such run directory; give the trainer.run_dir of a run")
    if not rl.is_file() and not sft.is_file():
        raise InputError(f"{run_dir}: no metrics.jsonl (nor sft/metrics.jsonl); give the trainer.run_dir of a run "
                         f"that has logged at least one step (logging.metrics_jsonl: true)")
    written = []
    if rl.is_file():
        rows = read_rows(rl)
        # An SFT output directory given as RUN_DIR holds SFT rows (a "loss" key, no "reward/mean").
        is_sft = any("loss" in r for r in rows) and not any("reward/mean" in r or "val/reward" in r for r in rows)
        written += plot_rows(rows, out, SFT_PANELS if is_sft else RL_PANELS, None if is_sft else OVERVIEW)
    if sft.is_file():
        written += plot_rows(read_rows(sft), out, SFT_PANELS)
    if not written:
        raise InputError(f"{run_dir}: its metrics.jsonl holds no step with a plotted metric yet "
                         f"(reward/mean, actor/entropy, time/step_s, ... or an SFT loss); plot again after a step")
    return written


def plot_main(argv: Sequence[str]) -> int:
    parser = argparse.ArgumentParser(prog=f"{PROG} plot", description=(
        "PNG learning curves (reward, accuracy, tool calls, entropy, KL, step time; SFT loss) from a run's "
        "metrics.jsonl; the keys are explained in docs/metrics.md."))
    parser.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (trainer.run_dir) holding metrics.jsonl")
    parser.add_argument("--out", default=None, metavar="DIR", help="directory for the PNGs (default: RUN_DIR/plots)")
    args = parser.parse_args(list(argv))
    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0
