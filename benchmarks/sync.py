"""Weight-sync benchmark: the actor ranks stream into an engine; driver bytes, sender memory, wall time.

A private one-node Ray cluster; an `ActorGroup` of real Megatron ranks (random init, a wide untied Qwen3:
``--hidden``, ``--layers``, vocab 32000, fp32) at TP=1 and TP=2; one engine actor (`ScriptedEngine`: the
project's gloo receiver, loading into a dict instead of a vLLM model, so the numbers are the sync's own).
Per TP, after one warm-up sync (forms the transfer group), ``--repeats`` syncs, each followed by a
``state_dict`` clone on every rank in the same run. Reported per TP:

- driver bytes per sync: all the pickled arguments and answers the driver sent or received, and the
  tensor bytes among them (weights: must be 0);
- sender peak extra memory: on actor rank 0 (the stage sender), the resident-set high-water mark during a
  sync (reset before it through ``/proc/self/clear_refs``) minus the resident set before it, in units of
  the sync's largest bucket (target <= 2.5); the sender keeps its two bucket buffers between syncs, so
  they are in that baseline: the table also gives the peak with them added back, and the bytes kept;
- sync wall time per GB of HF tensors over the ``state_dict`` clone time per GB of rank 0's local
  parameters (target <= 2x; the old driver-side export measured 6.2x at TP=2, benchmarks/RESULTS.md).

``--train``: instead, two 2-step ``megatron-arpo train`` runs of configs/test-e2e.yaml (tiny Qwen3, the
e2e task, ``trainer.placement: separate``, a local Ray) with a TP=1 and a TP=2 engine (vLLM's ``mp``
executor on CPU), side by side: rewards per step, and the engine/actor log-prob difference on the
sampled tokens (``rollout/logprob_abs_diff``: it stays small only if every sync reached every worker).

    python benchmarks/sync.py [--hidden 1024 --layers 8 --bucket-mb 64 --repeats 3 --tp 1 2]
    python benchmarks/sync.py --train
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # the scripted engine (tests/support)

from megatron_arpo.actor.worker import MegatronActorWorker  # noqa: E402
from support.scripted import ScriptedEngine  # noqa: E402


class BenchWorker(MegatronActorWorker):
    """The real actor worker plus the measurements the benchmark needs inside the rank."""

    def send_weights(self, *args, **kwargs) -> dict:
        """The real send; under ``--profile DIR`` also a cProfile of it, appended to DIR/rank<N>.txt."""
        directory = os.environ.get("SYNC_BENCH_PROFILE")
        if not directory:
            return super().send_weights(*args, **kwargs)
        import cProfile
        import io
        import pstats

        profile = cProfile.Profile()
        report = profile.runcall(super().send_weights, *args, **kwargs)
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
        with open(Path(directory) / f"rank{self.rank}.txt", "a") as fh:
            fh.write(text.getvalue())
        return report

    def rss_mark(self) -> int:
        """Reset the resident-set high-water mark; the resident set now (bytes)."""
        Path("/proc/self/clear_refs").write_text("5")
        return _status_kib("VmRSS") * 1024

    def rss_peak(self) -> int:
        return _status_kib("VmHWM") * 1024

    def copy_state_dict(self) -> dict:
        import torch

        start = time.perf_counter()
        copy = {k: v.clone() for k, v in self.model.state_dict().items() if isinstance(v, torch.Tensor)}
        seconds = time.perf_counter() - start
        nbytes = sum(t.numel() * t.element_size() for t in copy.values())
        return {"seconds": seconds, "bytes": nbytes}


class CountingEngine(ScriptedEngine):
    def __init__(self, index: int):
        super().__init__(lambda ctx, req: None, engine_index=index)

    async def held_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.weights.values())

    async def receive_buffers(self) -> dict:
        """The receiver's buffer pool: bytes kept between syncs and how buckets were handed out."""
        return {"bytes": self._receiver.buffers.nbytes, **self._receiver.buffers.stats}


def _status_kib(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {key}")


def _model_yaml(directory: Path, hidden: int, layers: int) -> str:
    path = directory / "bench-wide.yaml"
    path.write_text(f"""name: bench-wide
model_type: qwen3
hidden_size: {hidden}
num_hidden_layers: {layers}
num_attention_heads: {hidden // 64}
num_key_value_heads: {max(hidden // 256, 2)}
head_dim: 64
intermediate_size: {4 * hidden}
vocab_size: 32000
rms_norm_eps: 1.0e-6
rope_theta: 1000000.0
max_position_embeddings: 4096
tie_word_embeddings: false
attention_bias: false
qk_layernorm: true
hidden_act: silu
torch_dtype: float32
make_vocab_size_divisible_by: 128
defaults:
  actor_tensor_parallel: 1
  actor_pipeline_parallel: 1
  rollout_tensor_parallel: 1
""")
    return str(path)


def _config(model_yaml: str, tp: int, bucket_mb: int):
    from megatron_arpo.config import build_config

    return build_config({
        "model": {"config": model_yaml}, "tools": {"search": {"enabled": False}},
        "data": {"max_prompt_tokens": 64}, "rollout": {"response_length": 64, "sync_bucket_mb": bucket_mb},
        "launcher": {"gpus_per_node": 0}, "trainer": {"train_batch_size": 4},
        "actor": {"tensor_parallel": tp, "params_dtype": "fp32", "mini_batch_size": 4, "use_te": "false",
                  "use_distributed_optimizer": False},
    })


def bench_tp(model_yaml: str, tp: int, args) -> dict:
    import ray

    from megatron_arpo.actor.group import ActorGroup

    env = {"GLOO_SOCKET_IFNAME": "lo", **({"SYNC_BENCH_PROFILE": args.profile} if args.profile else {})}
    group = ActorGroup(_config(model_yaml, tp, args.bucket_mb), worker_cls=BenchWorker, num_cpus_per_rank=0.5,
                       env=env)
    engine = ray.remote(CountingEngine).options(num_cpus=0).remote(0)
    try:
        group.sync_weights([engine])  # warm-up: forms the transfer group
        rows = []
        for _ in range(args.repeats):
            before = group.workers.call_all("rss_mark")[0]
            report = group.sync_weights([engine])
            peak = group.workers.call_all("rss_peak")[0]
            copies = group.workers.call_all("copy_state_dict")
            rows.append({"sync_s": report["seconds"], "bytes": report["bytes"], "buckets": report["buckets"],
                         "max_bucket": report["max_bucket_bytes"], "driver_bytes": report["driver_bytes"],
                         "kept": report["send_buffer_bytes"], "fresh": report["send_buffers"]["fresh"]
                         + report["send_buffers"]["grown"],
                         "driver_weight_bytes": report["driver_weight_bytes"], "peak_extra": peak - before,
                         "copy_s": copies[0]["seconds"], "local_bytes": copies[0]["bytes"]})
        held = ray.get(engine.held_bytes.remote())
        receive = ray.get(engine.receive_buffers.remote())
    finally:
        ray.kill(engine)
        group.shutdown()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0]}
    sync_per_gb = med["sync_s"] / (med["bytes"] / 1e9)
    copy_per_gb = med["copy_s"] / (med["local_bytes"] / 1e9)
    return {"tp": tp, **med, "held": held, "receive": receive,
            # the peak over a sender that keeps no buffers between syncs (they are in the baseline otherwise)
            "peak_with_kept": max(r["peak_extra"] + r["kept"] for r in rows) / med["max_bucket"],
            "sync_s_per_gb": sync_per_gb, "copy_s_per_gb": copy_per_gb,
            "ratio": sync_per_gb / copy_per_gb, "peak_buckets": max(r["peak_extra"] for r in rows) / med["max_bucket"],
            "rows": rows}


def train_runs(engine_tps, root: Path) -> dict:
    """Two-step training runs, one per engine TP; their metrics rows."""
    import json
    import subprocess

    sys.path.insert(0, str(REPO / "tests" / "e2e"))
    from train_helpers import read_rows, train_command, train_env, write_task

    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    hf_dir = tiny_checkpoint("tiny-qwen3")
    data = write_task(root)
    out = {}
    for tp in engine_tps:
        run_dir = root / f"run-tp{tp}"
        cmd = train_command(str(hf_dir), data, run_dir, "trainer.placement=separate", "trainer.actor_devices=2",
                            f"trainer.rollout_devices={tp}", f"rollout.tensor_parallel={tp}", "trainer.val_every=0",
                            f"launcher.num_cpus={2 + tp}", "logging.wandb.mode=disabled")
        log = root / f"train-tp{tp}.log"
        start = time.perf_counter()
        with open(log, "w") as fh:
            proc = subprocess.run(cmd, cwd=REPO, env=train_env(data), stdout=fh, stderr=subprocess.STDOUT,
                                  timeout=1800)
        if proc.returncode != 0:
            raise RuntimeError(f"engine TP={tp}: train exited {proc.returncode}; see {log}:\n"
                               + log.read_text()[-3000:])
        out[tp] = {"rows": read_rows(run_dir), "wall_s": time.perf_counter() - start}
        print(f"engine TP={tp}: {json.dumps([{k: r.get(k) for k in TRAIN_KEYS} for r in out[tp]['rows']])}")
    return out


TRAIN_KEYS = ("step", "reward/mean", "rollout/logprob_abs_diff", "rollout/generated_tokens_per_s", "sync/seconds",
              "sync/verified", "sync/driver_weight_bytes")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--profile", metavar="DIR", help="cProfile every rank's send into DIR/rank<N>.txt")
    parser.add_argument("--train", action="store_true", help="the 2-step training runs with a TP=1 and a TP=2 engine")
    args = parser.parse_args(argv)
    if args.train:
        with tempfile.TemporaryDirectory() as tmp:
            runs = train_runs(args.tp, Path(tmp))
        print("\n| engine TP | step | reward/mean | rollout/logprob_abs_diff | sync s | verified | driver weight bytes |")
        print("|---|---|---|---|---|---|---|")
        for tp, run in runs.items():
            for r in run["rows"]:
                print(f"| {tp} | {r['step']} | {r['reward/mean']:.4f} | {r['rollout/logprob_abs_diff']:.2e} | "
                      f"{r['sync/seconds']:.3f} | {r['sync/verified']:.0f} | {r['sync/driver_weight_bytes']:.0f} |")
        return 0

    import ray

    with tempfile.TemporaryDirectory() as tmp:
        model_yaml = _model_yaml(Path(tmp), args.hidden, args.layers)
        ray.init(num_cpus=4, include_dashboard=False, object_store_memory=256 * 2**20,
                 runtime_env={"env_vars": {"PYTHONPATH": str(REPO)}})
        try:
            results = [bench_tp(model_yaml, tp, args) for tp in args.tp]
        finally:
            ray.shutdown()
    first = results[0]
    print(f"## Weight sync: hidden {args.hidden}, {args.layers} layers, vocab 32000, untied, fp32, "
          f"{first['bytes'] / 1e9:.2f} GB of HF tensors, {args.bucket_mb} MB buckets, one gloo engine; "
          f"median of {args.repeats}")
    print()
    print("| actor TP | buckets | largest bucket MB | driver bytes/sync (weights) | sender peak extra "
          "(largest buckets) | same + buffers kept between syncs | sync s/GB | state_dict clone s/GB | ratio |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in results:
        print(f"| {r['tp']} | {r['buckets']:.0f} | {r['max_bucket'] / 2**20:.0f} | {r['driver_bytes']:.0f} "
              f"({r['driver_weight_bytes']:.0f}) | {r['peak_buckets']:.2f} | {r['peak_with_kept']:.2f} | "
              f"{r['sync_s_per_gb']:.3f} | {r['copy_s_per_gb']:.3f} | {r['ratio']:.2f}x |")
        if r["held"] != r["bytes"]:
            print(f"  (!) the engine holds {r['held']} bytes, the sync sent {r['bytes']:.0f}")
    print()
    for r in results:
        print(f"TP={r['tp']} buffers kept between syncs: sender {r['kept'] / 2**20:.0f} MB (fresh or grown "
              f"hand-outs per timed sync: {r['fresh']:.0f}), engine {r['receive']['bytes'] / 2**20:.0f} MB "
              f"(hand-outs over all syncs: {r['receive']['reused']} reused, {r['receive']['grown']} grown, "
              f"{r['receive']['fresh']} fresh)")
    for r in results:
        print(f"TP={r['tp']} raw: " + "; ".join(
            f"sync {x['sync_s']:.3f} s, copy {x['copy_s']:.3f} s, peak extra {x['peak_extra'] / 2**20:.0f} MB"
            for x in r["rows"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
