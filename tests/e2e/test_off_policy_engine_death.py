"""An off-policy run (``trainer.mode: off_policy``, ``max_staleness: 1``, separate pools) loses its vLLM
engine (SIGKILL of the engine actor's process) once it has logged step 1: the engine is replaced on its
bundle and synced, the lost groups are counted, and the run trains to its last step and exits 0.

The kill lands while the engine generates (the next batch, during step 2's update) or between calls
(found by the health probe before the step's sync); a kill inside the weight sync itself is not handled
(docs/off_policy.md) and would fail this test.
"""

from __future__ import annotations

import os
import signal

import psutil
import pytest

from test_train_resume import start
from train_helpers import log_tail, read_rows, train_command, train_env, wait_for, write_task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOTAL_STEPS = 3
OVERRIDES = (f"trainer.total_steps={TOTAL_STEPS}", f"trainer.save_every={TOTAL_STEPS}", "trainer.val_every=0",
             "trainer.export_hf_at_end=false", "rollout.response_length=48", "logging.wandb.mode=disabled",
             "trainer.placement=separate", "trainer.actor_devices=2", "trainer.rollout_devices=1",
             "trainer.mode=off_policy", "rollout.max_staleness=1")


def engine_processes(cluster) -> list[psutil.Process]:
    """The cluster's vLLM engine actor processes (workers under its raylets)."""
    found = []
    for node in cluster.procs:
        try:
            found += [p for p in psutil.Process(node.pid).children(recursive=True)
                      if "VllmEngine" in " ".join(p.cmdline())]
        except psutil.Error:
            continue
    return found


def test_a_killed_engine_is_replaced_and_the_off_policy_run_finishes(_ray_two_node_cluster, tmp_path):
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    data = write_task(tmp_path)
    run_dir = tmp_path / "run"
    log = tmp_path / "run.log"
    proc = start(train_command(str(tiny_checkpoint("tiny-qwen3")), data, run_dir, *OVERRIDES, resume="none"),
                 train_env(data, _ray_two_node_cluster.address), log)
    try:
        wait_for(lambda: len(read_rows(run_dir)) >= 1, 600, proc, log, "step 1")
        engines = engine_processes(_ray_two_node_cluster)
        assert len(engines) == 1, [" ".join(p.cmdline()) for p in engines]
        engines[0].kill()
        code = proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)
    text = log_tail(log, 10**7)
    assert code == 0, "\n".join(text.splitlines()[-40:])
    assert "off-policy: restarting vLLM engine 0 (restart 1 of at most 3)" in text
    assert "phase: engine 0 restarted" in text
    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == list(range(1, TOTAL_STEPS + 1))
    assert rows[0]["offpolicy/engine_restarts_total"] == 0.0 and rows[-1]["offpolicy/engine_restarts_total"] == 1.0
