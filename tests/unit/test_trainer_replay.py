"""Replaying saved rollout records (megatron_arpo.trainer.replay; `train --replay-rollouts DIR`).

A real scheduler run (the docs/design/arpo_reference.md §11.7 scripted policy, ARPO branching) is recorded with the trainer's writer and
read back: the tree (record digest), the scheduler counters and the train batch equal the live run's. Bad
directories and records are input errors (exit 2 from the CLI, naming the fix). The full train loop on a
replayed step is tests/e2e/test_train_replay.py.
"""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from megatron_arpo.cli import main
from megatron_arpo.errors import InputError
from megatron_arpo.rollout.scheduler import RolloutPrompt
from megatron_arpo.rollout.trajectory import tree_digest
from megatron_arpo.trainer import replay, steps
from scheduler_helpers import PROMPT, make_scheduler, reference_script, run
from test_trainer_steps import config


@pytest.fixture(scope="module")
def live():
    scheduler, _ = make_scheduler(reference_script(), n=4, initial_rollouts=2, beam_size=2, seed=0,
                                  entropy_window=20, branch_threshold=0.5, entropy_weight=0.2)
    prompts = [RolloutPrompt("0:a", list(PROMPT)), RolloutPrompt("1:b", list(PROMPT))]
    result = run(scheduler, prompts, call_key="train-1")
    for k, t in enumerate(result.trajectories()):
        t.reward = float(k % 3) / 2  # rewards differ within each group: the advantages are not all zero
    return prompts, result


def test_recorded_step_reads_back_as_the_same_tree_counters_and_batch(tmp_path, live):
    prompts, result = live
    replay.save_step_records(tmp_path, 1, result)
    source = replay.ReplaySource.open(tmp_path)
    assert source.steps == [1]
    got_prompts, got = source.load(1)
    assert [(p.prompt_id, p.token_ids) for p in got_prompts] == [(p.prompt_id, p.token_ids) for p in prompts]
    assert tree_digest(got.trajectories()) == tree_digest(result.trajectories())
    assert [[t.traj_id for t in g] for g in got.groups] == [[t.traj_id for t in g] for g in result.groups]
    assert got.stats == pytest.approx(result.stats) and result.stats["branches"] > 0
    rt = SimpleNamespace(cfg=config())
    assert steps.make_train_batch(rt, got) == steps.make_train_batch(rt, result)


def test_counters_are_derived_from_the_records_when_the_stats_file_is_absent(tmp_path, live):
    _, result = live
    replay.save_step_records(tmp_path, 2, result)
    replay.stats_path(tmp_path, 2).unlink()
    _, got = replay.ReplaySource.open(tmp_path).load(2)
    trajs = result.trajectories()
    assert got.stats["branches"] == sum(t.origin == "branch" for t in trajs) == result.stats["branches"]
    assert got.stats["fills"] == result.stats["fills"]


def test_steps_and_bad_records_are_checked(tmp_path, live):
    _, result = live
    for step in (1, 3):
        replay.save_step_records(tmp_path, step, result)
    source = replay.ReplaySource.open(tmp_path)
    with pytest.raises(InputError, match=r"no records for step\(s\) \[2\].*lower trainer.total_steps"):
        source.check_covers(1, 3)
    source.check_covers(3, 3)
    lines = replay.records_path(tmp_path, 3).read_text().splitlines()
    unscored = json.loads(lines[0])
    unscored["reward"] = None
    replay.records_path(tmp_path, 3).write_text("\n".join([json.dumps(unscored)] + lines[1:]) + "\n")
    with pytest.raises(InputError, match="has no reward.*save_rollout_records=true"):
        source.load(3)
    replay.records_path(tmp_path, 3).write_text("\n".join(lines[len(result.groups[0]):]) + "\n")  # prompt 0 lost
    with pytest.raises(InputError, match=r"prompt indices \[1\] are not 0..0.*re-record"):
        source.load(3)
    replay.records_path(tmp_path, 3).write_text("{not json\n")
    with pytest.raises(InputError, match="bad rollout record"):
        source.load(3)


def a_file(d):
    (d / "step-1.jsonl").write_text("")
    return d / "step-1.jsonl"


@pytest.mark.parametrize("make, message", [
    (lambda d: d / "missing", "no such directory; record one with"),
    (a_file, "is a file; give the directory"),
    (lambda d: d, "no step-<N>.jsonl rollout records in it; record one with"),
])
def test_a_bad_replay_dir_exits_2_naming_the_fix(tmp_path, capsys, make, message):
    hf = tmp_path / "hf"
    hf.mkdir()
    data = tmp_path / "train.jsonl"
    data.write_text(json.dumps({"question": "q", "answer": "a"}) + "\n")
    empty = tmp_path / "records"
    empty.mkdir()
    code = main(["train", "--config", "configs/test-e2e.yaml", "--set", f"model.hf_checkpoint={hf}",
                 "--set", f"data.train_files=[{data}]", "--set", f"trainer.run_dir={tmp_path / 'run'}",
                 "--replay-rollouts", str(make(empty))])
    err = capsys.readouterr().err
    assert code == 2, err
    assert message in err and "Traceback" not in err
    assert not (tmp_path / "run").exists()  # nothing started
