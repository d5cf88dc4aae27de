"""The policy's grad buffers and optimizer state leave the device between updates and come back exactly.

Two gloo ranks on CPU, where the "device" is the host: the offload still copies every optimizer storage
to a host buffer and frees the original (resized to zero bytes), and the onload copies it back. Each
layout trains twice from the same weights: update -> update, and update -> offload -> (a refused update,
a checkpoint save that onloads for its duration) -> onload -> update. The weights after the second update
must be bit-identical: any optimizer byte lost or misplaced on the way changes them.

Layouts: DP=2 with the distributed optimizer (fp32 weights: its fp32 shards are views of the weights and
must stay; Adam's moments move) and TP=2 with the non-distributed optimizer (its parameters *are* the
model's weights: only the moments move).
"""

from __future__ import annotations

import pytest
import torch

from megatron_arpo.device.local_ranks import run_distributed
from megatron_arpo.tiny.checkpoint import tiny_checkpoint

pytestmark = pytest.mark.slow

LENGTHS = [20, 7, 33, 12, 25, 9, 40, 3]
LAYOUTS = {"dp2-distopt": (1, True), "tp2": (2, False)}


def _config(tp: int, distributed_optimizer: bool):
    from megatron_arpo.config import build_config

    return build_config({
        "model": {"config": "tiny-qwen3"}, "tools": {"search": {"enabled": False}},
        "data": {"max_prompt_tokens": 24}, "rollout": {"response_length": 40, "n": 2, "initial_rollouts": 2},
        "trainer": {"train_batch_size": 4, "keep_last": 2},
        "actor": {"tensor_parallel": tp, "pipeline_parallel": 1, "params_dtype": "fp32", "micro_batch_tokens": 64,
                  "mini_batch_size": 4, "use_distributed_optimizer": distributed_optimizer, "offload": True,
                  "optimizer": {"lr": 1e-3, "adam_eps": 1e-3}},
    })


def _batch() -> dict:
    gen = torch.Generator().manual_seed(5)
    seqs = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in LENGTHS]
    return {"input_ids": seqs, "loss_mask": [[0] * 2 + [1] * (len(s) - 2) for s in seqs],
            "advantages": [1.0, -1.0, 0.5, -0.5, 0.8, -0.3, -1.2, 0.4],
            "old_logprobs": [torch.full((len(s),), -6.9) for s in seqs], "group_ids": [0, 0, 1, 1, 2, 2, 3, 3]}


def _optimizer_state(worker) -> dict:
    out = {}
    for opt in worker.optimizer.chained_optimizers:
        for i, (param, state) in enumerate(opt.optimizer.state.items()):
            for key, value in state.items():
                if isinstance(value, torch.Tensor):
                    out[f"{i}.{key}"] = value.detach().clone()
    return out


def _train(rank, world_size, hf_dir, tp, distributed_optimizer, offload, ckpt_dir):
    from megatron_arpo.actor.packing import split_for_data_parallel
    from megatron_arpo.actor.worker import MegatronActorWorker

    worker = MegatronActorWorker(_config(tp, distributed_optimizer), rank, world_size)
    worker.init_model(hf_dir=hf_dir)
    shard = split_for_data_parallel(_batch(), worker.dp, mini_batch_size=4)[worker.dp_rank]
    worker.update(shard)
    seen = {}
    if offload:
        resident = worker.offloaded_bytes()
        before = _optimizer_state(worker)
        moved = worker.offload_state()
        seen["resident_before"], seen["moved"] = resident, moved
        seen["resident_offloaded"] = worker.offloaded_bytes()
        seen["weights_kept"] = all(p.untyped_storage().nbytes() > 0 for p in worker.model.parameters())
        try:
            worker.update(shard)
        except RuntimeError as exc:
            seen["refused"] = str(exc)
        worker.save(ckpt_dir, step=1)
        seen["offloaded_after_save"] = worker.offloader.offloaded
        seen["onload"] = worker.onload_state()
        after = _optimizer_state(worker)
        seen["state_restored"] = before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
        seen["grad_zero"] = all(float(b.grad_data.abs().sum()) == 0.0 for b in worker.ddp_model.buffers)
    worker.update(shard)
    weights = {n: p.detach().clone() for n, p in worker.model.named_parameters()}
    worker.shutdown()
    return {"weights": weights, **seen}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    hf_dir = str(tiny_checkpoint("tiny-qwen3"))
    out = {}
    for name, (tp, distopt) in LAYOUTS.items():
        ckpt = str(tmp_path_factory.mktemp(name))
        out[name] = {offload: run_distributed(_train, 2, hf_dir, tp, distopt, offload, ckpt, timeout=400)
                     for offload in (False, True)}
    return out


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_offload_frees_the_device_and_onload_restores_every_byte(runs, name):
    for rank, (plain, cycled) in enumerate(zip(runs[name][False], runs[name][True])):
        assert cycled["resident_before"]["optimizer"] > 0 and cycled["resident_before"]["grad_buffers"] > 0
        assert cycled["resident_offloaded"] == {"grad_buffers": 0, "optimizer": 0}, rank
        assert cycled["moved"]["offload_optimizer_bytes"] == cycled["resident_before"]["optimizer"]
        assert cycled["moved"]["offload_grad_bytes"] == cycled["resident_before"]["grad_buffers"]
        assert cycled["onload"]["onload_optimizer_bytes"] == cycled["resident_before"]["optimizer"]
        assert cycled["weights_kept"] and cycled["state_restored"] and cycled["grad_zero"]
        assert "update with the optimizer state offloaded; call onload_state() first" in cycled["refused"]
        assert cycled["offloaded_after_save"]  # the save onloaded for its duration, then offloaded again
        assert plain["weights"].keys() == cycled["weights"].keys()
        for key, value in plain["weights"].items():
            assert torch.equal(value, cycled["weights"][key]), f"{name} rank {rank}: {key} differs"


def test_the_distributed_optimizer_keeps_its_fp32_shards_of_the_weights(runs):
    """Its optimizer parameters are views of the fp32 weights: only Adam's moments (and steps) move, so
    the optimizer bytes moved are those of the moments of this rank's shard, not of the weights."""
    for cycled in runs["dp2-distopt"][True]:
        numel = sum(p.numel() for p in cycled["weights"].values())
        moved = cycled["moved"]["offload_optimizer_bytes"]
        assert 2 * 4 * numel / 2 <= moved < 2 * 4 * numel / 2 + 4096  # exp_avg + exp_avg_sq of half the params
