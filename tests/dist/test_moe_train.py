"""The RL step of the tiny MoE at TP1 x DP2 x EP2 on gloo, with the two EP ranks given different work.

Rank 0's shard packs into several micro-batches, rank 1's into one short one: the expert-parallel
group agrees on a padded schedule (``MegatronActorWorker._agree_plans``), so the all-gather token
dispatcher sees equal token counts and both ranks run the same number of forwards. Without the agreement
gloo aborts or the ranks hang (the timeout fails the test). Checked: log-probs equal transformers' per
sequence, and one PPO update (ratio 1, no KL) reports the exact token-mean loss of the real tokens and
the same loss and gradient norm as at EP 1.
"""

from __future__ import annotations

import pytest
import torch

from megatron_arpo.device.local_ranks import run_distributed
from megatron_arpo.tiny.checkpoint import tiny_checkpoint
from test_actor_parallel import hf_reference

pytestmark = pytest.mark.slow

NAME = "tiny-qwen3-moe"
SHARDS = [[40, 33, 20, 18], [7]]  # sequence lengths per DP rank: 3 micro-batches against 1
ADVANTAGES = [[1.0, -0.5, 0.7, -1.2], [0.3]]


def _config(ep: int, **actor):
    """The tiny MoE's experiment at EP ``ep``; ``actor``: further actor keys (tests/dist/test_moe_routing_replay.py)."""
    from megatron_arpo.config import build_config

    return build_config({
        "model": {"config": NAME}, "tools": {"search": {"enabled": False}},
        "data": {"max_prompt_tokens": 24}, "rollout": {"response_length": 40, "n": 2, "initial_rollouts": 2},
        "trainer": {"train_batch_size": 4, "keep_last": 2},
        "algorithm": {"use_reference": False, "kl": {"coef": 0.0}},
        "actor": {"tensor_parallel": 1, "expert_parallel": ep, "params_dtype": "fp32", "mini_batch_size": 2,
                  "micro_batch_tokens": 64, "optimizer": {"lr": 1e-3}, **actor},
    })


def _sequences() -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(11)
    return [[torch.randint(0, 1000, (n,), generator=gen).tolist() for n in lengths] for lengths in SHARDS]


def _ep_rl_worker(rank, world_size, hf_dir, shards, ep) -> dict:
    from megatron_arpo.actor.worker import MegatronActorWorker

    worker = MegatronActorWorker(_config(ep), rank, world_size)
    worker.init_model(hf_dir=hf_dir)
    seqs = shards[worker.dp_rank]
    out = worker.compute_log_probs({"input_ids": seqs}, with_entropy=True)
    masks = [[0] * 3 + [1] * (len(s) - 3) for s in seqs]
    batch = {"input_ids": seqs, "loss_mask": masks, "advantages": ADVANTAGES[worker.dp_rank],
             "old_logprobs": out["logprobs"], "mini_batch": [0] * len(seqs), "num_mini_batches": 1}
    metrics = worker.update(batch)
    return {"dp_rank": worker.dp_rank, "logprobs": out["logprobs"], "entropy": out["entropy"], "metrics": metrics}


@pytest.fixture(scope="module")
def setup():
    hf_dir = str(tiny_checkpoint(NAME))
    shards = _sequences()
    results = run_distributed(_ep_rl_worker, 2, hf_dir, shards, 2, timeout=300)
    dense = run_distributed(_ep_rl_worker, 2, hf_dir, shards, 1, timeout=300)  # EP 1: no agreement
    return {"hf_dir": hf_dir, "shards": shards, "results": results, "ep1": dense}


def test_logprobs_match_each_sequence_alone(setup):
    for r in setup["results"]:
        seqs = setup["shards"][r["dp_rank"]]
        ref_logps, ref_ents = hf_reference(setup["hf_dir"], seqs)
        assert len(r["logprobs"]) == len(seqs)
        for got, want, seq in zip(r["logprobs"], ref_logps, seqs):
            assert got.shape == (len(seq),)
            assert (got.double() - want).abs().max() < 1e-4
        for got, want in zip(r["entropy"], ref_ents):
            assert (got.double() - want).abs().max() < 1e-4


def test_update_loss_counts_real_tokens_only(setup):
    # Ratio 1 (old log-probs are the current ones), no KL: the loss is minus the token-mean advantage over
    # the loss-masked tokens of both shards (token 0 never predicted), whatever padding the EP group adds.
    num = den = 0.0
    for lengths, advs in zip(SHARDS, ADVANTAGES):
        for n, a in zip(lengths, advs):
            num += a * (n - 3)
            den += n - 3
    for r in setup["results"]:
        m = r["metrics"]
        assert m["num_optimizer_steps"] == 1.0
        assert m["loss_tokens"] == den
        assert m["loss"] == pytest.approx(-num / den, rel=1e-5)
        assert m["grad_norm"] > 0


def test_update_same_as_at_ep1(setup):
    # The gradient normalisation counts the agreed (padded) micro-batches exactly: same gradient as EP 1.
    for r, d in zip(setup["results"], setup["ep1"]):
        assert r["dp_rank"] == d["dp_rank"]
        for key in ("loss", "grad_norm", "clip_frac", "approx_kl"):
            assert r["metrics"][key] == pytest.approx(d["metrics"][key], rel=1e-4, abs=1e-7), key
        for got, want in zip(r["logprobs"], d["logprobs"]):
            assert (got - want).abs().max() < 1e-5
