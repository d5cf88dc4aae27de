"""Actor checkpoints on gloo: exact resume, loading at another TP, megatron-to-hf on a training checkpoint,
keep-last pruning and atomic completion.

Three spawns shared by the checks (module fixture):
- A (DP=2, distributed optimizer, cosine LR with warmup, 2 PPO epochs x 2 mini-batches per update): four
  updates; after update 2 a checkpoint in ``resume/`` and the exported weights; checkpoints after updates
  1, 3, 4 in ``keep/`` with keep_last=2.
- B (fresh processes, DP=2): loads ``resume/`` (latest = step-2) and runs updates 3 and 4.
- C (TP=2): loads the same checkpoint (different layout: model weights only) and exports the weights.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from megatron_arpo.actor.checkpoint import COMPLETE, latest_checkpoint, prune_checkpoints
from megatron_arpo.device.local_ranks import run_distributed
from megatron_arpo.tiny.checkpoint import tiny_checkpoint

pytestmark = pytest.mark.slow

TOTAL_OPT_STEPS = 16  # 4 updates x 2 epochs x 2 mini-batches


def _config(tp: int):
    from megatron_arpo.config import build_config

    return build_config({
        "model": {"config": "tiny-qwen3"}, "tools": {"search": {"enabled": False}},
        "data": {"max_prompt_tokens": 16}, "rollout": {"response_length": 32, "n": 2, "initial_rollouts": 2},
        "trainer": {"train_batch_size": 4, "keep_last": 3},
        "algorithm": {"use_reference": True, "kl": {"coef": 0.05}},
        "actor": {"tensor_parallel": tp, "params_dtype": "fp32", "micro_batch_tokens": 48, "mini_batch_size": 2,
                  "ppo_epochs": 2, "use_distributed_optimizer": True,
                  "optimizer": {"lr": 2e-3, "min_lr": 1e-4, "lr_schedule": "cosine", "lr_warmup_steps": 2}},
    })


def _batch(step: int) -> dict:
    gen = torch.Generator().manual_seed(100 + step)
    lengths = [int(n) for n in torch.randint(6, 30, (8,), generator=gen)]
    seqs = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in lengths]
    adv = (torch.randn(8, generator=gen)).tolist()
    return {"input_ids": seqs, "loss_mask": [[0] * 3 + [1] * (len(s) - 3) for s in seqs], "advantages": adv,
            "group_ids": [0, 0, 1, 1, 2, 2, 3, 3]}


def _run_steps(worker, steps) -> list[dict]:
    from megatron_arpo.actor.packing import split_for_data_parallel

    out = []
    for step in steps:
        shard = split_for_data_parallel(_batch(step), worker.dp, mini_batch_size=2)[worker.dp_rank]
        shard["old_logprobs"] = worker.compute_log_probs(shard)["logprobs"]
        shard["ref_logprobs"] = [lp - 0.05 for lp in shard["old_logprobs"]]
        out.append(worker.update(shard))
    return out


def _weights(worker) -> dict:
    return {n: t.clone() for bucket in worker.iter_weight_buckets(1 << 20) for n, t in bucket}


def _train_and_save(rank, world_size, hf_dir, root):
    from megatron_arpo.actor.worker import MegatronActorWorker

    worker = MegatronActorWorker(_config(1), rank, world_size)
    worker.init_model(hf_dir=hf_dir, total_steps=TOTAL_OPT_STEPS)
    metrics = _run_steps(worker, [1])
    worker.save(f"{root}/keep", {"sampler": {"epoch": 0, "position": 4}}, keep_last=2)
    metrics += _run_steps(worker, [2])
    path = worker.save(f"{root}/resume", {"sampler": {"epoch": 0, "position": 8}, "tool_cache": "x.sqlite"})
    at_2 = _weights(worker)
    metrics += _run_steps(worker, [3])
    worker.save(f"{root}/keep", {}, keep_last=2)
    metrics += _run_steps(worker, [4])
    worker.save(f"{root}/keep", {}, keep_last=2)
    return {"metrics": metrics, "at_2": at_2, "final": _weights(worker), "path": path}


def _resume(rank, world_size, hf_dir, root):
    from megatron_arpo.actor.worker import MegatronActorWorker

    worker = MegatronActorWorker(_config(1), rank, world_size)
    extra = worker.init_model(hf_dir=hf_dir, load_dir=f"{root}/resume", total_steps=TOTAL_OPT_STEPS)
    lr_after_load = worker._lr()
    metrics = _run_steps(worker, [3, 4])
    return {"extra": extra, "metrics": metrics, "final": _weights(worker), "lr_after_load": lr_after_load}


def _load_other_tp(rank, world_size, hf_dir, root):
    from megatron_arpo.actor.worker import MegatronActorWorker

    worker = MegatronActorWorker(_config(2), rank, world_size)
    extra = worker.init_model(load_dir=f"{root}/resume", total_steps=TOTAL_OPT_STEPS)
    return {"extra": extra, "weights": _weights(worker)}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("actor_ckpt")
    hf_dir = str(tiny_checkpoint("tiny-qwen3"))
    a = run_distributed(_train_and_save, 2, hf_dir, str(root), timeout=400)
    b = run_distributed(_resume, 2, hf_dir, str(root), timeout=400)
    c = run_distributed(_load_other_tp, 2, hf_dir, str(root), timeout=400)
    return {"root": root, "hf_dir": hf_dir, "a": a, "b": b, "c": c}


def test_exact_resume(runs):
    a, b = runs["a"][0], runs["b"][0]
    assert b["extra"] == {"step": 2, "sampler": {"epoch": 0, "position": 8}, "tool_cache": "x.sqlite"}
    assert b["lr_after_load"] == pytest.approx(a["metrics"][1]["lr"], rel=1e-12)
    assert a["metrics"][2]["lr"] != a["metrics"][1]["lr"]  # the schedule is moving
    for key in ("loss", "grad_norm", "clip_frac", "lr", "kl_loss"):
        for got, want in zip(b["metrics"], a["metrics"][2:]):
            assert got[key] == pytest.approx(want[key], rel=1e-6, abs=1e-9), key
    assert set(b["final"]) == set(a["final"])
    diff = max((b["final"][n] - a["final"][n]).abs().max().item() for n in a["final"])
    assert diff <= 1e-6, diff
    moved = max((a["final"][n] - a["at_2"][n]).abs().max().item() for n in a["final"])
    assert moved > 1e-3  # steps 3-4 really changed the weights


def test_load_at_other_tensor_parallel_restores_weights(runs):
    a, c = runs["a"][0], runs["c"][0]
    assert c["extra"]["step"] == 2
    assert set(c["weights"]) == set(a["at_2"])
    for name, tensor in a["at_2"].items():
        assert torch.equal(c["weights"][name], tensor), name


def test_checkpoint_layout_and_megatron_to_hf(runs, tmp_path):
    from safetensors.torch import load_file

    from conversion.dist_ckpt import convert_megatron_to_hf

    step2 = runs["root"] / "resume" / "step-2"
    assert (step2 / COMPLETE).exists()
    state = json.loads((step2 / "state.json").read_text())
    assert state["layout"] == {"tp": 1, "pp": 1, "dp": 2} and state["has_optimizer"]
    assert state["scheduler"]["num_steps"] == 8
    assert (step2 / "model" / "metadata.json").exists() and (step2 / "optim" / "metadata.json").exists()
    assert sorted(p.name for p in (step2 / "rng").iterdir()) == ["rank_00000.pt", "rank_00001.pt"]
    out = convert_megatron_to_hf(step2, tmp_path / "hf")
    tensors = load_file(str(out / "model.safetensors"))
    assert set(tensors) == set(runs["a"][0]["at_2"])
    for name, tensor in runs["a"][0]["at_2"].items():
        assert torch.equal(tensors[name], tensor), name
    assert (out / "tokenizer.json").exists()


def test_keep_last_and_latest(runs, tmp_path):
    keep = runs["root"] / "keep"
    assert sorted(p.name for p in keep.iterdir()) == ["step-3", "step-4"]
    assert latest_checkpoint(keep) == keep / "step-4"
    # An interrupted save (no COMPLETE, or still a .tmp dir) never becomes the latest.
    root = tmp_path / "ck"
    shutil.copytree(keep, root)
    (root / ".tmp-step-9").mkdir()
    shutil.copytree(root / "step-4", root / "step-7")
    (root / "step-7" / COMPLETE).unlink()
    assert latest_checkpoint(root) == root / "step-4"
    assert latest_checkpoint(root / "step-3") == root / "step-3"
    assert latest_checkpoint(tmp_path / "missing") is None
    removed = prune_checkpoints(root, 1)
    assert [p.name for p in removed] == ["step-3"]
    assert (root / "step-7").exists()  # newer than the kept one: maybe still being written


def _load_only(rank, world_size, hf_dir, load_dir):
    from megatron_arpo.actor.worker import MegatronActorWorker

    worker = MegatronActorWorker(_config(1), rank, world_size)
    try:
        worker.init_model(load_dir=load_dir, total_steps=TOTAL_OPT_STEPS)
    except Exception as exc:  # noqa: BLE001 - the test reads the message
        return f"{type(exc).__name__}: {exc}"
    return "loaded"


@pytest.mark.parametrize("what", ["model/.metadata", "model/common.pt", "rng/rank_*.pt"])
def test_the_actor_load_never_runs_code_from_a_crafted_pickle(runs, tmp_path, what):
    """Megatron's own loader, as the actor's resume calls it: the crafted file is refused, named, and nothing ran."""
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "step-2"
    shutil.copytree(runs["root"] / "resume" / "step-2", ckpt)
    shutil.rmtree(ckpt / "optim")  # the model's own files and the RNG states are under test

    class Touch:
        def __reduce__(self):
            import os

            return os.system, (f"touch {marker}",)

    targets = sorted(ckpt.glob(what))
    for path in targets:
        if path.name == ".metadata":  # a torch name first: the trick that reached plain pickle.load
            path.write_bytes(b"ctorch\nnn\n0cposix\nsystem\n(Vtouch " + str(marker).encode() + b"\ntR.")
        else:
            torch.save({"step": Touch()}, path)
    outcome = run_distributed(_load_only, 2, runs["hf_dir"], str(ckpt), timeout=400)
    assert not marker.exists(), "a checkpoint pickle ran code"
    for rank, message in enumerate(outcome):
        named = targets[rank] if len(targets) == 2 else targets[0]
        assert str(named) in message and ("refusing" in message or "refused" in message), (rank, message)
