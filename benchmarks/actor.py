"""Actor benchmark: packed vs padded micro-batches, and weight export against a plain state_dict copy.

Part 1 (update throughput): tiny-qwen3 (fp32, local spec, gloo), one PPO update per repeat on a batch of
sequences with a skewed (log-normal, capped) length distribution. The same worker runs it with
``packing_mode="packed"`` (first-fit-decreasing rows, block-diagonal masks) and ``"padded"`` (one sequence
per row, micro-batches padded to their longest sequence), alternating, same token budget. Reported:
update tokens/s (real tokens; median over repeats after one warm-up each), the padding fraction, and the
number of micro-batches. Packed rows are as wide as the longest sequence by default (``--row-tokens`` widens
them, up to one row per micro-batch), which bounds the s^2 cost of the dense masked attention of the local
spec.

Part 2 (export): a wider random model (``--export-hidden``, ``--export-layers``), the HF export path
``iter_weight_buckets`` with 512 MB buckets (HF names, TP gather, PP walk through the conversion tables;
the weight sync to the engines is measured by benchmarks/sync.py) against
``{k: v.clone() for k, v in model.state_dict().items()}`` in the same process, as seconds per GB.

    python benchmarks/actor.py [--world 1 --tp 1] [--num-seqs 64 --budget 2048 --repeats 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def _config(tp: int, budget: int):
    from megatron_arpo.config import build_config

    return build_config({
        "model": {"config": "tiny-qwen3"}, "tools": {"search": {"enabled": False}},
        "data": {"max_prompt_tokens": 512}, "rollout": {"response_length": 512, "n": 2, "initial_rollouts": 2},
        "trainer": {"train_batch_size": 4},
        "actor": {"tensor_parallel": tp, "params_dtype": "fp32", "micro_batch_tokens": budget,
                  "mini_batch_size": 4, "optimizer": {"lr": 1e-5}},
    })


def skewed_lengths(num: int, seed: int, cap: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [max(8, min(cap, int(rng.lognormvariate(4.3, 0.9)))) for _ in range(num)]


def _bench_rank(rank, world_size, args):
    import torch

    from megatron_arpo.actor.packing import split_for_data_parallel
    from megatron_arpo.actor.worker import MegatronActorWorker

    worker = MegatronActorWorker(_config(args.tp, args.budget), rank, world_size, row_tokens=args.row_tokens)
    hf_dir = None
    if args.init_hf:
        from megatron_arpo.tiny.checkpoint import tiny_checkpoint

        hf_dir = str(tiny_checkpoint("tiny-qwen3"))
    worker.init_model(hf_dir=hf_dir)
    gen = torch.Generator().manual_seed(0)
    lengths = skewed_lengths(args.num_seqs, 0, args.max_len)
    seqs = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in lengths]
    batch = {"input_ids": seqs, "loss_mask": [[0] * (n // 3) + [1] * (n - n // 3) for n in lengths],
             "advantages": torch.randn(len(seqs), generator=gen).tolist(),
             "old_logprobs": [torch.full((n,), -7.0) for n in lengths]}
    shard = split_for_data_parallel(batch, worker.dp)[worker.dp_rank]
    rows = {mode: {"tps": [], "padding": None, "micro_batches": None} for mode in ("packed", "padded")}
    for rep in range(args.repeats + 1):
        for mode in ("packed", "padded"):
            worker.packing_mode = mode
            plans = worker._plan([len(s) for s in shard["input_ids"]], args.budget)
            metrics = worker.update(shard)
            if rep > 0:
                rows[mode]["tps"].append(metrics["tokens_per_s"])
            rows[mode]["padding"] = metrics["padding_fraction"]
            rows[mode]["micro_batches"] = len(plans)
    worker.shutdown()
    return {"rows": rows, "lengths": lengths}


def _export_rank(rank, world_size, args):
    import dataclasses

    import torch

    from megatron_arpo.actor.worker import MegatronActorWorker
    from megatron_arpo.model_config import load_model_config

    base = load_model_config("tiny-qwen3")
    model_cfg = dataclasses.replace(base, name="bench-wide", hidden_size=args.export_hidden,
                                    intermediate_size=4 * args.export_hidden, num_hidden_layers=args.export_layers,
                                    num_attention_heads=args.export_hidden // 64,
                                    num_key_value_heads=max(args.export_hidden // 256, args.tp), vocab_size=32000)
    worker = MegatronActorWorker(_config(args.tp, args.budget), rank, world_size, model_cfg=model_cfg)
    worker.init_model()
    nbytes = sum(p.numel() * p.element_size() for p in worker.model.parameters())
    export_s, copy_s = [], []
    for _ in range(args.repeats):
        torch.distributed.barrier()
        start = time.perf_counter()
        exported = sum(t.numel() * t.element_size() for b in worker.iter_weight_buckets(512 * 2**20) for _, t in b)
        torch.distributed.barrier()
        export_s.append(time.perf_counter() - start)
        start = time.perf_counter()
        copy = {k: v.clone() for k, v in worker.model.state_dict().items() if isinstance(v, torch.Tensor)}
        copy_s.append(time.perf_counter() - start)
        del copy
    worker.shutdown()
    return {"local_bytes": nbytes, "exported_bytes": exported if rank == 0 else 0,
            "export_s": statistics.median(export_s), "copy_s": statistics.median(copy_s)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=1)
    parser.add_argument("--tp", type=int, default=1)
    parser.add_argument("--num-seqs", type=int, default=64)
    parser.add_argument("--max-len", type=int, default=1024)
    parser.add_argument("--budget", type=int, default=2048, help="micro-batch token budget")
    parser.add_argument("--row-tokens", type=int, default=None,
                        help="width of a packed row (default: the longest sequence)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--export-hidden", type=int, default=1024)
    parser.add_argument("--export-layers", type=int, default=8)
    parser.add_argument("--init-hf", action="store_true", help="load the tiny HF checkpoint (default: random init)")
    args = parser.parse_args(argv)

    from megatron_arpo.device.local_ranks import run_distributed

    bench = run_distributed(_bench_rank, args.world, args, timeout=3600)[0]
    lengths = bench["lengths"]
    print(f"## Actor update: tiny-qwen3 fp32, world {args.world} (tp {args.tp}), {len(lengths)} sequences, "
          f"{sum(lengths)} tokens, lengths min/median/max {min(lengths)}/{int(statistics.median(lengths))}/"
          f"{max(lengths)}, budget {args.budget} tokens/micro-batch"
          + (f", packed rows of {args.row_tokens} tokens" if args.row_tokens else ""))
    print()
    print("| micro-batches | count | padding fraction | update tokens/s (median) |")
    print("|---|---|---|---|")
    for mode, row in bench["rows"].items():
        print(f"| {mode} | {row['micro_batches']} | {row['padding']:.3f} | {statistics.median(row['tps']):.0f} |")
    packed, padded = (statistics.median(bench["rows"][m]["tps"]) for m in ("packed", "padded"))
    print(f"\npacked / padded throughput: {packed / padded:.2f}x\n")

    export = run_distributed(_export_rank, args.world, args, timeout=3600)
    gb = export[0]["exported_bytes"] / 1e9
    local_gb = export[0]["local_bytes"] / 1e9
    print(f"## Weight export: hidden {args.export_hidden}, {args.export_layers} layers, vocab 32000, fp32, "
          f"{gb:.2f} GB of HF tensors, world {args.world} (tp {args.tp})")
    print()
    print("| path | seconds | s/GB |")
    print("|---|---|---|")
    print(f"| iter_weight_buckets (512 MB buckets, HF names) | {export[0]['export_s']:.3f} | {export[0]['export_s'] / gb:.3f} |")
    print(f"| state_dict clone (rank 0, {local_gb:.2f} GB local) | {export[0]['copy_s']:.3f} | "
          f"{export[0]['copy_s'] / local_gb:.3f} |")
    print(f"\nexport / copy time per GB: {(export[0]['export_s'] / gb) / (export[0]['copy_s'] / local_gb):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
