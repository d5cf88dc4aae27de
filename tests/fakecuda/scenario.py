"""Fake-CUDA actor scenarios: ``python tests/fakecuda/scenario.py SPEC.json OUT.json``.

SPEC: ``{"model", "tp", "pp", "dp", "ranks", "sequence_parallel", "recompute", "hf_dir", "work_dir"}``, optionally
``"ep"`` (``actor.expert_parallel``, an MoE model). The ranks run
one after the other in this process; a later rank receives the object messages an earlier one sent
(the last stage's metrics and export metadata reach the first stage). Each rank runs the actor
worker's GPU paths under ``megatron_arpo.fake_cuda.harness``: init_model (HF weights),
compute_log_probs with entropy, a PPO update with AEPO entropy-aware advantages (its entropy pass)
and the optimizer step, sft_step, checkpoint save and load, the weight export (the streamed buckets),
the weight sync's send path (each stage's buckets gathered on its sender; a recorder in the transport's
place) and write_hf_checkpoint; then a reference-role worker's log-probs.

OUT is ``{rank: result}`` (what each step saw: devices, dtypes, shapes; the collective checker's
violations; the collectives it took part in, by group; the peer messages it missed), or ``{"unavailable": reason}`` when the harness's C++ guard
cannot be built here. The harness changes process-wide torch state: run this as a subprocess.

All sequences have one length, so every micro-batch has one shape: the harness answers Megatron's
pipeline shape exchange with the schedule's shape.
"""

from __future__ import annotations

import base64
import json
import subprocess
import sys
import time
import traceback
from pathlib import Path

SEQ_LEN = 24
NUM_SEQS = 8  # per DP rank: 4 micro-batches of [2, 24] at 48 tokens each


def experiment_config(spec: dict):
    from megatron_arpo.config import build_config

    return build_config({
        "model": {"config": spec["model"], "hf_checkpoint": spec["hf_dir"]},
        "tools": {"search": {"enabled": False}},
        "data": {"max_prompt_tokens": 8}, "rollout": {"response_length": 16, "n": 2, "initial_rollouts": 2, "entropy_window": 8},
        "trainer": {"train_batch_size": 4, "keep_last": 2},
        "launcher": {"gpus_per_node": spec["tp"] * spec["pp"] * spec["dp"]},  # one fake GPU node holds the layout
        "algorithm": {"entropy_balanced_clip": True, "entropy_aware_advantage": True},
        "actor": {"tensor_parallel": spec["tp"], "pipeline_parallel": spec["pp"], "data_parallel": spec["dp"],
                  "expert_parallel": spec.get("ep", 1),
                  "sequence_parallel": spec["sequence_parallel"], "params_dtype": "bf16", "use_te": "false",
                  "recompute": spec.get("recompute", "none"),
                  "micro_batch_tokens": 2 * SEQ_LEN, "mini_batch_size": 2,
                  "checkpoint": {"fully_parallel_save": False}},
    })


def batch() -> dict:
    seqs = [[(7 * i + 3 * t) % 900 + 1 for t in range(SEQ_LEN)] for i in range(NUM_SEQS)]
    return {"input_ids": seqs, "loss_mask": [[0] * 4 + [1] * (SEQ_LEN - 4) for _ in seqs],
            "advantages": [1.0, -1.0, 0.5, -0.5, 0.8, -0.8, 0.2, -0.2],
            "old_logprobs": [[-2.0] * SEQ_LEN for _ in seqs], "group_ids": [0, 0, 1, 1, 2, 2, 3, 3]}


def describe(tensor) -> dict:
    return {"device": str(tensor.device), "dtype": str(tensor.dtype).removeprefix("torch."),
            "shape": list(tensor.shape)}


def run(spec: dict) -> dict:
    from megatron_arpo.fake_cuda.harness import fake_cuda

    world = spec["tp"] * spec["pp"] * spec["dp"]
    peers = {k: [base64.b64decode(m) for m in v] for k, v in (spec.get("peer_messages") or {}).items()}
    out: dict = {"steps": {}, "timings": {}}
    work = Path(spec["work_dir"])

    def step(name, fn):
        start = time.perf_counter()
        out["steps"][name] = fn()
        out["timings"][name] = round(time.perf_counter() - start, 2)

    with fake_cuda(world, spec["rank"], peer_messages=peers, check=False) as session:
        from megatron_arpo.actor.checkpoint import FORMAT, publish_checkpoint
        from megatron_arpo.actor.worker import MegatronActorWorker

        worker = MegatronActorWorker(experiment_config(spec), spec["rank"], world)
        out["coords"] = {"tp": worker.tp_rank, "pp": worker.pp_rank, "dp": worker.dp_rank}

        def init():
            worker.init_model()
            params = {n: describe(p) for n, p in worker.chunk.named_parameters()}
            return {"params": params, "sequence_parallel": bool(worker.model.config.sequence_parallel),
                    "chunk": type(worker.chunk).__name__,
                    "wrapped": type(worker.chunk.module).__name__ if hasattr(worker.chunk, "module") else None}

        step("init_model", init)
        data = batch()

        def logprobs():
            res = worker.compute_log_probs({"input_ids": data["input_ids"]}, with_entropy=True)
            return {"logprobs": [describe(t) for t in res["logprobs"]], "entropy": [describe(t) for t in res["entropy"]]}

        step("compute_log_probs", logprobs)
        step("update", lambda: sorted(worker.update(data)))
        step("sft_step", lambda: sorted(worker.sft_step({"input_ids": data["input_ids"],
                                                         "loss_mask": data["loss_mask"]})))

        def checkpoint():
            path = worker.save(str(work / "ckpt"), extra_state={"note": "fake-cuda"}, step=1)
            tmp = work / "ckpt" / ".tmp-step-1"
            own = {"rng": (tmp / "rng" / f"rank_{spec['rank']:05d}.pt").exists(),
                   "model": bool(list((tmp / "model").glob("*.distcp"))),
                   "optim": bool(list((tmp / "optim").glob("*.distcp")))} if tmp.exists() else None
            if spec["rank"] != 0:
                # Global rank 0 publishes a checkpoint after every rank wrote its shards; here it is not in
                # this process, so play its part (the state it would write) before loading.
                publish_checkpoint(work / "ckpt", 1, {
                    "format": FORMAT, "version": 1, "step": 1, "layout": worker._layout(),
                    "scheduler": worker.scheduler.state_dict(), "has_optimizer": True,
                    "model_config": worker.model_cfg.name, "extra": {"note": "fake-cuda"}},
                    model_cfg=worker.model_cfg)
            info = worker.load(path)
            return {"path": path, "own_files": own, "step": info["step"], "note": info.get("note")}

        step("checkpoint", checkpoint)

        def export():
            buckets = list(worker.iter_weight_buckets(bucket_bytes=1 << 16))
            tensors = [t for b in buckets for _, t in b]
            return {"num_buckets": len(buckets), "tensors": {n: describe(t) for b in buckets for n, t in b},
                    "devices": sorted({str(t.device) for t in tensors})}

        step("export", export)

        def send():  # the weight sync's send path: this stage's buckets, gathered on the sender, as they leave
            from megatron_arpo.weight_sync.senders.base import StageSender

            class Recorder(StageSender):  # the transport's place: records what would go on the wire
                sent: list = []

                def _transfer(self, flat, layout, info, what):
                    self.sent.append({"device": str(flat.device), "bytes": flat.numel(), "names": list(layout.names),
                                      "dtypes": sorted(set(layout.dtype_names)), "stage": info["stage"],
                                      "sender": info["sender"]})

            sync = worker._sync_state()
            sync.transport = "gloo"
            if sync.is_stage_sender:
                sync.sender = Recorder([], stage=worker.pp_rank, sender=sync.sender_index)
            report = worker.send_weights(0, 1 << 16)
            sync.sender = sync.transport = None
            return {"report": {k: report.get(k) for k in ("tensors", "buckets", "bytes", "stage", "sender")},
                    "sent": Recorder.sent}

        step("send_weights", send)

        def hf():
            worker.write_hf_checkpoint(work / "hf")
            return sorted(p.name for p in (work / "hf").iterdir()) if (work / "hf").exists() else None

        step("write_hf_checkpoint", hf)
        worker.shutdown()

        def reference():  # the frozen reference model (KL): same stage, no DDP or optimizer
            ref = MegatronActorWorker(experiment_config(spec), spec["rank"], world, role="reference")
            ref.init_model()
            res = ref.compute_log_probs({"input_ids": data["input_ids"]})
            out = {"chunk": type(ref.chunk).__name__,
                   "params": sorted({f"{p.device} {str(p.dtype).removeprefix('torch.')} {p.requires_grad}"
                                     for p in ref.chunk.parameters()}),
                   "logprobs": sorted({str(t.device) for t in res["logprobs"]})}
            ref.shutdown()
            return out

        step("reference", reference)
    out["violations"] = [str(v) for v in session.violations]
    collectives: dict[str, int] = {}  # "name ranks" -> how often this rank took part
    for event in session.trace:
        if event[0] == "collective":
            key = f"{event[1]} {','.join(map(str, event[2]))}"
            collectives[key] = collectives.get(key, 0) + 1
    out["collectives"] = collectives
    out["missing_peer_messages"] = session.missing_peer_messages
    out["sent_messages"] = {k: [base64.b64encode(m).decode() for m in v] for k, v in session.sent_messages.items()}
    return out


def run_ranks(spec: dict) -> dict:
    """Each rank of ``spec["ranks"]`` in turn; a later rank receives the object messages earlier ones sent."""
    results, peers = {}, dict(spec.get("peer_messages") or {})
    for rank in spec["ranks"]:
        work = Path(spec["work_dir"]) / f"rank{rank}"
        work.mkdir(parents=True, exist_ok=True)
        try:
            out = run(dict(spec, rank=rank, work_dir=str(work), peer_messages=peers))
        except BaseException:
            results[str(rank)] = {"error": traceback.format_exc()}
            break
        for key, messages in out.pop("sent_messages").items():
            peers.setdefault(key, []).extend(messages)
        results[str(rank)] = out
    return results


def main(argv: list[str]) -> int:
    from megatron_arpo.fake_cuda.harness import FakeCudaUnavailable, load_guard

    spec = json.loads(Path(argv[0]).read_text())
    try:
        load_guard()
    except FakeCudaUnavailable as exc:
        Path(argv[1]).write_text(json.dumps({"unavailable": str(exc)}))
        return 0
    results = run_ranks(spec)
    Path(argv[1]).write_text(json.dumps(results))
    return 0 if all("error" not in r for r in results.values()) else 1


def run_in_subprocess(name: str, spec: dict, work: Path) -> dict:
    """This script on ``spec`` in a fresh process (the harness changes process-wide torch state), in ``work``:
    its per-rank results, plus ``_work``."""
    (work / "spec.json").write_text(json.dumps(spec))
    proc = subprocess.run([sys.executable, __file__, str(work / "spec.json"), str(work / "out.json")],
                          capture_output=True, text=True, timeout=600)
    if not (work / "out.json").exists():
        raise AssertionError(f"scenario {name} died (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads((work / "out.json").read_text()) | {"_work": str(work)}


def child_result(script: str) -> dict:
    """Run a test module as its own child script (it prints ``RESULT <json>``); skip when the harness's guard
    cannot be built here."""
    import pytest

    proc = subprocess.run([sys.executable, script], capture_output=True, text=True, timeout=600)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("RESULT ")]
    assert lines, f"child {Path(script).name} printed no result (exit {proc.returncode}):\n{proc.stderr[-4000:]}"
    result = json.loads(lines[-1][len("RESULT "):])
    if "unavailable" in result:
        pytest.skip(f"fake CUDA harness unavailable: {result['unavailable']}")
    return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
