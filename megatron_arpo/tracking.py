"""Run logging: console format, per-phase progress bars, one-line step summaries, metrics.jsonl, wandb.

(docs/design/architecture.md §1: planned as ``logging.py``; it is named ``tracking`` so that running a file from inside
the package can never shadow the standard library's ``logging``.)

- ``metrics.jsonl`` in the run directory gets one JSON object per step, flushed and fsynced before the
  step's checkpoint is published (``megatron_arpo/train.py``), so a run killed with SIGKILL keeps every
  step its checkpoint covers. On resume, lines for steps after the resumed step are
  dropped first, so the file never holds two versions of a step.
- wandb is online when ``logging.wandb.mode`` is ``online``, or ``auto`` with ``WANDB_API_KEY`` set;
  otherwise offline into ``<run_dir>/wandb`` (closing logs the ``wandb sync`` command that uploads it).
  The config it receives is ``ExperimentConfig.redacted()``: secrets never reach wandb, and the key
  itself is read by wandb from the environment only.
- With ``logging.tensorboard`` the numeric metrics also go to TensorBoard event files in
  ``<run_dir>/tensorboard``; a resumed run purges the events after its resumed step, as the jsonl does.
- The per-phase step bar is drawn on a terminal only (never carriage returns into a log file); the keys
  are explained in docs/metrics.md.
"""

from __future__ import annotations

import json
import logging
import math
import os
import sys
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator, Mapping

from tqdm import tqdm

from megatron_arpo.fsutil import atomic_write, fsync_path
from megatron_arpo.progress import is_terminal
from megatron_arpo.redaction import install_log_redaction

logger = logging.getLogger(__name__)

CONSOLE_FORMAT = "%(asctime)s %(levelname).1s %(name)s: %(message)s"

# The metrics shown in the one-line step summary, in order, with their short labels.
SUMMARY_KEYS = (
    ("reward/mean", "reward"), ("reward/accuracy", "acc"), ("tools/calls_per_traj", "calls"),
    ("rollout/branches_per_prompt", "branches"), ("actor/loss", "loss"), ("actor/grad_norm", "gnorm"),
    ("actor/clip_frac", "clip"), ("actor/approx_kl", "kl"), ("time/step_s", "s"),
)


def setup_console_logging(level: str = "INFO", rank: int | None = None) -> None:
    fmt = CONSOLE_FORMAT if rank is None else f"[rank {rank}] {CONSOLE_FORMAT}"
    root = logging.getLogger()
    root.setLevel(level)
    if not any(getattr(h, "_megatron_arpo", False) for h in root.handlers):
        handler = logging.StreamHandler(sys.stderr)
        handler._megatron_arpo = True  # type: ignore[attr-defined]
        root.addHandler(handler)
    for h in root.handlers:
        if getattr(h, "_megatron_arpo", False):
            h.setFormatter(logging.Formatter(fmt, datefmt="%H:%M:%S"))
    install_log_redaction(root)
    for noisy in ("urllib3", "filelock", "asyncio"):
        logging.getLogger(noisy).setLevel(max(logging.WARNING, root.level))


def _format_value(value: float) -> str:
    if value != value or math.isinf(value):
        return str(value)
    if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e5):
        return f"{value:.2e}"
    return f"{value:.3f}".rstrip("0").rstrip(".") if abs(value) < 100 else f"{value:.1f}"


def format_step_summary(step: int, metrics: Mapping[str, Any], total_steps: int | None = None) -> str:
    """``step 3/20 | reward 0.41 | acc 0.5 | calls 1.2 | ...`` for the metrics that are present."""
    head = f"step {step}" + (f"/{total_steps}" if total_steps else "")
    parts = [head]
    for key, label in SUMMARY_KEYS:
        value = metrics.get(key)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            parts.append(f"{label} {_format_value(float(value))}")
    return " | ".join(parts)


@contextmanager
def progress(phase: str, total: int | None, enabled: bool = True) -> Iterator[Any]:
    """A per-phase progress bar on stderr (a no-op object when disabled or when stderr is not a terminal)."""
    if not enabled or not is_terminal(sys.stderr):
        class _Null:
            def update(self, n: int = 1) -> None:
                pass

            def set_postfix_str(self, s: str) -> None:
                pass

        yield _Null()
        return

    bar = tqdm(total=total, desc=phase, leave=False, dynamic_ncols=True, file=sys.stderr, mininterval=1.0)
    try:
        yield bar
    finally:
        bar.close()


def _jsonable(value: Any) -> Any:
    if hasattr(value, "item") and callable(value.item):
        value = value.item()
    if isinstance(value, float) and (value != value or math.isinf(value)):
        return str(value)
    return value


class MetricsLogger:
    """metrics.jsonl + wandb for one run; only the driver process creates it."""

    def __init__(self, run_dir: str | os.PathLike, redacted_config: Mapping[str, Any], *, wandb_mode: str = "auto",
                 project: str = "megatron-arpo", entity: str | None = None, name: str | None = None,
                 tags: list[str] | None = None, write_jsonl: bool = True, resume_step: int | None = None,
                 tensorboard: bool = False):
        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl_path = self.run_dir / "metrics.jsonl" if write_jsonl else None
        if self.jsonl_path is not None and resume_step is not None:
            self._truncate_after(resume_step)
        self._wandb = None
        mode = wandb_mode
        if mode == "auto":
            mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
        if mode != "disabled":
            self._wandb = self._init_wandb(mode, redacted_config, project, entity, name, tags)
        self._wandb_offline = mode == "offline" and self._wandb is not None
        self._tensorboard = self._init_tensorboard(resume_step) if tensorboard else None

    def _truncate_after(self, step: int) -> None:
        assert self.jsonl_path is not None
        if not self.jsonl_path.exists():
            return
        kept = []
        for line in self.jsonl_path.read_text().splitlines():
            try:
                if json.loads(line).get("step", 0) <= step:
                    kept.append(line)
            except json.JSONDecodeError:
                break  # a torn last line from a killed run
        with atomic_write(self.jsonl_path) as fh:  # fsynced: a second kill cannot bring the dropped rows back
            fh.write("".join(line + "\n" for line in kept))

    def _init_wandb(self, mode: str, config: Mapping[str, Any], project: str, entity: str | None,
                    name: str | None, tags: list[str] | None) -> Any:
        try:
            import wandb
        except ImportError:
            logger.warning("wandb is not installed; metrics go to metrics.jsonl only")
            return None
        os.environ.setdefault("WANDB_SILENT", "true")
        run = wandb.init(mode=mode, dir=str(self.run_dir), project=project, entity=entity, name=name,
                         tags=tags, config=dict(config), resume="allow",
                         id=self._wandb_run_id(), reinit="finish_previous")
        logger.info("wandb %s run %s (dir %s)", mode, run.id, self.run_dir / "wandb")
        return run

    def _init_tensorboard(self, resume_step: int | None) -> Any:
        # Imported here: tensorboard (through torch) is heavy, and a run without logging.tensorboard skips it.
        from torch.utils.tensorboard import SummaryWriter

        # purge_step: events at or after it, left by the killed run this one resumes, are dropped on open.
        # A fresh run (resume_step -1) purges from step 0: an earlier run's events in the same directory.
        purge = resume_step + 1 if resume_step is not None else None
        writer = SummaryWriter(log_dir=str(self.run_dir / "tensorboard"), purge_step=purge)
        logger.info("TensorBoard events in %s (tensorboard --logdir %s)", writer.log_dir, writer.log_dir)
        return writer

    def _wandb_run_id(self) -> str:
        """A stable id per run dir, so a resumed run appends to the same wandb run."""
        path = self.run_dir / "wandb_run_id"
        if path.exists():
            return path.read_text().strip()

        run_id = uuid.uuid4().hex[:12]
        path.write_text(run_id)
        return run_id

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        row = {"step": step, **{k: _jsonable(v) for k, v in metrics.items()}}
        if self.jsonl_path is not None:
            created = not self.jsonl_path.exists()
            with open(self.jsonl_path, "a") as fh:
                fh.write(json.dumps(row) + "\n")
                fh.flush()
                os.fsync(fh.fileno())
            if created:
                fsync_path(self.run_dir)  # the new file's directory entry is durable too
        numeric = {k: v for k, v in row.items() if isinstance(v, (int, float))}
        if self._wandb is not None:
            self._wandb.log(numeric, step=step)
        if self._tensorboard is not None:
            for key, value in numeric.items():
                if key != "step":
                    self._tensorboard.add_scalar(key, value, global_step=step)
            self._tensorboard.flush()  # a step's scalars are on disk once its row is

    def close(self) -> None:
        if self._wandb is not None:
            run_dir = getattr(self._wandb, "dir", None)
            self._wandb.finish()
            self._wandb = None
            if self._wandb_offline and run_dir:
                logger.info("wandb ran offline; upload this run with: wandb sync %s", Path(run_dir).parent)
        if self._tensorboard is not None:
            self._tensorboard.close()
            self._tensorboard = None


def read_metrics(run_dir: str | os.PathLike) -> list[dict[str, Any]]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
