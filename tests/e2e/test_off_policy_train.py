"""Off-policy training on the real stack (issue 26): Megatron actor ranks (TP=2) and a vLLM engine on
separate pools, the tiny Qwen3 with tools, two steps. ``max_staleness: 0`` (each batch generated after the
previous update's sync) gives sync mode's trajectory records, metrics and final weights, bit for bit.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from ray_cluster import _ray_two_node_cluster  # noqa: E402,F401 (session fixture: 2 raylets)
from test_train_determinism import _values  # noqa: E402
from train_helpers import REPO, log_tail, read_rows, train_command, train_env, write_task  # noqa: E402

from megatron_arpo.rollout.trajectory import load_records, tree_digest  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def _train(cluster, data: Path, run_dir: Path, *sets: str) -> list[dict]:
    import subprocess

    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    cmd = train_command(str(tiny_checkpoint("tiny-qwen3")), data, run_dir, "logging.wandb.mode=disabled",
                        "logging.save_rollout_records=true", "trainer.placement=separate", "trainer.actor_devices=2",
                        "trainer.rollout_devices=1", "trainer.val_every=0", *sets, resume="none")
    log = run_dir.parent / f"{run_dir.name}.log"
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=train_env(data, cluster.address), stdout=out,
                              stderr=subprocess.STDOUT, timeout=900)
    assert proc.returncode == 0, log_tail(log)
    return read_rows(run_dir)


def _digest(run_dir: Path, step: int) -> str:
    return tree_digest(load_records(run_dir / "rollouts" / f"step-{step}.jsonl"))


def test_max_staleness_0_gives_sync_trajectories_losses_and_weights(_ray_two_node_cluster, tmp_path):  # noqa: F811
    data = write_task(tmp_path)
    runs = {"sync": tmp_path / "sync", "off": tmp_path / "off"}
    sync = _train(_ray_two_node_cluster, data, runs["sync"], "trainer.mode=sync")
    off = _train(_ray_two_node_cluster, data, runs["off"], "trainer.mode=off_policy", "rollout.max_staleness=0")

    assert [r["step"] for r in sync] == [1, 2] == [r["step"] for r in off]
    assert all(r["actor/grad_norm"] > 0 for r in sync)  # the policy moved: step 2 samples version 1
    for step in (1, 2):
        assert _digest(runs["sync"], step) == _digest(runs["off"], step), f"step {step}: trajectories differ"
    for a, b in zip(sync, off):
        va, vb = _values(a), _values(b)
        only_off = {k for k in vb if k.startswith("offpolicy/")}
        assert va.keys() == vb.keys() - only_off
        differing = {k: (va[k], vb[k]) for k in va if va[k] != vb[k]}
        assert not differing, f"step {a['step']}: {differing}"
        assert b["offpolicy/token_share/0"] == 1.0 and b["offpolicy/is_weight_mean"] == 1.0
    for name in sorted(p.relative_to(runs["sync"] / "hf") for p in (runs["sync"] / "hf").rglob("*.safetensors")):
        assert (runs["sync"] / "hf" / name).read_bytes() == (runs["off"] / "hf" / name).read_bytes(), name
