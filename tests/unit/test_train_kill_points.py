"""Ordered commit of a step: SIGKILL around a checkpoint's publish loses no metrics row and duplicates none.

The real loop (``megatron_arpo.train.train``), the real ``MetricsLogger`` (fsynced rows, rows after the
resumed step dropped) and the real rollout-record writer run in a child process; the engines, the actor
and the scoring are replaced by trivial stand-ins (the phases' results are empty), and the actor's save
writes ``.tmp-step-N``, renames it to ``step-N`` and adds ``COMPLETE`` as ``megatron_arpo.actor.checkpoint``
does. The child kills itself with SIGKILL at one point of step 3's commit: just before the publish (after
the metrics row), or just after it. A second child resumes (``--resume auto`` semantics: the newest
complete checkpoint) and finishes the run. Every step must then have exactly one row and its records.
tests/e2e/test_train_resume.py kills a real run (Ray, vLLM, Megatron) at a random point.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
TOTAL_STEPS = 5

DRIVER = textwrap.dedent("""
    import contextlib, os, signal, sys, types
    from pathlib import Path

    from megatron_arpo import train as train_module
    from megatron_arpo.config import build_config
    from megatron_arpo.trainer import checkpointing, phases, runtime, steps
    from megatron_arpo.tracking import MetricsLogger

    run_dir, kill_at, total = Path(sys.argv[1]), sys.argv[2], int(sys.argv[3])
    cfg = build_config({"model": {"config": "tiny-qwen3"}, "tools": {"search": {"enabled": False}},
                        "data": {"max_prompt_tokens": 16}, "rollout": {"response_length": 32},
                        "trainer": {"run_dir": str(run_dir), "total_steps": total, "save_every": 1, "val_every": 0,
                                    "export_hf_at_end": False, "val_before_train": False},
                        "logging": {"save_rollout_records": True, "progress_bars": False}})


    class Sampler:
        def __init__(self):
            self.position = 0

        def state_dict(self):
            return {"epoch": 0, "position": self.position}

        def load_state_dict(self, state):
            self.position = state["position"]


    class Result:
        groups, stats = [], {}

        def trajectories(self):
            return []


    def latest_step():
        done = [int(p.name.split("-")[1]) for p in (run_dir / "checkpoints").glob("step-*") if (p / "COMPLETE").exists()]
        return max(done, default=0)


    @contextlib.contextmanager
    def start_runtime(cfg, resume, replay_dir):
        rt = types.SimpleNamespace(cfg=cfg, run_dir=run_dir, total_steps=total, val=None, train=None,
                                   sampler=Sampler(), phases=types.SimpleNamespace(weights_stale=False))
        rt.step = rt.last_saved_step = latest_step()
        rt.sampler.position = rt.step
        rt.metrics_logger = MetricsLogger(run_dir, {}, wandb_mode="disabled", resume_step=rt.step if rt.step else -1)
        yield rt


    def save_checkpoint(rt, stopping=False):
        root = run_dir / "checkpoints"
        tmp, final = root / f".tmp-step-{rt.step}", root / f"step-{rt.step}"
        tmp.mkdir(parents=True, exist_ok=True)
        (tmp / "state.json").write_text('{"step": %d}' % rt.step)
        if kill_at == f"before-publish-{rt.step}":
            os.kill(os.getpid(), signal.SIGKILL)
        os.rename(tmp, final)
        (final / "COMPLETE").write_text(f"{rt.step}\\n")
        rt.last_saved_step = rt.step
        if kill_at == f"after-publish-{rt.step}":
            os.kill(os.getpid(), signal.SIGKILL)
        return final


    def next_prompts(rt):
        rt.sampler.position += 1
        return [types.SimpleNamespace(prompt_id=f"0:uid-{rt.sampler.position}")], [rt.sampler.position]


    runtime.start_runtime = start_runtime
    checkpointing.save_checkpoint = save_checkpoint
    steps.next_prompts = next_prompts
    steps.tool_stats = lambda rt: {}
    steps.tool_tags = lambda rt, trajs: []
    steps.rollout = lambda rt, prompts, step, cancel_when=None: (prompts, Result())
    steps.score = lambda rt, result, prompts, prompt_set, indices: {}
    steps.make_train_batch = lambda rt, result: {"old_logprobs": []}
    steps.add_log_probs = lambda rt, batch, timer: {"padding_fraction": 0.0}
    steps.update = lambda rt, batch: {"loss": 0.5}
    phases.switch_phase = lambda rt, target: {}
    sys.exit(train_module.train(cfg, "auto"))
""")


def run_until(run_dir: Path, kill_at: str) -> int:
    proc = subprocess.run([sys.executable, "-c", DRIVER, str(run_dir), kill_at, str(TOTAL_STEPS)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    return proc.returncode


@pytest.mark.parametrize("kill_at", ["before-publish-3", "after-publish-3"])
def test_a_kill_around_the_publish_loses_no_row_and_duplicates_none(kill_at, tmp_path):
    run_dir = tmp_path / "run"
    assert run_until(run_dir, kill_at) == -9
    published = (run_dir / "checkpoints" / "step-3" / "COMPLETE").exists()
    assert published == kill_at.startswith("after")
    assert run_until(run_dir, "never") == 0  # the resumed run finishes
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == list(range(1, TOTAL_STEPS + 1))
    assert [r["data/prompt_uids"] for r in rows] == [[f"uid-{s}"] for s in range(1, TOTAL_STEPS + 1)]
    assert sorted(p.name for p in (run_dir / "rollouts").glob("step-*.jsonl")) == \
        sorted(f"step-{s}.jsonl" for s in range(1, TOTAL_STEPS + 1))
