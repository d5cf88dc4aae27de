"""`megatron-arpo train --replay-rollouts DIR`: a recorded step trained again without engines gives the same step.

1. A real one-step run (tiny Qwen3, Megatron TP=2, one vLLM engine, tools) with
   ``logging.save_rollout_records`` writes ``<run>/rollouts/step-1.jsonl``.
2. The same config, in a fresh run dir, replays that directory. vLLM cannot even be imported in the replay
   (a ``vllm`` package that raises on import is first on PYTHONPATH, for the driver and its Ray workers), so
   the run proves that no engine started. The replayed step's actor metrics (loss terms, clip fraction, KL,
   gradient norm), rewards and token statistics equal the recorded run's: same weights, same batch, same
   update.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from train_helpers import REPO, log_tail, read_rows, train_command, train_env, write_task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

OVERRIDES = ("trainer.total_steps=1", "trainer.val_every=0", "trainer.export_hf_at_end=false",
             "rollout.response_length=48")
NO_VLLM = "raise ImportError('the replay imported vllm: it must not start an engine')\n"
SAME_KEYS = ("reward/", "actor/", "rollout/num_trajectories", "rollout/branches_per_prompt",
             "rollout/fills_per_prompt", "rollout/response_length", "rollout/logprob_abs_diff",
             "tools/calls_per_traj", "data/prompt_uids")
TIMING = ("actor/tokens_per_s",)  # a rate: wall-clock dependent


def run(cmd, env, log, timeout=600):
    with open(log, "w") as out:
        return subprocess.run(cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, timeout=timeout)


def test_replayed_step_equals_the_recorded_step(tmp_path):
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    hf_dir = str(tiny_checkpoint("tiny-qwen3"))
    data = write_task(tmp_path)
    recorded, replayed = tmp_path / "recorded", tmp_path / "replayed"

    log1 = tmp_path / "record.log"
    proc = run(train_command(hf_dir, data, recorded, *OVERRIDES, "logging.save_rollout_records=true"),
               train_env(data), log1)
    assert proc.returncode == 0, log_tail(log1)
    assert "(VllmEngine pid=" in log1.read_text()  # the engine actor's log lines reach the driver's output
    assert (recorded / "rollouts" / "step-1.jsonl").is_file() and (recorded / "rollouts" / "step-1.stats.json").is_file()

    guard = tmp_path / "novllm" / "vllm"
    guard.mkdir(parents=True)
    (guard / "__init__.py").write_text(NO_VLLM)
    env = train_env(data)
    env["PYTHONPATH"] = os.pathsep.join([str(guard.parent), env["PYTHONPATH"]])
    log2 = tmp_path / "replay.log"
    cmd = train_command(hf_dir, data, replayed, *OVERRIDES) + ["--replay-rollouts", str(recorded / "rollouts")]
    proc = run(cmd, env, log2)
    assert proc.returncode == 0, log_tail(log2)
    assert "(VllmEngine pid=" not in log2.read_text()

    (a,), (b,) = read_rows(recorded), read_rows(replayed)
    assert a["step"] == b["step"] == 1
    compared = 0
    for key, value in a.items():
        if not key.startswith(SAME_KEYS) or key in TIMING:
            continue
        assert key in b, key
        # Bit-equal: same weights, same batch, same deterministic CPU/gloo update (nan == nan for absent signals).
        assert b[key] == value or (value != value and b[key] != b[key]), (key, value, b[key])
        compared += 1
    assert compared >= 20
    assert a["actor/grad_norm"] > 0 and a["actor/lr"] == b["actor/lr"]
    assert "sync/seconds" in a and "sync/seconds" not in b  # the replay had no engine to sync
