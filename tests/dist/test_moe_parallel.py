"""Qwen3-MoE on gloo with expert parallelism: the tiny MoE at TP2 x EP2 (4 ranks) and PP2 x EP2.

Each rank builds its Megatron stage with EP (all-to-all token dispatcher over gloo, the local spec's
sequential experts), loads its experts from the HF checkpoint, and runs a forward pass; the logits match
transformers' Qwen3MoeForCausalLM. The ranks' live parameters, put together by the mapping table
(``megatron_states_to_hf``, EP-local expert indices), give back the HF tensors bit for bit, and so does
the HF stream at EP2 (``export_hf_weights`` on every rank, and ``stage_hf_buckets`` as the weight sync
sends it: each EP rank's part of every bucket); a swap of two experts on one rank is caught by every check.

Cross-check with an independent converter: mbridge (Megatron-Core's HF bridge, its own mapping of
Qwen3-MoE) converts the same HF tensors for each rank's parameters (its names: TE's fused layer norm and
grouped-GEMM expert names, the same tensors) and splits them over TP as it loads a model; every live
parameter of every rank equals mbridge's shard bit for bit, and the swapped experts differ.
"""

from __future__ import annotations

import re
import time

import pytest
import torch

from megatron_arpo.device.local_ranks import run_distributed
from megatron_arpo.hf import mapping
from megatron_arpo.hf.checkpoint_io import HFCheckpointReader
from megatron_arpo.model_config import load_model_config
from megatron_arpo.tiny.checkpoint import tiny_checkpoint

NAME = "tiny-qwen3-moe"
BUCKET_BYTES = 64 * 2**10
TOKENS = torch.tensor([[1, 5, 17, 300, 999, 42, 7, 8], [3, 4, 900, 12, 13, 14, 15, 16]])


def _mbridge_name(name: str) -> str:
    """Our local-spec parameter name (global layer and expert indices) as mbridge names it."""
    name = re.sub(r"\.input_layernorm\.weight$", ".self_attention.linear_qkv.layer_norm_weight", name)
    return re.sub(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc[12])\.weight$", r".mlp.experts.\2.weight\1", name)


def _mbridge_mismatches(model, cfg, hf_dir: str, tp: int, tp_rank: int, pp_rank: int, pp: int, ep_rank: int,
                        ep: int) -> tuple[int, list[str]]:
    """Compare each live parameter with mbridge's conversion of the HF tensors; (checked, mismatched names)."""
    from mbridge import AutoBridge

    bridge = AutoBridge.from_pretrained(hf_dir)
    bridge.dtype = torch.float32
    # the vocabulary padded as Megatron pads it (mbridge sets these when it builds a model)
    bridge.make_vocab_size_divisible_by = cfg.make_vocab_size_divisible_by * tp
    bridge.vocab_size, bridge.padded_vocab_size = cfg.vocab_size, cfg.padded_vocab_size(tp)
    reader = HFCheckpointReader(hf_dir)
    layer_offset = mapping.stage_layers(cfg, pp_rank, pp).start
    expert_offset = ep_rank * mapping.experts_per_rank(cfg, ep)
    checked, bad = 0, []
    for name, param in model.named_parameters():
        ours = mapping.canonical_megatron_name(name, layer_offset, expert_offset)
        theirs = _mbridge_name(ours)
        hf = [reader.read(n) for n in bridge._weight_name_mapping_mcore_to_hf(theirs)]
        full = bridge._weight_to_mcore_format(theirs, hf)
        shard = bridge._weight_split_across_tp(theirs, full, param, tp)[tp_rank]
        checked += 1
        if not torch.equal(shard, param.detach()):
            bad.append(ours)
    return checked, bad


def _ep_worker(rank: int, world_size: int, hf_dir: str, tp: int, pp: int, ep: int, swap: bool) -> dict:
    from megatron.core import parallel_state as ps

    from conversion.parity import hf_logits, megatron_logits
    from megatron_arpo.actor.hf_live import (export_hf_weights, load_hf_into_megatron, plan_stage_buckets,
                                             stage_hf_buckets)
    from megatron_arpo.actor.model_builder import build_gpt_model, initialize_model_parallel

    cfg = load_model_config(NAME)
    initialize_model_parallel(tp, pp, seed=1234, expert_parallel=ep)
    model = build_gpt_model(cfg, tensor_parallel=tp, pipeline_parallel=pp, params_dtype=torch.float32,
                            use_te=False, expert_parallel=ep)
    tp_rank, pp_rank = ps.get_tensor_model_parallel_rank(), ps.get_pipeline_model_parallel_rank()
    ep_rank = ps.get_expert_model_parallel_rank()
    load_hf_into_megatron(model, cfg, hf_dir, tp_rank, tp, pp_rank, pp, ep_rank=ep_rank, ep_size=ep,
                          etp_rank=ps.get_expert_tensor_parallel_rank(), etp_size=tp)
    if swap and ep_rank == ep - 1:  # the mutation: two experts of the last EP rank trade places
        experts = model.decoder.layers[0].mlp.experts.local_experts
        with torch.no_grad():
            for name in ("linear_fc1", "linear_fc2"):
                a, b = getattr(experts[0], name).weight, getattr(experts[1], name).weight
                tmp = a.clone()
                a.copy_(b)
                b.copy_(tmp)
    mbridge_checked, mbridge_bad = _mbridge_mismatches(model, cfg, hf_dir, tp, tp_rank, pp_rank, pp, ep_rank, ep)
    logits = megatron_logits(model, cfg, TOKENS)
    diff = None if logits is None else (logits - hf_logits(hf_dir, TOKENS)).abs().max().item()
    state = {name: p.detach().clone() for name, p in model.named_parameters()}
    # The HF stream at EP2, small buckets (several per stage): the export path (every rank gets the whole
    # model) and the weight-sync path (the experts gathered onto TP rank 0 of EP rank 0, the others help).
    exported = {name: t.clone() for name, t in export_hf_weights(model, cfg, BUCKET_BYTES)}
    # The weight sync's path: each EP rank's TP rank 0 builds its own part of every planned bucket
    own_parts = []
    for bucket in stage_hf_buckets(model, cfg, BUCKET_BYTES, tp_group=ps.get_tensor_model_parallel_group(),
                                   pp_rank=pp_rank, pp_size=pp, dst=0, ep_group=ps.get_expert_model_parallel_group()):
        own_parts.append(None if bucket is None else {name: t.clone() for name, t in bucket[1]})
    rules = [r for r in mapping.rules_for_stage(mapping.bind_table(cfg), cfg, pp_rank, pp) if r.hf_outputs]
    planned = [[n for r in b for n in r.hf_outputs] for b in plan_stage_buckets(rules, cfg, torch.float32, BUCKET_BYTES)]
    return {"key": (pp_rank, tp_rank, ep_rank), "max_abs_diff": diff, "state": state, "exported": exported,
            "planned": planned, "own_parts": own_parts,
            "num_local_experts": len(model.decoder.layers[0].mlp.experts.local_experts),
            "mbridge": (mbridge_checked, mbridge_bad)}


@pytest.mark.parametrize(("tp", "pp", "ep"), [(2, 1, 2), (1, 2, 2)])
def test_expert_parallel_logits_and_bit_exact_round_trip(tp, pp, ep):
    cfg = load_model_config(NAME)
    hf_dir = str(tiny_checkpoint(NAME))
    world = 4  # DP x TP must hold EP x expert TP: tp2 -> dp2 (ep2 x etp2); pp2 -> dp2 per stage
    results = run_distributed(_ep_worker, world, hf_dir, tp, pp, ep, False, timeout=300)
    assert all(r["num_local_experts"] == cfg.num_experts // ep for r in results)
    for r in results:  # mbridge's conversion of every parameter of every rank, bit for bit
        assert r["mbridge"] == (len(r["state"]), []), r["key"]
    diffs = [r["max_abs_diff"] for r in results if r["max_abs_diff"] is not None]
    assert len(diffs) == world // pp and max(diffs) < 1e-4, diffs
    states = {r["key"]: r["state"] for r in results}  # data-parallel replicas: same key, same tensors
    assert sorted(states) == [(p, t, e) for p in range(pp) for t in range(tp) for e in range(ep)]
    back = mapping.megatron_states_to_hf(states, cfg, tp, pp, ep)
    reader = HFCheckpointReader(hf_dir)
    assert sorted(back) == sorted(reader.names())
    for name in reader.names():
        assert torch.equal(back[name], reader.read(name)), name
    # HF stream: every rank exports the whole model, bit for bit; in the weight sync's stream each stage's
    # EP ranks' TP rank 0 get their parts of that stage's buckets, and the other TP ranks nothing
    for r in results:
        assert sorted(r["exported"]) == sorted(reader.names())
        for name in reader.names():
            assert torch.equal(r["exported"][name], reader.read(name)), (r["key"], name)
    _check_own_expert_parts(results, cfg, pp, ep, reader)
    synced = {n: t for r in results for part in r["own_parts"] if part for n, t in part.items()}
    assert sorted(synced) == sorted(reader.names())


def _check_own_expert_parts(results, cfg, pp: int, ep: int, reader) -> None:
    """Bucket k's parts from the EP ranks' TP rank 0 are the planned bucket k, split by owner, bit for bit."""
    per_rank = mapping.experts_per_rank(cfg, ep)
    for p in range(pp):
        planned = next(r["planned"] for r in results if r["key"] == (p, 0, 0))
        parts = {e: next(r["own_parts"] for r in results if r["key"] == (p, 0, e)) for e in range(ep)}
        assert {len(v) for v in parts.values()} == {len(planned)} and len(planned) >= 2  # lockstep, several buckets
        for k, names in enumerate(planned):
            got = [n for e in range(ep) for n in (parts[e][k] or {})]
            assert sorted(got) == sorted(names), (p, k)  # the parts together are the bucket, nothing twice
            for e in range(1, ep):  # the other EP ranks send only their own experts
                for name in parts[e][k] or {}:
                    expert = int(re.search(r"\.experts\.(\d+)\.", name).group(1))
                    assert expert // per_rank == e, (p, k, e, name)
            for e in range(ep):
                for name, tensor in (parts[e][k] or {}).items():
                    assert torch.equal(tensor, reader.read(name)), (p, k, e, name)
    for r in results:  # the TP ranks that only contribute shards build nothing
        if r["key"][1] != 0:
            assert all(part is None for part in r["own_parts"])


def test_swapped_experts_fail_parity_and_round_trip():
    cfg = load_model_config(NAME)
    hf_dir = str(tiny_checkpoint(NAME))
    results = run_distributed(_ep_worker, 4, hf_dir, 2, 1, 2, True, timeout=300)
    assert max(r["max_abs_diff"] for r in results) > 1e-3
    assert {r["key"][2]: bool(r["mbridge"][1]) for r in results} == {0: False, 1: True}  # EP rank 1's swap
    assert all(n.endswith(("experts.local_experts.2.linear_fc1.weight", "experts.local_experts.2.linear_fc2.weight",
                           "experts.local_experts.3.linear_fc1.weight", "experts.local_experts.3.linear_fc2.weight"))
               for r in results for n in r["mbridge"][1])
    states = {r["key"]: r["state"] for r in results}
    back = mapping.megatron_states_to_hf(states, cfg, 2, 1, 2)
    reader = HFCheckpointReader(hf_dir)
    name = "model.layers.0.mlp.experts.2.gate_proj.weight"
    assert not torch.equal(back[name], reader.read(name))
    # the HF stream carries the swap too: EP rank 1's experts 2 and 3 trade places in the export and the sync
    for r in results:
        assert torch.equal(r["exported"][name], reader.read(name.replace(".2.", ".3.")))
    own = {n: t for r in results if r["key"] == (0, 0, 1) for part in r["own_parts"] if part for n, t in part.items()}
    assert torch.equal(own[name], reader.read(name.replace(".2.", ".3.")))  # EP rank 1 sends its swapped experts
    assert not torch.equal(own[name], reader.read(name))


def _actor_worker(rank: int, world_size: int, hf_dir: str, out_dir: str, fail_sender: int = -1) -> dict:
    """The actor worker at PP2 x EP2 (DP2 per stage): its weight-sync send path and its HF checkpoint.

    ``fail_sender``: that sender's transfer fails at its first bucket (an engine that died mid-sync)."""
    from megatron_arpo.actor.worker import MegatronActorWorker
    from megatron_arpo.config import build_config
    from megatron_arpo.weight_sync.senders.base import StageSender

    cfg = build_config({
        "model": {"config": NAME}, "tools": {"search": {"enabled": False}},
        "data": {"max_prompt_tokens": 8},
        "rollout": {"response_length": 16, "n": 2, "initial_rollouts": 2, "entropy_window": 8},
        "trainer": {"train_batch_size": 4, "keep_last": 2},
        "actor": {"pipeline_parallel": 2, "expert_parallel": 2, "params_dtype": "fp32", "micro_batch_tokens": 64,
                  "mini_batch_size": 2}})

    class Recorder(StageSender):  # the transport's place: keeps what the sender would put on the wire, and when
        sent: dict = {}
        events: list = []

        def _transfer(self, flat, layout, info, what):
            if info["sender"] == fail_sender:
                raise RuntimeError(f"engine 0 died during {what}")
            start = time.monotonic()
            self.sent.update({name: t.clone() for name, t in layout.views(flat)})
            time.sleep(0.05)  # a transfer that takes a while: a sender that did not wait its turn would overlap
            self.events.append((start, info["sender"], sorted(layout.names), time.monotonic()))

    worker = MegatronActorWorker(cfg, rank, world_size)
    worker.init_model(hf_dir=hf_dir)
    sync = worker._sync_state()
    sync.transport = "gloo"
    if sync.is_stage_sender:
        sync.sender = Recorder([], stage=worker.pp_rank, sender=sync.sender_index)
    try:
        report = worker.send_weights(0, BUCKET_BYTES)
    except RuntimeError as exc:
        report = {"error": str(exc)}
    sync.sender = sync.transport = None
    if fail_sender >= 0:
        return {"coords": (worker.pp_rank, worker.dp_rank, worker.tp_rank), "report": report,
                "events": list(Recorder.events)}
    worker.write_hf_checkpoint(out_dir)
    return {"coords": (worker.pp_rank, worker.dp_rank, worker.tp_rank), "streams": worker.streams_hf_weights,
            "report": report, "sent": dict(Recorder.sent), "events": list(Recorder.events)}


def test_actor_weight_sync_and_hf_checkpoint_at_pp2_ep2(tmp_path):
    hf_dir = str(tiny_checkpoint(NAME))
    results = run_distributed(_actor_worker, 4, hf_dir, str(tmp_path / "hf"), timeout=300)
    reader = HFCheckpointReader(hf_dir)
    assert all(r["streams"] for r in results)  # DP2 = EP2: both replicas hold experts, both take part
    # one sender per stage and EP rank (sender index pp x EP + ep): each sends its own experts, EP rank 0
    # the rest as well; nothing is sent twice
    senders = [r for r in results if r["sent"]]
    assert sorted(r["coords"] for r in senders) == [(0, 0, 0), (0, 1, 0), (1, 0, 0), (1, 1, 0)]
    assert sum(len(r["sent"]) for r in senders) == len(reader.names())
    sent = {name: t for r in senders for name, t in r["sent"].items()}
    assert sorted(sent) == sorted(reader.names())
    for name in reader.names():
        assert torch.equal(sent[name], reader.read(name)), name
    per_rank = load_model_config(NAME).num_experts // 2
    for r in senders:
        ep_rank = r["report"]["sender"] % 2
        assert r["report"]["sender"] // 2 == r["coords"][0] and r["report"]["tensors"] == len(r["sent"])
        experts = [int(m.group(1)) for n in r["sent"] if (m := re.search(r"\.experts\.(\d+)\.", n))]
        assert experts and all(e // per_rank == ep_rank for e in experts)
        assert all(".experts." in n for n in r["sent"]) == (ep_rank == 1)
    # the senders took turns, one at a time, stage after stage and bucket by bucket: by time, the layers
    # never go back, and EP rank 1's part of a bucket follows EP rank 0's
    events = sorted(e for r in senders for e in r["events"])
    assert len(events) > 4
    assert all(a[3] <= b[0] for a, b in zip(events, events[1:])), events  # one transfer at a time
    layers = [min(int(n.split(".")[2]) for n in names if n.startswith("model.layers.")) for _, _, names, _ in events
              if any(n.startswith("model.layers.") for n in names)]
    assert layers == sorted(layers)
    assert sum(1 for a, b in zip(events, events[1:]) if a[1] != b[1]) > 3  # interleaved, not one sender after another
    assert sum(r["report"].get("tensors", 0) for r in results) == len(reader.names())
    written = HFCheckpointReader(tmp_path / "hf")
    assert sorted(written.names()) == sorted(reader.names())
    for name in reader.names():
        assert torch.equal(written.read(name), reader.read(name)), name


def test_a_failing_ep_sender_stops_its_stage_and_the_others_do_not_hang():
    """Stage 1's EP rank 1 sender fails at its first bucket (its part of layer 1): it raises, EP rank 0 of
    stage 1 sends none of the stage's later buckets (the final norm, the LM head), and every rank returns
    (no one waits in a gather or a vote). Stage 0 went out whole before."""
    hf_dir = str(tiny_checkpoint(NAME))
    results = run_distributed(_actor_worker, 4, hf_dir, "", 3, timeout=300)
    by = {r["coords"]: r for r in results}
    assert by[(1, 1, 0)]["report"] == {"error": "engine 0 died during bucket 0 of sender 3 (stage 1, sync 0)"}
    assert [r["coords"] for r in results if "error" in r["report"]] == [(1, 1, 0)]
    assert by[(0, 0, 0)]["report"]["tensors"] + by[(0, 1, 0)]["report"]["tensors"] == len(
        [n for e in by[(0, 0, 0)]["events"] + by[(0, 1, 0)]["events"] for n in e[2]]) > 0
    sent = [n for e in by[(1, 0, 0)]["events"] for n in e[2]]
    assert sent and all(n.startswith("model.layers.1.") for n in sent), sent  # its part of layer 1, then no more
    assert not by[(1, 1, 0)]["events"]
