"""Same seed, same numbers: two runs of the same short training give bit-identical metrics and weights.

Two RL steps of the tiny Qwen3 with tools (python sandbox, BM25 search), asynchronous branched rollouts
on a vLLM engine and a weight sync after each update, on the default (not ``trainer.deterministic``) path,
run twice in separate run directories on the same machine. Every metric except wall-clock ones must be
equal, and the final HF checkpoints byte for byte. The two runs are the session's shared ones
(tests/e2e/conftest.py): sync mode, and off-policy mode with ``max_staleness: 0``, which is sync mode
by construction (tests/e2e/test_off_policy_train.py); only its ``offpolicy/*`` keys are its own.
A change that gives this up (off-policy training, a non-deterministic kernel) must say so here.
"""

from __future__ import annotations

import pytest

from train_helpers import comparable_values

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


def test_two_runs_with_the_same_seed_give_the_same_metrics_and_weights(sync_run, off_policy_run):
    runs = [sync_run.run_dir, off_policy_run.run_dir]
    rows = [sync_run.rows, off_policy_run.rows]

    assert [r["step"] for r in rows[0]] == [1, 2] == [r["step"] for r in rows[1]]
    # The runs did real work: tools were called, the policy moved, the engine was synced.
    assert sum(r["tools/calls_per_traj"] for r in rows[0]) > 0
    assert all(r["actor/grad_norm"] > 0 and r["sync/verified"] >= 1 for r in rows[0])
    assert "val/reward" in rows[0][1] and "val/reward" in rows[1][1]  # validation is compared too
    for a, b in zip(*rows):
        va = comparable_values(a)
        vb = {k: v for k, v in comparable_values(b).items() if not k.startswith("offpolicy/")}
        assert va.keys() == vb.keys()
        differing = {k: (va[k], vb[k]) for k in va if va[k] != vb[k]}
        assert not differing, f"step {a['step']}: {differing}"

    files = sorted(p.relative_to(runs[0] / "hf") for p in (runs[0] / "hf").rglob("*") if p.is_file())
    assert any(f.suffix == ".safetensors" for f in files)
    assert files == sorted(p.relative_to(runs[1] / "hf") for p in (runs[1] / "hf").rglob("*") if p.is_file())
    for name in files:
        if name.name == "conversion.json":  # names the run's own paths
            continue
        assert (runs[0] / "hf" / name).read_bytes() == (runs[1] / "hf" / name).read_bytes(), name
