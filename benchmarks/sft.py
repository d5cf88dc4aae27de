"""SFT benchmark: the Ray actor group (what `megatron-arpo sft` runs since issue 16) against the same
Megatron worker driven in this process (what it ran before, for one rank).

Same tiny-qwen3 checkpoint, same demo SFT conversations (``megatron_arpo.data.demo_tasks``), same batches
(the checkpointable sampler, seed 0), ``--steps`` optimizer steps each, world size 1 with the machine's
CPUs as intra-op threads in both (the actor group gives its one rank every CPU of the local Ray cluster).
The two run alternately, ``--repeats`` times each; reported: seconds per step (median after the first
step, which includes warm-up), start-up seconds (in-process: model build; Ray: Ray start, actor, model
build), the ratio Ray / in-process, and the final losses (equal batches and math: they must agree).

    python benchmarks/sft.py [--steps 60 --repeats 2]
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


def _config(tmp: Path, hf_dir: Path, sft_file: Path):
    from megatron_arpo.config import build_config

    return build_config({
        "name": "bench-sft", "model": {"config": "tiny-qwen3", "hf_checkpoint": str(hf_dir)},
        "tools": {"search": {"enabled": False}}, "data": {"max_prompt_tokens": 512, "seed": 0},
        "rollout": {"response_length": 512, "n": 2, "initial_rollouts": 2},
        "trainer": {"run_dir": str(tmp / "run"), "train_batch_size": 16},
        "launcher": {"gpus_per_node": 0},
        "actor": {"params_dtype": "fp32", "micro_batch_tokens": 2048, "mini_batch_size": 16, "data_parallel": 1},
        "sft": {"train_files": [str(sft_file)], "max_seq_tokens": 1024, "global_batch_size": 16, "epochs": 1,
                "lr": 1e-4, "lr_schedule": "constant", "warmup_fraction": 0.0},
    })


def _batches(cfg, steps: int):
    from transformers import AutoTokenizer

    from megatron_arpo.data.chat import load_chat_format
    from megatron_arpo.data.sampler import EpochSampler
    from megatron_arpo.data.sft import load_sft_examples

    chat = load_chat_format(AutoTokenizer.from_pretrained(cfg.model.hf_checkpoint), cfg.model.hf_checkpoint)
    examples, _ = load_sft_examples(cfg.sft.train_files, chat, cfg.sft.max_seq_tokens)
    sampler = EpochSampler(len(examples), cfg.sft.global_batch_size, seed=0, shuffle=True)
    out = []
    for _ in range(steps):
        idx = sampler.next_batch()
        out.append({"input_ids": [examples[i].input_ids for i in idx], "loss_mask": [examples[i].loss_mask for i in idx]})
    return out


def run_in_process(cfg, batches) -> dict:
    import torch

    from megatron_arpo.actor.optimizer import settings_for_sft
    from megatron_arpo.actor.worker import MegatronActorWorker
    from megatron_arpo.device.local_ranks import find_free_port

    torch.set_num_threads(os.cpu_count() or 1)
    start = time.perf_counter()
    worker = MegatronActorWorker(cfg, 0, 1, "127.0.0.1", find_free_port())
    worker.init_model(hf_dir=cfg.model.hf_checkpoint, optim_settings=settings_for_sft(cfg.actor, cfg.sft, len(batches)))
    startup = time.perf_counter() - start
    times, losses = [], []
    try:
        for batch in batches:
            t = time.perf_counter()
            losses.append(worker.sft_step(batch)["loss"])
            times.append(time.perf_counter() - t)
    finally:
        worker.shutdown()
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    return {"startup_s": startup, "step_s": statistics.median(times[1:]), "losses": losses}


def run_on_ray(cfg, batches) -> dict:
    import ray

    from megatron_arpo.actor.group import ActorGroup
    from megatron_arpo.actor.optimizer import settings_for_sft
    from megatron_arpo.cluster.runtime import connect_ray

    start = time.perf_counter()
    with connect_ray(cfg):
        cpus = float(max(1, int(ray.cluster_resources().get("CPU", 1))))
        with ActorGroup(cfg, hf_dir=cfg.model.hf_checkpoint, name="bench-sft", num_cpus_per_rank=cpus,
                        optim_settings=settings_for_sft(cfg.actor, cfg.sft, len(batches))) as group:
            startup = time.perf_counter() - start
            times, losses = [], []
            for batch in batches:
                t = time.perf_counter()
                losses.append(group.sft_step(batch)["loss"])
                times.append(time.perf_counter() - t)
    return {"startup_s": startup, "step_s": statistics.median(times[1:]), "losses": losses}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")
    from megatron_arpo.data.demo_tasks import ensure_demo_tasks
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="bench-sft-") as tmp:
        tmp = Path(tmp)
        ensure_demo_tasks(tmp / "data", 0)
        cfg = _config(tmp, tiny_checkpoint("tiny-qwen3"), tmp / "data" / "demo_sft.jsonl")
        batches = _batches(cfg, args.steps)
        tokens = sum(len(x) for b in batches for x in b["input_ids"]) / len(batches)
        results = {"in-process": [], "ray": []}
        for _ in range(args.repeats):
            results["in-process"].append(run_in_process(cfg, batches))
            results["ray"].append(run_on_ray(cfg, batches))
    print(f"{args.steps} SFT steps of 16 conversations ({tokens:.0f} tokens/step), tiny-qwen3 fp32, 1 rank, "
          f"{os.cpu_count()} CPUs; {args.repeats} alternating repeats")
    print("| path | step s (median per repeat) | start-up s | final loss |")
    print("|---|---|---|---|")
    for name, runs in results.items():
        steps = " / ".join(f"{r['step_s']:.3f}" for r in runs)
        startups = " / ".join(f"{r['startup_s']:.1f}" for r in runs)
        print(f"| {name} | {steps} | {startups} | {runs[0]['losses'][-1]:.4f} |")
    ratio = statistics.median(r["step_s"] for r in results["ray"]) / statistics.median(
        r["step_s"] for r in results["in-process"])
    diff = max(abs(a - b) for a, b in zip(results["ray"][0]["losses"], results["in-process"][0]["losses"]))
    print(f"- Ray actor group / in-process seconds per step: {ratio:.2f}")
    print(f"- largest loss difference over the {args.steps} steps: {diff:.2e}")


if __name__ == "__main__":
    main()
