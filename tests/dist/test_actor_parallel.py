"""The actor worker under TP / PP / DP on gloo: log-prob and entropy parity with HF transformers, and one
PPO update (ARPO dual clip + AEPO entropy-balanced clip + entropy-aware advantages + k3 KL) giving the same
weights at every layout.

One spawn per layout, shared by all checks through a module fixture:
(tp, pp, dp) = (1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2). Sequences of different lengths are packed
several per row (micro-batch budget 64 tokens), so the block-diagonal masks, per-sequence RoPE positions
and multi-micro-batch schedules are all exercised. Adam's eps is set to 1e-3 so the update is a smooth
function of the gradient (with eps 1e-8 the first Adam step is ~lr*sign(g), which turns float noise on
near-zero gradients into lr-sized differences), while lr 1e-3 still moves the weights by ~1e-3.
"""

from __future__ import annotations

import pytest
import torch

from megatron_arpo.device.local_ranks import run_distributed
from megatron_arpo.tiny.checkpoint import tiny_checkpoint

pytestmark = pytest.mark.slow

LENGTHS = [20, 7, 33, 12, 25, 9, 40, 3]
GROUPS = [0, 0, 1, 1, 2, 2, 3, 3]
ADVANTAGES = [1.0, -1.0, 0.7, -0.7, 1.3, -0.2, -1.1, 0.4]
LAYOUTS = [(1, 1, 1), (2, 1, 1), (1, 2, 1), (1, 1, 2)]


def actor_config(tp: int, pp: int, **actor_overrides):
    from megatron_arpo.config import build_config

    actor = {"tensor_parallel": tp, "pipeline_parallel": pp, "params_dtype": "fp32", "micro_batch_tokens": 64,
             "mini_batch_size": 2, "use_distributed_optimizer": True,
             "optimizer": {"lr": 1e-3, "adam_eps": 1e-3, "weight_decay": 0.01, "clip_grad": 1.0}}
    actor.update(actor_overrides)
    return build_config({
        "model": {"config": "tiny-qwen3"}, "tools": {"search": {"enabled": False}},
        "data": {"max_prompt_tokens": 24}, "rollout": {"response_length": 40, "n": 2, "initial_rollouts": 2},
        "trainer": {"train_batch_size": 4, "keep_last": 2},
        "algorithm": {"entropy_balanced_clip": True, "entropy_aware_advantage": True, "use_reference": True,
                      "kl": {"coef": 0.1, "kind": "low_var_kl"}},
        "actor": actor,
    })


def make_sequences() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in LENGTHS]


def hf_reference(hf_dir: str, seqs: list[list[int]]) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Token-aligned log-probs and full-softmax entropies from transformers, one sequence at a time."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32).eval()
    logps, ents = [], []
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq])
            logits = model(ids).logits[0].double()  # [s, vocab]
            logp_all = torch.log_softmax(logits, -1)
            lp = torch.zeros(len(seq), dtype=torch.float64)
            lp[1:] = logp_all[:-1].gather(-1, ids[0, 1:, None]).squeeze(-1)
            ent = torch.zeros(len(seq), dtype=torch.float64)
            ent[1:] = -(logp_all.exp() * logp_all).sum(-1)[:-1]
            logps.append(lp)
            ents.append(ent)
    return logps, ents


def update_batch(seqs, base_logps) -> dict:
    gen = torch.Generator().manual_seed(3)
    old, ref = [], []
    for lp in base_logps:
        noise = 0.3 * torch.randn(lp.shape, generator=gen, dtype=torch.float64)
        old.append((lp + noise).float())
        ref.append((lp - 0.5 * noise).float())
    masks = [[0] * min(4, len(s) - 1) + [1] * (len(s) - min(4, len(s) - 1)) for s in seqs]
    return {"input_ids": seqs, "loss_mask": masks, "advantages": ADVANTAGES, "old_logprobs": old,
            "ref_logprobs": ref, "group_ids": GROUPS}


def _layout_worker(rank, world_size, hf_dir, tp, pp, batch):
    from megatron_arpo.actor.packing import split_for_data_parallel
    from megatron_arpo.actor.worker import MegatronActorWorker

    worker = MegatronActorWorker(actor_config(tp, pp), rank, world_size)
    worker.init_model(hf_dir=hf_dir)
    shards = split_for_data_parallel(batch, worker.dp, mini_batch_size=worker.actor.mini_batch_size)
    shard = shards[worker.dp_rank]
    out = worker.compute_log_probs({"input_ids": shard["input_ids"]}, with_entropy=True)
    metrics = worker.update(shard)
    owner = (worker.tp_rank, worker.pp_rank, worker.dp_rank) == (0, 0, 0)
    buckets = [[(n, t.clone()) for n, t in bucket if owner] for bucket in worker.iter_weight_buckets(1 << 20)]
    buckets = [b for b in buckets if b]
    return {"sample_index": shard["sample_index"], "logprobs": out["logprobs"], "entropy": out["entropy"],
            "padding_fraction": out["padding_fraction"], "metrics": metrics,
            "weights": {n: t for bucket in buckets for n, t in bucket}, "num_buckets": len(buckets),
            "coords": (worker.tp_rank, worker.pp_rank, worker.dp_rank)}


@pytest.fixture(scope="module")
def setup():
    hf_dir = str(tiny_checkpoint("tiny-qwen3"))
    seqs = make_sequences()
    ref_logps, ref_ents = hf_reference(hf_dir, seqs)
    batch = update_batch(seqs, ref_logps)
    results = {}
    for tp, pp, dp in LAYOUTS:
        results[(tp, pp, dp)] = run_distributed(_layout_worker, tp * pp * dp, hf_dir, tp, pp, batch, timeout=400)
    from safetensors.torch import load_file

    initial = load_file(f"{hf_dir}/model.safetensors")
    return {"seqs": seqs, "ref_logps": ref_logps, "ref_ents": ref_ents, "results": results, "initial": initial}


def _merged(results, key):
    out = {}
    for r in results:
        for idx, value in zip(r["sample_index"], r[key]):
            if idx in out:
                assert torch.equal(out[idx], value), "ranks of one DP replica disagree"
            out[idx] = value
    return [out[i] for i in range(len(out))]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda l: "tp{}-pp{}-dp{}".format(*l))
def test_logprob_and_entropy_parity_with_hf(setup, layout):
    results = setup["results"][layout]
    logps = _merged(results, "logprobs")
    ents = _merged(results, "entropy")
    assert len(logps) == len(LENGTHS)
    for got, want, seq in zip(logps, setup["ref_logps"], setup["seqs"]):
        assert got.shape == (len(seq),) and got[0] == 0
        assert (got.double() - want).abs().max() < 1e-4
    for got, want in zip(ents, setup["ref_ents"]):
        assert (got.double() - want).abs().max() < 1e-4
    # One packed row per micro-batch (several sequences each, 149 tokens in 64-token budgets): no padding.
    assert results[0]["padding_fraction"] == 0.0


def test_update_gives_same_weights_at_every_layout(setup):
    base = setup["results"][(1, 1, 1)][0]
    names = set(base["weights"])
    assert names == set(setup["initial"])  # tied: no lm_head
    moved = max((base["weights"][n] - setup["initial"][n]).abs().max().item() for n in names)
    assert moved > 5e-4, "the update barely moved the weights; the comparison would be vacuous"
    m = base["metrics"]
    assert m["num_optimizer_steps"] == 2.0
    assert m["clip_frac"] > 0 and m["kl_loss"] > 0 and m["entropy"] > 0
    for layout in LAYOUTS[1:]:
        results = setup["results"][layout]
        owner = [r for r in results if r["coords"] == (0, 0, 0)][0]
        assert all(not r["weights"] for r in results if r is not owner)
        assert set(owner["weights"]) == names
        diff = max((owner["weights"][n] - base["weights"][n]).abs().max().item() for n in names)
        assert diff < 1e-5, (layout, diff)
        for key in ("loss", "pg_loss", "kl_loss", "grad_norm", "clip_frac", "entropy", "approx_kl"):
            assert owner["metrics"][key] == pytest.approx(m[key], rel=1e-4, abs=1e-6), (layout, key)
        # Every rank reports the same metrics (PP broadcast, DP all-reduce).
        for r in results:
            assert r["metrics"]["loss"] == pytest.approx(owner["metrics"]["loss"], rel=1e-9)
