"""`megatron-arpo train` end to end: two RL steps of the tiny Qwen3 on a real 2-raylet Ray cluster.

Real everything: Megatron actor at TP=2 (two Ray actors, gloo), one vLLM engine actor in its own
resource pool (``trainer.placement: separate``; the resume test covers ``colocated``), a frozen reference group for
the KL term, the python sandbox and local BM25 search tools, weight sync from the actor ranks into the
engine (gloo weight-transfer engine) with verification, validation, checkpoints, wandb (offline), and the final HF export. The trainer runs as a
subprocess joining the cluster with RAY_ADDRESS, as the launchers start it. It runs with
``trainer.deterministic: true``, so the actor's deterministic path (Megatron's deterministic mode, torch's
deterministic algorithms) runs end to end here; the default path is the determinism test's.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
import torch

from train_helpers import REPO, log_tail, read_rows, train_command, train_env, write_task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

EXPECTED_KEYS = [
    "reward/mean", "reward/std", "reward/accuracy", "reward/format_error_frac",
    "tools/calls_per_traj", "tools/python/calls_per_traj", "tools/search/calls_per_traj", "tools/errors",
    "tools/call_limit_hits", "tools/cache_hit_rate", "rollout/branches_per_prompt", "rollout/entropy_after_tool",
    "rollout/response_length", "rollout/generated_tokens_per_s", "rollout/logprob_abs_diff",
    "actor/clip_frac", "actor/approx_kl", "actor/grad_norm", "actor/lr", "actor/tokens_per_s",
    "actor/padding_fraction", "actor/entropy", "sync/seconds", "sync/gb_per_s", "time/rollout_s",
    "time/reward_s", "time/logprob_s", "time/update_s", "time/sync_s", "time/step_s",
    "time/outside_model_frac", "data/prompt_uids",
]


def expected_uids(data: Path, steps: int, batch: int) -> list[list[str]]:
    from megatron_arpo.data.datasets import load_prompt_files
    from megatron_arpo.data.sampler import EpochSampler

    records, _ = load_prompt_files([data / "train.jsonl"])
    sampler = EpochSampler(len(records), batch, seed=42, shuffle=True)  # data.seed default
    return [[records[i].uid for i in sampler.next_batch()] for _ in range(steps)]


def test_two_rl_steps_end_to_end(_ray_two_node_cluster, tmp_path):  # session fixture: tests/conftest.py
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from megatron_arpo.actor.checkpoint import latest_checkpoint
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    hf_dir = tiny_checkpoint("tiny-qwen3")
    data = write_task(tmp_path)
    run_dir = tmp_path / "run"
    log = tmp_path / "train.log"
    cmd = train_command(str(hf_dir), data, run_dir, "logging.wandb.mode=offline", "trainer.placement=separate",
                        "trainer.actor_devices=2", "trainer.rollout_devices=1", "algorithm.use_reference=true",
                        "algorithm.kl.coef=0.01", "trainer.deterministic=true",
                        "rollout.enforce_eager=false", resume="auto")  # the compiled engine, as in production
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=train_env(data, _ray_two_node_cluster.address), stdout=out,
                              stderr=subprocess.STDOUT, timeout=720)
    text = log_tail(log, 10**7)
    assert proc.returncode == 0, log_tail(log)
    assert "trainer.deterministic: on" in text

    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for key in EXPECTED_KEYS:
        assert key in rows[0] and key in rows[1], key
    assert "val/reward" in rows[1] and "val/facts/reward" in rows[1] and "val/reward" not in rows[0]
    assert [r["data/prompt_uids"] for r in rows] == expected_uids(data, 2, 2)
    for row in rows:
        for source in {uid.split("-")[0] for uid in row["data/prompt_uids"]}:
            assert f"reward/{source}/mean" in row and f"reward/{source}/accuracy" in row
        assert row["rollout/num_trajectories"] == 8  # 2 prompts x n=4, branches and fills included
        assert row["actor/grad_norm"] > 0 and row["actor/num_optimizer_steps"] == 2
        assert row["sync/verified"] >= 1
        assert "actor/kl_loss" in row and "actor/ref_kl" in row and "time/ref_logprob_s" in row
    assert abs(rows[0]["actor/ref_kl"]) < 1e-5 < abs(rows[1]["actor/ref_kl"])  # the policy left the reference
    # The engine generated step 2 with the weights step 1 trained: its log-probs of the sampled tokens
    # equal the actor's (a stale or partly loaded engine is off by ~0.03-0.5 here, lr = 1e-3).
    assert rows[1]["rollout/logprob_abs_diff"] < 1e-3

    ckpt = latest_checkpoint(run_dir / "checkpoints")
    assert ckpt is not None and ckpt.name == "step-2" and (run_dir / "checkpoints" / "step-1" / "COMPLETE").exists()
    state = json.loads((ckpt / "state.json").read_text())
    assert state["extra"]["sampler"]["position"] == 4 and state["extra"]["step"] == 2
    assert (ckpt / "tool_cache.sqlite").exists()
    assert (run_dir / "wandb").is_dir()

    # The final policy loads in transformers, with its tokenizer, and differs from where it started.
    model = AutoModelForCausalLM.from_pretrained(run_dir / "hf", dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(run_dir / "hf")
    assert len(tokenizer) == model.config.vocab_size
    start = load_file(str(hf_dir / "model.safetensors"))
    trained = model.state_dict()
    assert not torch.equal(trained["model.layers.0.self_attn.q_proj.weight"],
                           start["model.layers.0.self_attn.q_proj.weight"])

    assert "separate on CPU — pools actor: 2 x {'CPU': 1.0} PACK; rollout: 1 x {'CPU': 1.0}" in text
    assert "shutdown: no Ray actor of this job is alive" in text
    assert "still alive" not in text
