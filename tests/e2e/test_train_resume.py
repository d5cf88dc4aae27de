"""Faults and restarts of `megatron-arpo train`, with real processes and signals.

1. A run is killed with SIGKILL (its whole process group: driver, its private local Ray, actors, engine)
   once checkpoint step-1 is complete and step 2 has started.
2. It is restarted with ``--resume auto``, this time with vLLM's sleep mode and the actor's offload on
   (the colocated variant whose resume must not lose the KV cache to the actor's optimizer state): the
   engine is ready, its KV cache checked and asleep before the actor loads the checkpoint (optimizer
   state included), the first switch wakes it and syncs; it continues at the step after the newest
   complete checkpoint, with the data order of an uninterrupted run, and no step appears twice in
   metrics.jsonl.
3. Once that second run has trained a step of its own, it loses its vLLM engine (SIGKILL of the engine
   actor's process): the trainer exits 1 with one line naming the dead engine, every logged step has its
   checkpoint, and no process is left behind.
SIGUSR1 preemption (checkpoint at the end of the step, exit 42, requeue, resume to the end) of the real
trainer is tests/integration/test_slurm_train.py's preempted-job test.
Plus a cheap one: a tool backend that is down stops the run at start-up, before Ray starts.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import time
from pathlib import Path

import psutil
import pytest

from train_helpers import REPO, log_tail, read_rows, train_command, train_env, wait_for, write_task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOTAL_STEPS = 8
OVERRIDES = (f"trainer.total_steps={TOTAL_STEPS}", "trainer.save_every=1", "trainer.keep_last=3",
             "trainer.val_every=0", "trainer.export_hf_at_end=false", "rollout.response_length=48")


def session_processes(sid: int) -> list[psutil.Process]:
    found = []
    for proc in psutil.process_iter(["pid"]):
        try:
            if os.getsid(proc.pid) == sid:
                found.append(proc)
        except (ProcessLookupError, PermissionError, psutil.Error):
            continue
    return found


def remove_ray_temp_dir(log: Path) -> None:
    match = re.search(r"started local Ray instance \(temp dir (\S+)\)", log.read_text(errors="replace"))
    if match and Path(match.group(1)).name.startswith("ma-ray-"):
        shutil.rmtree(match.group(1), ignore_errors=True)


def expected_uids(data: Path, steps: int, batch: int) -> list[list[str]]:
    from megatron_arpo.data.datasets import load_prompt_files
    from megatron_arpo.data.sampler import EpochSampler

    records, _ = load_prompt_files([data / "train.jsonl"])
    sampler = EpochSampler(len(records), batch, seed=42, shuffle=True)  # 6 prompts, batch 2: crosses epochs
    return [[records[i].uid for i in sampler.next_batch()] for _ in range(steps)]


def start(cmd: list[str], env: dict, log: Path) -> subprocess.Popen:
    with open(log, "w") as out:  # the child keeps its own descriptor
        return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


def test_kill9_resume_and_a_dead_engine(tmp_path):
    from megatron_arpo.actor.checkpoint import latest_checkpoint
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    data = write_task(tmp_path)
    run_dir = tmp_path / "run"
    ckpts = run_dir / "checkpoints"
    env = train_env(data)  # no RAY_ADDRESS: each run starts (and owns) a private local Ray
    cmd = train_command(str(tiny_checkpoint("tiny-qwen3")), data, run_dir, *OVERRIDES, resume="auto")

    # 1. SIGKILL the whole process group in the middle of step 2.
    log1 = tmp_path / "run1.log"
    first = start(cmd, env, log1)
    try:
        wait_for(lambda: (ckpts / "step-1" / "COMPLETE").exists() and len(read_rows(run_dir)) >= 1, 600, first, log1,
                 "checkpoint step-1 and the start of step 2")
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        first.wait(timeout=60)
    # Ray's raylet and workers leave after they see their parents gone: seconds on quiet cores, longer beside
    # the other pytest worker of `make test`.
    wait_for(lambda: not session_processes(first.pid), 180, what="every process of the killed run to exit")
    remove_ray_temp_dir(log1)  # the killed driver could not clean up its private Ray instance
    killed_at = latest_checkpoint(ckpts)
    resumed_from = int(killed_at.name.split("-")[1])
    assert resumed_from >= 1 and not (ckpts / f"step-{TOTAL_STEPS}").exists()
    assert json.loads((killed_at / "state.json").read_text())["has_optimizer"]

    # 2. Restart with --resume auto (sleep + offload); 3. kill its engine once it logged a step of its own.
    log2 = tmp_path / "run2.log"
    second = start(train_command(str(tiny_checkpoint("tiny-qwen3")), data, run_dir, *OVERRIDES,
                                 "rollout.enable_sleep_mode=true", "actor.offload=true", resume="auto"), env, log2)
    try:
        wait_for(lambda: any(r["step"] == resumed_from + 1 for r in read_rows(run_dir)), 600, second, log2,
                 f"the resumed run to finish step {resumed_from + 1}")
        engines = [p for p in session_processes(second.pid) if "VllmEngine" in " ".join(p.cmdline())]
        assert len(engines) == 1, [" ".join(p.cmdline()) for p in session_processes(second.pid)]
        engines[0].kill()
        code = second.wait(timeout=300)
    finally:
        if second.poll() is None:
            os.killpg(second.pid, signal.SIGKILL)
            second.wait(timeout=60)
    text = log_tail(log2, 10**7)
    lines = [line for line in text.splitlines() if line.strip()]
    assert code == 1, "\n".join(lines[-40:])
    assert lines[-1].startswith("megatron-arpo train: error: ") and "vLLM engine actor died" in lines[-1], lines[-1]
    assert (run_dir / "logs" / "train-error.log").exists()
    assert _wait_gone(second.pid)
    assert f"resumed at step {resumed_from} of {TOTAL_STEPS}" in text
    # The start-up order as the phase controller logged it: the engine first, then the actor's state.
    order = ["phase: engines ready", "start-up: engine 0: KV cache 1.00 GiB per worker", "phase: KV caches checked",
             "phase: engines asleep (level 2)", f"phase: actor ready (resumed from step-{resumed_from})",
             "phase: actor offloaded", "phase: engines woke their weights", "phase: weights synced",
             "phase: engines woke their KV cache"]
    at = [text.find(line) for line in order]
    assert -1 not in at and at == sorted(at), dict(zip(order, at))

    rows = read_rows(run_dir)
    steps = [r["step"] for r in rows]
    last = steps[-1]
    assert steps == list(range(1, last + 1)), steps  # the killed run's unsaved steps are gone, none twice
    assert resumed_from + 1 <= last < TOTAL_STEPS
    assert [r["data/prompt_uids"] for r in rows] == expected_uids(data, last, 2)

    # Every logged step was checkpointed before the engine's death stopped the run (save_every=1).
    final = latest_checkpoint(ckpts)
    assert final.name == f"step-{last}"
    extra = json.loads((final / "state.json").read_text())["extra"]
    assert extra["step"] == last and extra["sampler"]["epoch"] * 6 + extra["sampler"]["position"] == 2 * last


def test_a_tool_backend_that_is_down_stops_the_run_before_ray_starts(tmp_path):
    import socket

    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    with socket.socket() as sock:  # a port nobody listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    data = write_task(tmp_path)
    cmd = train_command(str(tiny_checkpoint("tiny-qwen3")), data, tmp_path / "run", "tools.search.backend=http",
                        f"tools.search.url=http://127.0.0.1:{port}/retrieve")
    proc = subprocess.run(cmd, cwd=REPO, env=train_env(data), capture_output=True, text=True, timeout=300)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert lines[-1].startswith("megatron-arpo train: error: RuntimeError: tool 'search' does not work"), lines[-1]
    assert "Ray connected" not in proc.stderr


def _wait_gone(sid: int) -> bool:
    deadline = time.monotonic() + 60
    while session_processes(sid) and time.monotonic() < deadline:
        time.sleep(0.5)
    return not session_processes(sid)
