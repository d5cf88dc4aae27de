"""Routing replay (R3) in the actor: the tiny MoE's forwards use the recorded experts, at EP 1 and EP 2 (gloo).

The routing is recorded from the actor's own forward (``compute_log_probs(record_routing=True)``; the engine's
capture is tests/integration/test_moe_engine.py), then every router's weight is perturbed as an RL
step would move it. Without replay the routers then pick other experts for some tokens; with replay
(``actor.moe_routing_replay``) the log-prob pass and the PPO update use exactly the recorded experts.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from megatron_arpo.device.local_ranks import run_distributed
from megatron_arpo.tiny.checkpoint import tiny_checkpoint
from test_moe_train import _config as moe_config

pytestmark = pytest.mark.slow

NAME = "tiny-qwen3-moe"
LENGTHS = [[30, 21, 12], [17, 9]]  # per DP rank


def _config(ep: int):
    return moe_config(ep, moe_routing_replay=True)


def _perturb_routers(model) -> None:
    # The same draw on every rank (the router is replicated over the EP group), as an RL step moves it.
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            if name.endswith("router.weight"):
                param.add_(torch.randn(param.shape, generator=gen) * param.std())


def _replay_worker(rank, world_size, hf_dir, ep) -> dict:
    from megatron_arpo.actor import routing_replay
    from megatron_arpo.actor.worker import MegatronActorWorker

    worker = MegatronActorWorker(_config(ep), rank, world_size)
    worker.init_model(hf_dir=hf_dir)
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in LENGTHS[worker.dp_rank]]
    plain = dataclasses.replace(worker.actor, moe_routing_replay=False)
    replay = worker.actor
    worker.actor = plain
    recorded = worker.compute_log_probs({"input_ids": seqs}, record_routing=True)
    _perturb_routers(worker.model)
    moved = worker.compute_log_probs({"input_ids": seqs}, record_routing=True)  # no replay: own routing
    worker.actor = replay
    batch = {"input_ids": seqs, "routed_experts": recorded["routed_experts"]}
    replayed = worker.compute_log_probs(batch, record_routing=True)
    missing = None
    try:
        worker.compute_log_probs({"input_ids": seqs})
    except ValueError as exc:
        missing = str(exc)
    # The update: record what its forward used, compare with the micro-batch's recorded routing.
    masks = [[0] * 2 + [1] * (len(s) - 2) for s in seqs]
    update = dict(batch, loss_mask=masks, advantages=[1.0, -0.5, 0.7][:len(seqs)],
                  old_logprobs=replayed["logprobs"], mini_batch=[0] * len(seqs), num_mini_batches=1)
    plans = worker._agree_plans(worker._plan([len(s) for s in seqs], worker.actor.micro_batch_tokens))
    mbs = worker._micro_batches(plans, seqs, routing=recorded["routed_experts"])
    routing_replay.record_routing(worker.model)
    metrics = worker.update(update)
    used = [routing_replay.recorded_routing(worker.model, i, *mb.tokens.shape) for i, mb in enumerate(mbs)]
    routing_replay.stop_recording(worker.model)
    return {"recorded": recorded, "moved": moved, "replayed": replayed, "missing": missing, "metrics": metrics,
            "update_routing": [mb.routing for mb in mbs], "update_used": used}


@pytest.fixture(scope="module", params=[1, 2], ids=["ep1", "ep2"])
def results(request):
    return run_distributed(_replay_worker, 2, str(tiny_checkpoint(NAME)), request.param, timeout=300)


def test_without_replay_the_perturbed_routers_choose_other_experts(results):
    changed = sum(int((a != b).any(dim=-1).sum()) for r in results
                  for a, b in zip(r["recorded"]["routed_experts"], r["moved"]["routed_experts"]))
    assert changed > 0
    for r in results:  # and the log-probs move with them
        assert max(float((a - b).abs().max()) for a, b in zip(r["recorded"]["logprobs"], r["moved"]["logprobs"])) > 0


def test_logprob_pass_replays_the_recorded_experts(results):
    for r in results:
        for want, got in zip(r["recorded"]["routed_experts"], r["replayed"]["routed_experts"]):
            assert torch.equal(want, got)
        for moved, replayed in zip(r["moved"]["logprobs"], r["replayed"]["logprobs"]):
            assert not torch.equal(moved, replayed)  # replay changed the forward


def test_update_replays_the_recorded_experts(results):
    for r in results:
        assert r["metrics"]["num_optimizer_steps"] == 1.0
        assert len(r["update_used"]) == len(r["update_routing"])  # one forward per micro-batch
        compared = 0
        for want, got in zip(r["update_routing"], r["update_used"]):
            real = (want >= 0).all(dim=-1)  # padding slots (and EP 2's agreed padding micro-batches) route themselves
            assert torch.equal(want.long()[real], got[real])
            compared += int(real.sum())
        assert compared == sum(LENGTHS[0]) * 2 or compared == sum(LENGTHS[1]) * 2  # every token, both layers


def test_replay_without_routing_names_the_fix(results):
    for r in results:
        assert "routed_experts" in r["missing"] and "moe_routing_replay: false" in r["missing"]
