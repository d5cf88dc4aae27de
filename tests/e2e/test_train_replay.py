"""`megatron-arpo train --replay-rollouts DIR`: recorded steps trained again without engines give the same steps.

1. The session's shared sync run (tests/e2e/conftest.py: tiny Qwen3, Megatron TP=2, one vLLM engine, tools,
   two steps) ran with ``logging.save_rollout_records`` and wrote ``<run>/rollouts/step-{1,2}.jsonl``.
2. The same config, in a fresh run dir, replays that directory. vLLM cannot even be imported in the replay
   (a ``vllm`` package that raises on import is first on PYTHONPATH, for the driver and its Ray workers, which
   run on the replay's own local Ray), so the run proves that no engine started. Each replayed step's actor
   metrics (loss terms, clip fraction, KL, gradient norm), rewards and token statistics equal the recorded
   run's: same weights, same batch, same update. The replay is colocated (nothing to colocate with: it has
   no engine); where the actor ranks sit does not change their numbers.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from conftest import SHARED_SETS
from train_helpers import REPO, log_tail, read_rows, train_command, train_env

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

NO_VLLM = "raise ImportError('the replay imported vllm: it must not start an engine')\n"
SAME_KEYS = ("reward/", "actor/", "rollout/num_trajectories", "rollout/branches_per_prompt",
             "rollout/fills_per_prompt", "rollout/response_length", "rollout/logprob_abs_diff",
             "tools/calls_per_traj", "data/prompt_uids")
TIMING = ("actor/tokens_per_s",)  # a rate: wall-clock dependent


def test_replayed_steps_equal_the_recorded_steps(sync_run, tmp_path):
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    recorded, replayed, data = sync_run.run_dir, tmp_path / "replayed", sync_run.data
    assert "(VllmEngine pid=" in sync_run.log.read_text()  # the engine actor's log lines reach the driver's output
    for step in (1, 2):
        assert (recorded / "rollouts" / f"step-{step}.jsonl").is_file()
        assert (recorded / "rollouts" / f"step-{step}.stats.json").is_file()

    guard = tmp_path / "novllm" / "vllm"
    guard.mkdir(parents=True)
    (guard / "__init__.py").write_text(NO_VLLM)
    env = train_env(data)  # no RAY_ADDRESS: a local Ray, whose workers inherit the guard on PYTHONPATH
    env["PYTHONPATH"] = os.pathsep.join([str(guard.parent), env["PYTHONPATH"]])
    log = tmp_path / "replay.log"
    cmd = train_command(str(tiny_checkpoint("tiny-qwen3")), data, replayed, *SHARED_SETS, "trainer.mode=sync",
                        "trainer.placement=colocated", "trainer.export_hf_at_end=false", resume="none")
    with open(log, "w") as out:
        proc = subprocess.run(cmd + ["--replay-rollouts", str(recorded / "rollouts")], cwd=REPO, env=env,
                              stdout=out, stderr=subprocess.STDOUT, timeout=600)
    assert proc.returncode == 0, log_tail(log)
    assert "(VllmEngine pid=" not in log.read_text()

    rows_a, rows_b = sync_run.rows, read_rows(replayed)
    assert [a["step"] for a in rows_a] == [b["step"] for b in rows_b] == [1, 2]
    for a, b in zip(rows_a, rows_b):
        compared = 0
        for key, value in a.items():
            if not key.startswith(SAME_KEYS) or key in TIMING:
                continue
            assert key in b, key
            # Bit-equal: same weights, same batch, same deterministic CPU/gloo update (nan == nan for absent signals).
            assert b[key] == value or (value != value and b[key] != b[key]), (a["step"], key, value, b[key])
            compared += 1
        assert compared >= 20
        assert a["actor/grad_norm"] > 0 and a["actor/lr"] == b["actor/lr"]
        assert "sync/seconds" in a and "sync/seconds" not in b  # the replay had no engine to sync
