"""The actor's GPU code paths, run on fake CUDA devices (megatron_arpo.fake_cuda.harness): tiny-qwen3
(tied embeddings, q/k norm) and tiny-qwq (QKV bias, untied), first and last pipeline stage of
TP=2 PP=2 DP=2, with and without sequence parallelism (with SP: selective and full recompute).

Every scenario runs init_model (HF weights) -> compute_log_probs -> update (AEPO entropy pass +
optimizer step) -> sft_step -> checkpoint save and load -> weight export -> write_hf_checkpoint, then a
reference-role worker's compute_log_probs, with
the collective checker on (a non-CUDA tensor into an NCCL group is a failure naming the call site).
Ranks 4 (tp0, dp0, pp1: the last stage) and 0 (the first stage, global rank 0: it writes the HF
checkpoint) run in one subprocess per scenario, rank 4 first so that rank 0 receives its messages.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_arpo.tiny.checkpoint import tiny_checkpoint
from scenario import run_in_subprocess

pytestmark = pytest.mark.slow

LAST, FIRST = 4, 0  # Megatron's rank order tp-cp-ep-dp-pp: rank = tp + 2 * dp + 4 * pp
SCENARIOS = {  # name -> (model, sequence_parallel, recompute)
    "qwen3": ("tiny-qwen3", False, "none"),
    "qwq": ("tiny-qwq", False, "none"),
    "qwen3-sp": ("tiny-qwen3", True, "selective"),
    "qwq-sp": ("tiny-qwq", True, "full"),  # recompute runs forward code in backward, on autograd's thread
}


def _run(name: str, root: Path) -> dict:
    model, sp, recompute = SCENARIOS[name]
    work = root / name
    work.mkdir()
    spec = {"model": model, "tp": 2, "pp": 2, "dp": 2, "ranks": [LAST, FIRST], "sequence_parallel": sp,
            "recompute": recompute,
            "hf_dir": str(tiny_checkpoint(model)), "work_dir": str(work)}
    return run_in_subprocess(name, spec, work)


@pytest.fixture(scope="module")
def results(tmp_path_factory) -> dict:
    root = tmp_path_factory.mktemp("fakecuda")
    for model in {m for m, _, _ in SCENARIOS.values()}:
        tiny_checkpoint(model)  # build once, before two subprocesses would race for it
    with ThreadPoolExecutor(max_workers=2) as pool:  # two cores: two scenarios at a time
        out = dict(zip(SCENARIOS, pool.map(lambda n: _run(n, root), SCENARIOS)))
    unavailable = [r["unavailable"] for r in out.values() if "unavailable" in r]
    if unavailable:
        pytest.skip(f"fake CUDA harness unavailable: {unavailable[0]}")
    return out


def _rank(results, name, rank) -> dict:
    result = results[name][str(rank)] if str(rank) in results[name] else None
    assert result is not None, f"{name}: rank {rank} did not run: {results[name]}"
    assert "error" not in result, f"{name} rank {rank} failed:\n{result['error']}"
    return result


def _hf_header(path: Path) -> dict:
    with open(path, "rb") as fh:
        header = json.loads(fh.read(int.from_bytes(fh.read(8), "little")))
    header.pop("__metadata__", None)
    return {name: (v["dtype"], v["shape"]) for name, v in header.items()}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("rank", [FIRST, LAST])
def test_no_cpu_tensor_reaches_an_nccl_collective(results, name, rank):
    assert _rank(results, name, rank)["violations"] == []


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("rank", [FIRST, LAST])
def test_stage_lives_on_its_gpu_in_bf16_under_float16module(results, name, rank):
    init = _rank(results, name, rank)["steps"]["init_model"]
    assert (init["chunk"], init["wrapped"]) == ("DistributedDataParallel", "Float16Module")
    assert init["sequence_parallel"] is SCENARIOS[name][1]
    devices = {p["device"] for p in init["params"].values()}
    dtypes = {p["dtype"] for p in init["params"].values()}
    assert devices == {f"cuda:{rank % 8}"} and dtypes == {"bfloat16"}, init["params"]
    names = set(init["params"])
    has_embedding = any("word_embeddings" in n for n in names)
    has_output = any(n.endswith("output_layer.weight") for n in names)
    assert has_embedding == (rank == FIRST) and has_output == (rank == LAST)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
@pytest.mark.parametrize("rank", [FIRST, LAST])
def test_log_probs_update_sft_and_checkpoint_ran(results, name, rank):
    r = _rank(results, name, rank)
    steps = r["steps"]
    for key in ("logprobs", "entropy"):
        got = steps["compute_log_probs"][key]
        assert len(got) == 8 and all(t == {"device": "cpu", "dtype": "float32", "shape": [24]} for t in got)
    assert {"loss", "pg_loss", "entropy", "grad_norm", "num_optimizer_steps"} <= set(steps["update"])
    assert {"loss", "grad_norm", "lr"} <= set(steps["sft_step"])
    ckpt = steps["checkpoint"]
    assert (ckpt["step"], ckpt["note"]) == (1, "fake-cuda") and ckpt["path"].endswith("step-1")
    ref = steps["reference"]  # frozen, on the GPU in bf16 under Float16Module; results on the host
    assert ref == {"chunk": "Float16Module", "params": [f"cuda:{rank % 8} bfloat16 False"], "logprobs": ["cpu"]}
    if rank != FIRST:  # this rank wrote its own shards; rank 0's publishing was played by the scenario
        assert ckpt["own_files"] == {"rng": True, "model": True, "optim": True}
    # Only the last stage misses messages: the first stage's export buckets (rank 0 ran after it).
    missed = r["missing_peer_messages"]
    assert all("_broadcast_bucket" in m for m in missed) and (rank == FIRST) == (not missed), missed


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_weight_export_and_hf_checkpoint_cover_the_model_on_the_device(results, name):
    model = SCENARIOS[name][0]
    source = _hf_header(Path(tiny_checkpoint(model)) / "model.safetensors")  # the checkpoint the run loaded
    first, last = _rank(results, name, FIRST), _rank(results, name, LAST)
    exported = first["steps"]["export"]["tensors"]
    assert first["steps"]["export"]["devices"] == ["cuda:0"]
    assert {n: t["shape"] for n, t in exported.items()} == {n: shape for n, (_, shape) in source.items()}
    assert {t["dtype"] for t in exported.values()} == {"bfloat16"}
    # The last stage exports its own layer (global layer 1), the final norm and (untied) the lm_head.
    own = {n for n in source if n.startswith("model.layers.1.") or n in ("model.norm.weight", "lm_head.weight")}
    assert set(last["steps"]["export"]["tensors"]) == own and last["steps"]["export"]["devices"] == ["cuda:4"]
    # The weight sync: each stage's sender sends its own layers, packed on its GPU, in the params' dtype;
    # together the two stages send the model once (plus lm_head.weight when tied: see actor/sync_sender.py).
    tied = "lm_head.weight" not in source
    sent = {}
    for rank, stage, device in ((first, 0, "cuda:0"), (last, 1, "cuda:4")):
        buckets = rank["steps"]["send_weights"]["sent"]
        assert {(b["device"], b["stage"]) for b in buckets} == {(device, stage)}
        assert {d for b in buckets for d in b["dtypes"]} == {"bfloat16"}
        names = [n for b in buckets for n in b["names"]]
        assert not set(names) & set(sent) and len(names) == len(set(names))
        sent.update(dict.fromkeys(names, stage))
        report = rank["steps"]["send_weights"]["report"]
        assert report == {"tensors": len(names), "buckets": len(buckets), "stage": stage, "sender": stage,
                          "bytes": sum(b["bytes"] for b in buckets)}
    assert set(sent) == set(source) | ({"lm_head.weight"} if tied else set())
    assert {n for n, stage in sent.items() if stage == 1} == own
    # Global rank 0 wrote the HF checkpoint: every tensor, bf16, in the source's shapes.
    files = first["steps"]["write_hf_checkpoint"]
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= set(files)
    written = _hf_header(Path(results[name]["_work"]) / f"rank{FIRST}" / "hf" / "model.safetensors")
    assert written == {n: ("BF16", shape) for n, (_, shape) in source.items()}
    assert last["steps"]["write_hf_checkpoint"] is None  # not the writer
