"""The actor's PPO loss at TP=2 and PP=2 against a naive per-sequence loss computed independently.

The expectation is written here from the formulas (docs/design/arpo_reference.md §3.2: PPO clip with dual clip c = 3 for
negative advantages, token-mean over the mini-batch's loss tokens; k3 "low_var_kl" to a reference, clamped to
[-10, 10]) with plain torch in float64, one sequence and one token at a time, on log-probs from HF transformers
(the same weights): neither the actor nor ``megatron_arpo.algo.losses`` computes it. One mini-batch holds the
whole batch, so the reported loss is the loss at the initial weights, across several micro-batches (64-token
budget) and, at PP=2, across pipeline stages.
"""

from __future__ import annotations

import math

import pytest
import torch

from megatron_arpo.device.local_ranks import run_distributed
from megatron_arpo.tiny.checkpoint import tiny_checkpoint
from test_actor_parallel import ADVANTAGES, GROUPS, actor_config, hf_reference, make_sequences

pytestmark = pytest.mark.slow

LAYOUTS = [(2, 1), (1, 2)]
CLIP, DUAL, KL_COEF = 0.2, 3.0, 0.1
PROMPT_TOKENS = 4


def loss_batch(seqs, hf_logps) -> dict:
    """Old log-probs far enough from the policy that all three PPO regimes occur; a reference for the KL."""
    gen = torch.Generator().manual_seed(11)
    old, ref = [], []
    for lp in hf_logps:
        noise = 0.8 * torch.randn(lp.shape, generator=gen, dtype=torch.float64)
        old.append((lp + noise).float())
        ref.append((lp - 0.5 * noise).float())
    masks = [[0] * min(PROMPT_TOKENS, len(s) - 1) + [1] * (len(s) - min(PROMPT_TOKENS, len(s) - 1)) for s in seqs]
    return {"input_ids": seqs, "loss_mask": masks, "advantages": ADVANTAGES, "old_logprobs": old,
            "ref_logprobs": ref, "group_ids": GROUPS}


def naive_loss(batch, logps) -> dict:
    """Per token: pg = max(-A·r, -A·clip(r, 1-ε, 1+ε)), and for A < 0 min(pg, -A·c); KL k3 = e^(ref-lp) - (ref-lp) - 1."""
    pg_sum = kl_sum = 0.0
    count = 0
    regimes = {"unclipped": 0, "clipped": 0, "dual": 0}
    for lp_seq, old_seq, ref_seq, mask, adv in zip(logps, batch["old_logprobs"], batch["ref_logprobs"],
                                                   batch["loss_mask"], batch["advantages"]):
        for t in range(1, len(mask)):  # token 0 has no prediction
            if not mask[t]:
                continue
            lp, old, ref = float(lp_seq[t]), float(old_seq[t]), float(ref_seq[t])
            r = math.exp(lp - old)
            unclipped, clipped = -adv * r, -adv * min(max(r, 1 - CLIP), 1 + CLIP)
            pg = max(unclipped, clipped)
            if adv < 0 and pg > -adv * DUAL:
                pg = -adv * DUAL
                regimes["dual"] += 1
            else:
                regimes["clipped" if clipped > unclipped else "unclipped"] += 1
            d = ref - lp
            kl = min(max(math.exp(d) - d - 1, -10.0), 10.0)
            pg_sum, kl_sum, count = pg_sum + pg, kl_sum + kl, count + 1
    pg, kl = pg_sum / count, kl_sum / count
    return {"pg_loss": pg, "kl_loss": kl, "loss": pg + KL_COEF * kl, "tokens": count, "regimes": regimes}


def _loss_worker(rank, world_size, hf_dir, tp, pp, batch):
    from megatron_arpo.actor.worker import MegatronActorWorker

    cfg = actor_config(tp, pp, mini_batch_size=4)  # 4 groups: one mini-batch, one optimizer step
    cfg = cfg.with_overrides(["algorithm.entropy_balanced_clip=false", "algorithm.entropy_aware_advantage=false",
                              f"algorithm.clip_low={CLIP}", f"algorithm.clip_high={CLIP}", f"algorithm.dual_clip={DUAL}",
                              f"algorithm.kl.coef={KL_COEF}", "algorithm.kl.kind=low_var_kl",
                              "algorithm.aggregation=token-mean"])
    worker = MegatronActorWorker(cfg, rank, world_size)
    worker.init_model(hf_dir=hf_dir)
    return worker.update(batch)


@pytest.fixture(scope="module")
def setup():
    hf_dir = str(tiny_checkpoint("tiny-qwen3"))
    seqs = make_sequences()
    hf_logps, _ = hf_reference(hf_dir, seqs)
    batch = loss_batch(seqs, hf_logps)
    expected = naive_loss(batch, hf_logps)
    results = {layout: run_distributed(_loss_worker, layout[0] * layout[1], hf_dir, *layout, batch, timeout=400)
               for layout in LAYOUTS}
    return expected, results


def test_the_naive_expectation_exercises_every_ppo_regime(setup):
    expected, _ = setup
    assert min(expected["regimes"].values()) >= 5, expected["regimes"]  # clip and dual clip both decide
    assert expected["kl_loss"] > 0.01


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}-pp{}".format(*l))
def test_actor_ppo_loss_equals_the_naive_per_sequence_loss(setup, layout):
    expected, results = setup
    for metrics in results[layout]:  # every rank reports the step's metrics
        assert metrics["num_optimizer_steps"] == 1.0
        assert metrics["loss_tokens"] == expected["tokens"]
        for key in ("pg_loss", "kl_loss", "loss"):
            assert metrics[key] == pytest.approx(expected[key], abs=2e-5), (layout, key, metrics[key], expected[key])
