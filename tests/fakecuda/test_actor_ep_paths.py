"""The actor's GPU code paths at expert parallelism 2 on fake CUDA devices (megatron_arpo.fake_cuda.harness):
tiny-qwen3-moe at TP1 x DP2 x EP2 and TP2 x DP2 x EP2 (with sequence parallelism and full recompute), on the GPU branch of the MoE token dispatcher
(Megatron's all-to-all dispatcher, with its side stream and device-to-host split sizes).

Each scenario runs two ranks of one EP group through init_model (HF weights, each EP rank its experts) ->
compute_log_probs -> update (the optimizer step) -> sft_step -> checkpoint -> weight export -> the weight
sync's send path -> write_hf_checkpoint -> a reference worker's log-probs (tests/fakecuda/scenario.py),
with the collective checker on: the dispatcher's all-to-all and its token-count all-gather, the
schedule agreement's all-reduce (``MegatronActorWorker._agree_plans``), the weight sync's turn votes between
the EP ranks' senders and the experts' broadcasts of the HF export must take CUDA tensors only. The harness routes tokens over the experts as a balanced
router would (see the harness docstring), so every expert receives tokens.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_arpo.tiny.checkpoint import tiny_checkpoint
from scenario import run_in_subprocess

pytestmark = pytest.mark.slow

MODEL = "tiny-qwen3-moe"
# name -> (tp, dp, ep, ranks run: the EP group of rank 0, the other EP rank first so that rank 0 gets its
# messages; sequence parallel, recompute). Megatron's MoE layer refuses to train at TP > 1 without sequence
# parallelism: TP2 runs as the Qwen3-30B-A3B recipe does (SP, full recompute).
SCENARIOS = {"tp1-ep2": (1, 2, 2, [1, 0], False, "none"), "tp2-ep2": (2, 2, 2, [2, 0], True, "full")}


def _run(name: str, root: Path) -> dict:
    tp, dp, ep, ranks, sp, recompute = SCENARIOS[name]
    work = root / name
    work.mkdir()
    spec = {"model": MODEL, "tp": tp, "pp": 1, "dp": dp, "ep": ep, "ranks": ranks, "sequence_parallel": sp,
            "recompute": recompute, "hf_dir": str(tiny_checkpoint(MODEL)), "work_dir": str(work)}
    return run_in_subprocess(name, spec, work)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fakecuda-ep")
    tiny_checkpoint(MODEL)  # build once, before two subprocesses would race for it
    with ThreadPoolExecutor(max_workers=2) as pool:
        out = dict(zip(SCENARIOS, pool.map(lambda n: _run(n, root), SCENARIOS)))
    unavailable = [r["unavailable"] for r in out.values() if "unavailable" in r]
    if unavailable:
        pytest.skip(f"fake CUDA harness unavailable: {unavailable[0]}")
    return out


def _rank(results, name, rank) -> dict:
    result = results[name].get(str(rank))
    assert result is not None, f"{name}: rank {rank} did not run: {results[name]}"
    assert "error" not in result, f"{name} rank {rank} failed:\n{result['error']}"
    return result


def _count(result: dict, collective: str, ranks: list[int]) -> int:
    return result["collectives"].get(f"{collective} {','.join(map(str, ranks))}", 0)


PARAMS = [(name, rank) for name, (_, _, _, ranks, _, _) in SCENARIOS.items() for rank in ranks]


@pytest.mark.parametrize("name,rank", PARAMS)
def test_no_cpu_tensor_reaches_an_nccl_collective_at_ep2(results, name, rank):
    assert _rank(results, name, rank)["violations"] == []


@pytest.mark.parametrize("name,rank", PARAMS)
def test_the_ep_collectives_ran_on_the_device(results, name, rank):
    tp, _, _, ep_ranks, _, _ = SCENARIOS[name]
    r = _rank(results, name, rank)
    ep_group = sorted(ep_ranks)  # the EP group of rank 0 (both ranks run are in it)
    tp_ep_group = sorted(ep_group + ([e + 1 for e in ep_group] if tp == 2 else []))  # expert TP x EP
    # the all-to-all dispatcher: tokens and probs over the EP group in every MoE layer's forward and backward
    assert _count(r, "all_to_all_single", ep_group) > 0, r["collectives"]
    # its token counts, gathered over expert TP x EP (an all-gather into a tensor), and the schedule agreement
    assert _count(r, "all_gather_into_tensor", tp_ep_group) > 0, r["collectives"]
    assert _count(r, "all_reduce", tp_ep_group) > 0, r["collectives"]
    # the HF export shares each expert over the EP group; the weight sync sends no expert across it
    assert _count(r, "broadcast", ep_group) > 0, r["collectives"]
    assert _count(r, "send", ep_group) == 0, r["collectives"]


@pytest.mark.parametrize("name,rank", PARAMS)
def test_each_ep_rank_holds_its_experts_on_its_gpu_and_every_step_ran(results, name, rank):
    r = _rank(results, name, rank)
    params = r["steps"]["init_model"]["params"]
    experts = {n for n in params if ".experts.local_experts." in n}
    assert experts and {params[n]["device"] for n in params} == {f"cuda:{rank % 8}"}
    assert {params[n]["dtype"] for n in params} == {"bfloat16"}
    assert {n.split(".local_experts.")[1].split(".")[0] for n in experts} == {"0", "1"}  # 4 experts / EP 2
    got = r["steps"]["compute_log_probs"]["logprobs"]
    assert len(got) == 8 and all(t == {"device": "cpu", "dtype": "float32", "shape": [24]} for t in got)
    assert {"loss", "pg_loss", "grad_norm", "num_optimizer_steps"} <= set(r["steps"]["update"])


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_each_ep_rank_sends_its_experts_and_rank_zero_writes_every_expert(results, name):
    source = Path(tiny_checkpoint(MODEL)) / "model.safetensors"
    with open(source, "rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    header.pop("__metadata__", None)
    first, other_rank = _rank(results, name, 0), SCENARIOS[name][3][0]
    other = _rank(results, name, other_rank)
    mine = [n for b in first["steps"]["send_weights"]["sent"] for n in b["names"]]
    theirs = [n for b in other["steps"]["send_weights"]["sent"] for n in b["names"]]
    # each EP rank's sender sends its own experts from its own GPU (EP rank 0 everything else too): once each
    assert sorted(mine + theirs) == sorted(header)
    assert theirs and all(".mlp.experts.2." in n or ".mlp.experts.3." in n for n in theirs)  # 4 experts / EP 2
    assert not any(".mlp.experts.2." in n or ".mlp.experts.3." in n for n in mine)
    assert {b["device"] for b in first["steps"]["send_weights"]["sent"]} == {"cuda:0"}
    assert {b["device"] for b in other["steps"]["send_weights"]["sent"]} == {f"cuda:{other_rank % 8}"}
    assert {b["sender"] for b in first["steps"]["send_weights"]["sent"]} == {0}  # sender pp x EP + ep
    assert {b["sender"] for b in other["steps"]["send_weights"]["sent"]} == {1}
    assert other["steps"]["send_weights"]["report"]["tensors"] == len(theirs)
    assert first["steps"]["write_hf_checkpoint"] and "model.safetensors" in first["steps"]["write_hf_checkpoint"]
