"""ActorGroup on a real 2-raylet Ray cluster.

1. With a stand-in worker (real gloo collectives, Megatron-like TP/DP coordinates, no Megatron) at TP=2 x
   DP=2: DP shards go to the right ranks, per-sequence results come back in the batch's order from the
   representative ranks only, metrics are averaged over replicas, save/load return rank 0's answer.
2. With the real MegatronActorWorker at TP=2 (one rank per node): the tiny Qwen3 checkpoint loads and the
   log-probs match HF transformers; ``sync_weights`` streams the checkpoint's exact tensors from the
   actor ranks into two engine actors (scripted engines with the real gloo receiver), no weight byte
   through the driver, and an engine killed before a sync fails it naming the engine.
"""

from __future__ import annotations

import datetime
import sys

import pytest
import torch

ray = pytest.importorskip("ray")
from ray import cloudpickle  # noqa: E402

from megatron_arpo.actor.group import ActorGroup, mean_metrics  # noqa: E402
from megatron_arpo.config import build_config  # noqa: E402
from support.scripted import ScriptedEngine  # noqa: E402
from megatron_arpo.weight_sync.protocol import WeightSyncError  # noqa: E402

pytestmark = pytest.mark.timeout(600)

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # Ray workers cannot import this test module

LOOPBACK_ENV = {"GLOO_SOCKET_IFNAME": "lo"}


def make_config(**sections):
    raw = {"model": {"config": "tiny-qwen3"}, "rollout": {"response_length": 512},
           "data": {"max_prompt_tokens": 256}, "tools": {"search": {"enabled": False}},
           "launcher": {"gpus_per_node": 0},
           "trainer": {"timeouts": {"startup_s": 300, "logprob_s": 120, "update_s": 120, "save_s": 60, "sync_s": 120}}}
    for key, value in sections.items():
        raw[key] = {**raw.get(key, {}), **value}
    return build_config(raw)


def fake_logprobs(tokens):
    return torch.tensor([0.0] + [-(t % 7) / 10.0 for t in tokens[1:]])


class StandInWorker:
    """Megatron's rank order (TP fastest, then DP, then PP) over a real gloo group; no Megatron."""

    def __init__(self, cfg, rank, world_size, master_addr, master_port, role="policy"):
        import torch.distributed as dist

        self.rank, self.role = rank, role
        tp, pp = cfg.actor.tensor_parallel, cfg.actor.pipeline_parallel
        dp = world_size // (tp * pp)
        self.tp_rank, self.dp_rank, self.pp_rank = rank % tp, (rank // tp) % dp, rank // (tp * dp)
        self.is_last_stage = self.pp_rank == pp - 1
        dist.init_process_group("gloo", init_method=f"tcp://{master_addr}:{master_port}", rank=rank,
                                world_size=world_size, timeout=datetime.timedelta(seconds=120))
        self.loaded = None

    def init_model(self, hf_dir=None, load_dir=None, total_steps=None):
        self.loaded = hf_dir
        return {"hf_dir": hf_dir, "rank": self.rank}

    def compute_log_probs(self, batch, with_entropy=False):
        if self.tp_rank != 0:  # only the representative rank's answer may be used
            return {"logprobs": [torch.full((len(s),), -999.0) for s in batch["input_ids"]], "padding_fraction": 1.0}
        out = {"logprobs": [fake_logprobs(s) for s in batch["input_ids"]], "padding_fraction": 0.1 * self.dp_rank}
        if with_entropy:
            out["entropy"] = [torch.full((len(s),), float(self.dp_rank)) for s in batch["input_ids"]]
        return out

    def update(self, batch):
        import torch.distributed as dist

        count = torch.tensor([float(len(batch["input_ids"]))])
        dist.all_reduce(count)  # over all ranks: every replica's TP ranks got the same shard
        return {"loss": float(self.dp_rank), "global_sequences": count.item(),
                "mini_batches": float(batch["num_mini_batches"])}

    def save(self, path, extra_state, step=None):
        return f"{path}/rank{self.rank}:{extra_state['step']}"

    def load(self, path):
        return {"step": 7, "rank": self.rank}

    def shutdown(self):
        import torch.distributed as dist

        dist.destroy_process_group()


def test_mean_metrics_averages_keys_present():
    assert mean_metrics([{"a": 1.0, "b": 2.0}, {"a": 3.0}]) == {"a": 2.0, "b": 2.0}


def test_stand_in_tp2_dp2_split_merge_and_reduce(ray_two_nodes):
    cfg = make_config(actor={"tensor_parallel": 2, "data_parallel": 2, "mini_batch_size": 2})
    group = ActorGroup(cfg, worker_cls=StandInWorker, hf_dir="/nowhere", num_cpus_per_rank=0.5, env=LOOPBACK_ENV,
                       strategy="SPREAD")
    try:
        assert group.world_size == 4 and group.dp == 2
        assert group.init_state == {"hf_dir": "/nowhere", "rank": 0}
        assert [lay["dp_rank"] for lay in group.layout] == [0, 0, 1, 1]
        assert group.representatives == [0, 2]
        assert len({p.node_id for p in group.placement}) == 2  # SPREAD over both raylets

        seqs = [[5, 1, 2, 3], [9, 8], [4, 4, 4, 4, 4, 4], [1, 2, 3], [7, 7, 7, 7, 7]]
        out = group.compute_log_probs({"input_ids": seqs, "group_ids": [0, 0, 1, 1, 2]}, with_entropy=True)
        assert len(out["logprobs"]) == len(seqs)
        for seq, lp in zip(seqs, out["logprobs"]):
            assert torch.equal(lp, fake_logprobs(seq))  # original order, never a TP-rank-1 answer
        owners = {float(e[0]) for e in out["entropy"]}
        assert owners == {0.0, 1.0}  # both replicas did part of the work
        assert out["padding_fraction"] == pytest.approx(0.05)

        seqs.append([2, 2])
        metrics = group.update({"input_ids": seqs, "group_ids": [0, 0, 1, 1, 2, 2], "advantages": [1.0] * 6})
        assert metrics["loss"] == pytest.approx(0.5)  # mean of replica 0 and 1
        assert metrics["global_sequences"] == 2 * len(seqs)  # TP=2 copies of a partition of the batch
        assert metrics["mini_batches"] == 2  # 3 groups in mini-batches of 2

        assert group.save("/ckpt", {"step": 3}) == "/ckpt/rank0:3"
        assert group.load("/ckpt") == {"step": 7, "rank": 0}
    finally:
        group.shutdown()


class WeightHoldingEngine(ScriptedEngine):
    """A scripted engine (the real gloo receiver, loading into a dict) whose weights the test can read."""

    def __init__(self, index):
        super().__init__(lambda ctx, req: None, engine_index=index)

    async def held(self):
        return dict(self.weights)


class EngineFailingAtBucket(WeightHoldingEngine):
    """Fails its first ``update_weights`` of bucket ``bucket`` without receiving: the sender learns of it only
    after it has gathered the next bucket, in the middle of its stage."""

    def __init__(self, index, bucket):
        super().__init__(index)
        self.fail_bucket = bucket

    async def update_weights(self, update_info):
        if update_info.get("bucket") == self.fail_bucket:
            self.fail_bucket = None
            raise RuntimeError(f"injected: engine {self.engine_index} drops bucket {update_info['bucket']}")
        return await super().update_weights(update_info)


def _hf_token_logprobs(hf_dir, seqs):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for seq in seqs:
            ids = torch.tensor([seq])
            logp = torch.log_softmax(model(input_ids=ids).logits.float()[0, :-1], dim=-1)
            out.append(torch.cat([torch.zeros(1), logp.gather(-1, ids[0, 1:, None])[:, 0]]))
    return out


@pytest.mark.slow
def test_megatron_tp2_on_two_nodes_matches_hf(ray_two_nodes, tmp_path):
    from safetensors.torch import load_file

    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    hf_dir = str(tiny_checkpoint("tiny-qwen3"))
    cfg = make_config(model={"config": "tiny-qwen3", "hf_checkpoint": hf_dir},
                      actor={"tensor_parallel": 2, "pipeline_parallel": 1, "data_parallel": 1,
                             "params_dtype": "fp32", "use_te": "false", "use_distributed_optimizer": False},
                      rollout={"response_length": 512, "sync_bucket_mb": 1})
    group = ActorGroup(cfg, strategy="STRICT_SPREAD", env=LOOPBACK_ENV)
    try:
        assert len({p.node_id for p in group.placement}) == 2  # TP ranks on both raylets
        seqs = [[3, 17, 256, 42, 999, 5, 64], [11, 12, 13, 700, 14]]
        out = group.compute_log_probs({"input_ids": seqs})
        expected = _hf_token_logprobs(hf_dir, seqs)
        for got, want in zip(out["logprobs"], expected):
            assert got.shape == want.shape
            assert torch.max(torch.abs(got - want)).item() < 1e-4

        engines = [ray.remote(WeightHoldingEngine).options(num_cpus=0).remote(i) for i in range(2)]
        report = group.sync_weights(engines, verify=True)
        original = load_file(f"{hf_dir}/model.safetensors")
        for held in ray.get([e.held.remote() for e in engines]):
            # The tied LM head arrives as lm_head.weight too (see megatron_arpo.actor.sync_sender).
            assert set(held) == set(original) | {"lm_head.weight"}
            for name, tensor in original.items():
                assert torch.equal(held[name], tensor), name
            assert torch.equal(held["lm_head.weight"], original["model.embed_tokens.weight"])
        assert report["tensors"] == len(original) + 1 and report["buckets"] >= 2  # 1 MB buckets
        # The stage sender packs into its two kept buffers (bucket k travels while k+1 is packed): two
        # allocated, then reused or grown (a larger bucket), never a third while one is free.
        assert report["send_buffers"]["fresh"] == 2 and report["send_buffers"]["reused"] > 0
        assert report["send_buffer_bytes"] > 0
        assert report["driver_weight_bytes"] == 0 and 0 < report["driver_bytes"] < 64 * 1024
        assert report["verified_after_load"] and set(report["verified_after_load"]) == set(report["sampled"])

        # An engine failing mid-stage: the sender's TP peer must finish the stage (not wait in the next
        # gather forever), and the next sync, into healthy engines, forms a new transfer group and succeeds.
        failing = [ray.remote(WeightHoldingEngine).options(num_cpus=0).remote(0),
                   ray.remote(EngineFailingAtBucket).options(num_cpus=0).remote(1, 0)]
        with pytest.raises(WeightSyncError, match=r"^weight sync: engine 1 failed during bucket 0 of sender 0 "
                                                  r"\(stage 0, sync \d+\)"):
            group.sync_weights(failing, timeout=60)
        again = group.sync_weights(engines, timeout=60)
        assert again["tensors"] == len(original) + 1 and again["send_buffers"]["fresh"] == 2
        for held in ray.get([e.held.remote() for e in engines]):  # reused buffers on both sides: still exact
            for name, tensor in original.items():
                assert torch.equal(held[name], tensor), name

        ray.kill(engines[1])  # asynchronous: the death shows at the start or at the first bucket
        with pytest.raises(WeightSyncError, match=r"^weight sync: engine 1 died during (start_weight_update|"
                                                  r"bucket 0 of sender 0 \(stage 0, sync \d+\)) \(\w+Error"):
            group.sync_weights(engines)

        # One PPO update through the group moves the weights; a checkpoint restores the updated ones.
        batch = {"input_ids": seqs, "loss_mask": [[0, 0, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1]],
                 "advantages": [1.0, -1.0], "old_logprobs": out["logprobs"], "group_ids": [0, 0]}
        metrics = group.update(batch)
        assert metrics["num_optimizer_steps"] >= 1 and torch.isfinite(torch.tensor(metrics["grad_norm"]))
        after = group.compute_log_probs({"input_ids": seqs})["logprobs"]
        assert any(not torch.allclose(a, b) for a, b in zip(after, out["logprobs"]))
        saved = group.save(str(tmp_path / "ckpt"), {"note": "x"}, step=1)
        group.update({**batch, "old_logprobs": after})  # move away from the saved weights ...
        assert group.load(saved)["note"] == "x"  # ... and back
        reloaded = group.compute_log_probs({"input_ids": seqs})["logprobs"]
        assert all(torch.equal(a, b) for a, b in zip(after, reloaded))
    finally:
        group.shutdown()
