"""trainer.mode: off_policy: the settings, their derived default and the start-up refusals (issue 26, step 1)."""

from __future__ import annotations

import dataclasses

from megatron_arpo.config import build_config, off_policy_problems
from megatron_arpo.preflight import find_problems
from test_config import errors_of, minimal

SEPARATE = {"placement": "separate", "actor_devices": 1, "rollout_devices": 1}


def test_defaults_are_sync_and_the_buffer_is_derived_from_the_batch():
    cfg = build_config(minimal(trainer={"train_batch_size": 8}, actor={"mini_batch_size": 8}))
    assert cfg.trainer.mode == "sync" and cfg.rollout.max_staleness == 1
    assert cfg.rollout.buffer_groups == 16  # (max_staleness + 1) x train_batch_size
    cfg = build_config(minimal(trainer={**SEPARATE, "mode": "off_policy", "train_batch_size": 8},
                               actor={"mini_batch_size": 8}, rollout={"max_staleness": 2}))
    assert cfg.trainer.mode == "off_policy" and cfg.rollout.buffer_groups == 24


def test_off_policy_with_colocated_placement_is_refused_with_the_reason():
    msg = errors_of(minimal(trainer={"mode": "off_policy"}))
    assert "trainer.mode: off_policy needs trainer.placement: separate" in msg
    assert "share the GPUs" in msg and "trainer.mode: sync" in msg


def test_negative_staleness_is_refused():
    assert "rollout.max_staleness" in errors_of(minimal(trainer={**SEPARATE, "mode": "off_policy"},
                                                        rollout={"max_staleness": -1}))


def test_a_buffer_smaller_than_one_batch_is_refused():
    msg = errors_of(minimal(trainer={**SEPARATE, "mode": "off_policy", "train_batch_size": 8},
                            actor={"mini_batch_size": 8}, rollout={"buffer_groups": 7}))
    assert "rollout.buffer_groups: 7 cannot hold one batch of trainer.train_batch_size = 8 prompt groups" in msg
    # sync mode never builds the buffer: the same setting passes
    build_config(minimal(trainer={"train_batch_size": 8}, actor={"mini_batch_size": 8}, rollout={"buffer_groups": 7}))


def test_preflight_refuses_what_validation_refuses():
    cfg = build_config(minimal(trainer={**SEPARATE, "mode": "off_policy"}))
    assert off_policy_problems(cfg) == []
    bad = dataclasses.replace(cfg, trainer=dataclasses.replace(cfg.trainer, placement="colocated"),
                              rollout=dataclasses.replace(cfg.rollout, max_staleness=-2))
    problems = find_problems(bad, "train", data=False, probe=False, tools=False)
    assert any(p.startswith("trainer.mode: off_policy needs trainer.placement: separate") for p in problems)
    assert any(p.startswith("rollout.max_staleness: -2 is below 0") for p in problems)
