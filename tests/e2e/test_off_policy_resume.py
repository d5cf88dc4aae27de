"""An off-policy run (``trainer.mode: off_policy``, ``max_staleness: 1``, separate pools, 4 steps) is stopped
by SIGTERM, resumed, and loses its vLLM engine once resumed (issue 26: resume, and an engine that dies).

1. The first run gets SIGTERM once it has logged step 1. It saves a checkpoint at the next safe point
   (the preemption path, megatron_arpo/trainer/signals.py) and exits 143. Where the signal lands decides
   which: before step 2's update, step 2 is abandoned and the checkpoint is step 1's state, its buffer
   holding batch 2 (and batch 3, when the engines had started it); during the update, step 2 finishes and
   the checkpoint is step 2's, holding batch 3. Every case must resume exactly.
2. The second run resumes (``--resume auto``). Its first steps train exactly the checkpoint's buffered
   groups, in order (prompts, tokens, behaviour log-probs, token versions); step counter and policy version
   continue; the next batches are drawn where the checkpoint left the sampler (the data order of an
   uninterrupted run); the first resumed row reports the counters of the buffered batches' calls.
3. Once the second run has logged a step of its own, its engine actor's process is SIGKILLed: the engine is
   replaced on its bundle and synced, and the run trains to its last step and exits 0. The kill lands while
   the engine generates the next batch, or between calls (found by the health probe before the step's
   sync). A kill inside the weight sync itself is tested on scripted engines only
   (tests/unit/test_off_policy_loop.py, docs/off_policy.md).
4. An uninterrupted run of the same config is the reference: the resumed steps up to step 3 (whose batches
   were generated before the kill) have its trajectory records and metrics, bit for bit (wall-clock values
   and what the kill changes on the engine side aside).

The runs use the session's 2-raylet Ray cluster.
"""

from __future__ import annotations

import json
import math
import os
import signal
from dataclasses import dataclass
from pathlib import Path

import psutil
import pytest

from test_train_resume import expected_uids, start
from train_helpers import comparable_values, log_tail, read_rows, train_command, train_env, wait_for, write_task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

TOTAL_STEPS = 4
BATCH = 2  # trainer.train_batch_size of configs/test-e2e.yaml
OVERRIDES = (f"trainer.total_steps={TOTAL_STEPS}", f"trainer.save_every={TOTAL_STEPS}", "trainer.val_every=0",
             "trainer.export_hf_at_end=false", "rollout.response_length=48", "logging.wandb.mode=disabled",
             "logging.save_rollout_records=true", "trainer.placement=separate", "trainer.actor_devices=2",
             "trainer.rollout_devices=1", "trainer.mode=off_policy", "rollout.max_staleness=1")
# Set when the step trains a group (its position in the batch, its reward), not part of what was generated.
SET_AT_TRAINING = ("prompt_index", "reward")
# What the engine kill changes in a row after it: the lost batch (counted, its prompts drawn again), the
# restart, the buffer, the sync to the new engine.
ENGINE_SIDE = ("offpolicy/engine_restarts_total", "offpolicy/dropped_in_flight_total", "offpolicy/buffer_depth",
               "data/epoch", "data/position", "sync/")


@dataclass(frozen=True)
class Chain:
    data: Path
    run_dir: Path
    stopped_code: int
    stopped_log: str
    resumed_from: int           # the step of the checkpoint the stop saved
    off_policy_state: dict      # its state.json's ``off_policy`` entry
    buffer: dict                # its rollout_buffer.json
    resumed_code: int
    resumed_log: str
    rows: list
    reference: Path             # the uninterrupted run's directory
    reference_rows: list


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


def _run(cmd: list[str], env: dict, log: Path, until, what: str, then) -> int:
    """Start the trainer, wait for ``until()``, call ``then(proc)``, return its exit code."""
    proc = start(cmd, env, log)
    try:
        wait_for(until, 600, proc, log, what)
        then(proc)
        return proc.wait(timeout=600)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=60)


@pytest.fixture(scope="module")
def chain(_ray_two_node_cluster, tmp_path_factory) -> Chain:
    from megatron_arpo.actor.checkpoint import latest_checkpoint
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    root = tmp_path_factory.mktemp("off-policy-resume")
    data = write_task(root)
    run_dir = root / "run"
    env = train_env(data, _ray_two_node_cluster.address)
    hf = str(tiny_checkpoint("tiny-qwen3"))

    # 1. SIGTERM once step 1 is logged: a checkpoint at the next safe point, exit 143.
    log1 = root / "stopped.log"
    code1 = _run(train_command(hf, data, run_dir, *OVERRIDES, resume="none"), env, log1,
                 lambda: len(read_rows(run_dir)) >= 1, "step 1", lambda proc: proc.send_signal(signal.SIGTERM))
    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None, log_tail(log1)
    resumed_from = int(ckpt.name.split("-")[1])
    extra = json.loads((ckpt / "state.json").read_text())["extra"]
    buffer = json.loads((ckpt / extra["off_policy"]["buffer"]).read_text())

    # 2. Resume; 3. kill its engine once it has logged a step of its own.
    def kill_engine(_proc) -> None:
        engines = engine_processes(_ray_two_node_cluster)
        assert len(engines) == 1, [" ".join(p.cmdline()) for p in engines]
        engines[0].kill()

    log2 = root / "resumed.log"
    code2 = _run(train_command(hf, data, run_dir, *OVERRIDES, resume="auto"), env, log2,
                 lambda: any(r["step"] == resumed_from + 1 for r in read_rows(run_dir)),
                 f"the resumed run to log step {resumed_from + 1}", kill_engine)

    # 4. The uninterrupted reference.
    reference = root / "uninterrupted"
    code3 = _run(train_command(hf, data, reference, *OVERRIDES, resume="none"), env, root / "uninterrupted.log",
                 lambda: True, "the start", lambda _proc: None)
    assert code3 == 0, log_tail(root / "uninterrupted.log")
    return Chain(data=data, run_dir=run_dir, stopped_code=code1, stopped_log=log_tail(log1, 10**7),
                 resumed_from=resumed_from, off_policy_state=extra["off_policy"], buffer=buffer, resumed_code=code2,
                 resumed_log=log_tail(log2, 10**7), rows=read_rows(run_dir), reference=reference,
                 reference_rows=read_rows(reference))


def _generated(trajectory: dict) -> dict:
    return {k: v for k, v in trajectory.items() if k not in SET_AT_TRAINING}


def test_a_stopped_off_policy_run_resumes_with_exactly_its_buffered_groups(chain):
    from megatron_arpo.rollout.trajectory import NOT_SAMPLED, load_records

    k = chain.resumed_from
    assert chain.stopped_code == 143, "\n".join(chain.stopped_log.splitlines()[-40:])
    assert f"stopped at step {k} on request; exit code 143" in chain.stopped_log
    assert k in (1, 2) and chain.resumed_code == 0, "\n".join(chain.resumed_log.splitlines()[-40:])

    # What the stop saved: whole batches, nothing in flight, batch b sampled by version b - 2 (max_staleness 1:
    # batch b is generated during the update that makes version b - 1, on the weights of the one before).
    groups = chain.buffer["groups"]
    batches = len(groups) // BATCH
    assert len(groups) == batches * BATCH and 1 <= batches <= 2 and chain.buffer["in_flight"] == 0
    assert chain.off_policy_state["next_batch"] == k + 1 + batches
    for i, group in enumerate(groups):
        batch_number = k + 1 + i // BATCH
        versions = {v for t in group["trajectories"] for v in t["token_versions"] if v != NOT_SAMPLED}
        assert versions == {batch_number - 2}, (group["prompt_id"], versions)
    assert f"resumed at step {k} of {TOTAL_STEPS}" in chain.resumed_log
    assert (f"off-policy: resumed with {len(groups)} buffered groups, next batch {k + 1 + batches}"
            in chain.resumed_log)

    # The resumed run trains those groups first, in order, as they were generated.
    for b in range(batches):
        step = k + 1 + b
        trained = [t.to_dict() for t in load_records(chain.run_dir / "rollouts" / f"step-{step}.jsonl")]
        saved = [t for g in groups[b * BATCH:(b + 1) * BATCH] for t in g["trajectories"]]
        assert [t["prompt_id"] for t in trained] == [t["prompt_id"] for t in saved], f"step {step}"
        assert [_generated(t) for t in trained] == [_generated(t) for t in saved], f"step {step}: trajectories differ"

    rows = chain.rows
    assert [r["step"] for r in rows] == list(range(1, TOTAL_STEPS + 1))  # none twice, none missing
    # the data order of an uninterrupted run: no prompt skipped or repeated (no group was dropped as stale)
    assert [r["data/prompt_uids"] for r in rows] == expected_uids(chain.data, TOTAL_STEPS, BATCH)
    assert [r["offpolicy/policy_version"] for r in rows] == [float(s) for s in range(1, TOTAL_STEPS + 1)]
    assert all(r["offpolicy/dropped_stale_total"] == 0 for r in rows)
    first = rows[k]
    for row in rows[k:k + batches]:  # the buffered batches: one version behind the policy they train
        assert row["offpolicy/staleness/1"] == BATCH and row["offpolicy/token_share/1"] == 1.0
    # the counters of the buffered batches' calls, saved with them, are the first resumed row's
    saved_stats = chain.off_policy_state["put_back_stats"] or chain.off_policy_state["stats"]
    assert first["rollout/generated_tokens"] == saved_stats["generated_tokens"] > 0
    assert first["offpolicy/dropped_in_flight_total"] == chain.buffer["counters"]["dropped_in_flight"] == 0
    for row in rows:
        bad = {key: v for key, v in row.items() if key.startswith(("actor/", "offpolicy/", "reward/"))
               and isinstance(v, float) and not math.isfinite(v)}
        assert not bad, f"step {row['step']}: {bad}"


def test_a_killed_engine_is_replaced_and_the_resumed_run_finishes(chain):
    text = chain.resumed_log
    assert chain.resumed_code == 0, "\n".join(text.splitlines()[-40:])
    assert "off-policy: restarting vLLM engine 0 (restart 1 of at most 3)" in text
    assert "phase: engine 0 restarted" in text
    rows = chain.rows
    assert [r["step"] for r in rows] == list(range(1, TOTAL_STEPS + 1))
    # the count is the process's: it starts at 0 in the resumed run (docs/off_policy.md)
    assert rows[chain.resumed_from]["offpolicy/engine_restarts_total"] == 0.0
    assert rows[-1]["offpolicy/engine_restarts_total"] == 1.0
    # the groups of a call the death interrupted are counted (none when the health probe found it between calls)
    lost = text.count("off-policy: an engine actor died during batch") * BATCH
    assert rows[-1]["offpolicy/dropped_in_flight_total"] == lost


def test_the_resumed_steps_equal_an_uninterrupted_runs(chain):
    from megatron_arpo.rollout.trajectory import load_records, tree_digest

    k = chain.resumed_from
    assert [r["step"] for r in chain.reference_rows] == list(range(1, TOTAL_STEPS + 1))
    for step in range(k + 1, 4):  # the batches of steps <= 3 were generated before the kill
        digests = [tree_digest(load_records(run / "rollouts" / f"step-{step}.jsonl"))
                   for run in (chain.run_dir, chain.reference)]
        assert digests[0] == digests[1], f"step {step}: trajectories differ from the uninterrupted run's"
        resumed, reference = (comparable_values(rows[step - 1]) for rows in (chain.rows, chain.reference_rows))
        if step > k + 1:  # after the kill
            resumed, reference = ({key: v for key, v in values.items() if not key.startswith(ENGINE_SIDE)}
                                  for values in (resumed, reference))
        assert resumed.keys() == reference.keys(), f"step {step}: {resumed.keys() ^ reference.keys()}"
        differing = {key: (resumed[key], reference[key]) for key in resumed if resumed[key] != reference[key]}
        assert not differing, f"step {step}: {differing}"
