"""``megatron-arpo sft --config X``: cold-start SFT of the actor on tool-integrated ShareGPT conversations.

The same Megatron actor as RL (``MegatronActorWorker``) trains token-mean NLL on assistant tokens only
(tool results masked as in RL, see ``megatron_arpo.data.sft``), from ``model.hf_checkpoint``, with
``sft.lr`` / ``sft.min_lr`` / ``sft.lr_schedule`` / ``sft.warmup_fraction`` and Adam / clipping / weight
decay from ``actor.optimizer``. One optimizer step sees ``sft.global_batch_size`` conversations drawn by
the checkpointable ``EpochSampler`` (seed ``data.seed``, shuffle ``data.shuffle``), split over the DP
ranks by tokens; ``ceil(sft.epochs x conversations / global_batch_size)`` steps in all.

Outputs in ``sft.output_dir`` (default ``<run_dir>/sft``): ``metrics.jsonl`` (one line per step),
``checkpoints/step-N`` (actor checkpoint at the end, with the sampler state) and, with ``sft.export_hf``,
``hf/`` — an HF checkpoint (weights, config, tokenizer) that ``model.hf_checkpoint`` of the RL stage can
point at.

Local runs: the world is ``actor.tensor_parallel x pipeline_parallel x data_parallel`` (DP defaults to 1
on CPU). World 1 runs in this process; larger worlds spawn local gloo/NCCL processes. :func:`sft_rank` is
the per-rank body, usable by a Ray worker group as well.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import time
from pathlib import Path
from typing import Any, Sequence

from megatron_arpo.redaction import install_log_redaction

logger = logging.getLogger(__name__)


def sft_output_dir(cfg) -> Path:
    return Path(cfg.sft.output_dir) if cfg.sft.output_dir else cfg.run_dir / "sft"


def sft_rank(rank: int, world_size: int, cfg_dict: dict, master_addr: str = "127.0.0.1",
             master_port: int = 29500) -> dict[str, Any]:
    """The SFT loop on one rank; returns the per-step losses and the output paths (same on every rank)."""
    from transformers import AutoTokenizer

    from megatron_arpo.actor.optimizer import settings_for_sft
    from megatron_arpo.actor.packing import split_for_data_parallel
    from megatron_arpo.actor.worker import MegatronActorWorker
    from megatron_arpo.config import build_config
    from megatron_arpo.data.sampler import EpochSampler
    from megatron_arpo.data.sft import load_sft_examples

    cfg = build_config(cfg_dict)
    if not cfg.model.hf_checkpoint:
        raise ValueError("model.hf_checkpoint: required for SFT (the model to fine-tune)")
    tokenizer = AutoTokenizer.from_pretrained(cfg.model.tokenizer or cfg.model.hf_checkpoint)
    examples, stats = load_sft_examples(cfg.sft.train_files, tokenizer, cfg.sft.max_seq_tokens)
    batch_size = cfg.sft.global_batch_size
    total_steps = math.ceil(cfg.sft.epochs * len(examples) / batch_size)
    worker = MegatronActorWorker(cfg, rank, world_size, master_addr, master_port)
    out_dir = sft_output_dir(cfg)
    try:
        worker.init_model(hf_dir=cfg.model.hf_checkpoint,
                          optim_settings=settings_for_sft(cfg.actor, cfg.sft, total_steps))
        if batch_size < worker.dp:
            raise ValueError(f"sft.global_batch_size {batch_size} is below the {worker.dp} data-parallel ranks")
        sampler = EpochSampler(len(examples), batch_size, seed=cfg.data.seed, shuffle=cfg.data.shuffle)
        writer = rank == 0
        if writer:
            out_dir.mkdir(parents=True, exist_ok=True)
            logger.info("SFT: %d conversations (%d truncated, %d dropped, %d tool results masked), %d steps",
                        stats.kept, stats.truncated, stats.dropped_no_target, stats.result_spans, total_steps)
        losses = []
        metrics_path = out_dir / "metrics.jsonl"
        with open(metrics_path, "w") if writer else open(os.devnull, "w") as log:
            for step in range(1, total_steps + 1):
                indices = sampler.next_batch()
                batch = {"input_ids": [examples[i].input_ids for i in indices],
                         "loss_mask": [examples[i].loss_mask for i in indices]}
                shard = split_for_data_parallel(batch, worker.dp)[worker.dp_rank]
                metrics = worker.sft_step(shard)
                losses.append(metrics["loss"])
                log.write(json.dumps({"step": step, "epoch": sampler.epoch, **metrics}) + "\n")
                log.flush()
                if writer:
                    logger.info("sft step %d/%d loss %.4f grad_norm %.3f lr %.3g", step, total_steps,
                                metrics["loss"], metrics["grad_norm"], metrics["lr"])
        ckpt = worker.save(str(out_dir / "checkpoints"), {"sampler": sampler.state_dict(), "stage": "sft"},
                           step=total_steps, export_hf=False)
        hf_dir = None
        if cfg.sft.export_hf:
            worker.write_hf_checkpoint(out_dir / "hf")
            hf_dir = str(out_dir / "hf")
        return {"losses": losses, "checkpoint": ckpt, "hf_dir": hf_dir, "num_examples": stats.kept,
                "steps": total_steps}
    finally:
        worker.shutdown()


def run_sft(cfg, world_size: int | None = None, timeout: float = 7 * 24 * 3600.0) -> dict[str, Any]:
    """Run SFT on a local world (this process when it is 1, spawned processes otherwise)."""
    from megatron_arpo.config import actor_world_size
    from megatron_arpo.testing.dist import find_free_port, run_distributed

    world = world_size or actor_world_size(cfg) or 1
    cfg_dict = getattr(cfg, "_raw", None) or cfg.to_dict()
    if world == 1:
        return sft_rank(0, 1, cfg_dict, "127.0.0.1", find_free_port())
    return run_distributed(sft_rank, world, cfg_dict, timeout=timeout)[0]


def sft_main(argv: Sequence[str]) -> int:
    from megatron_arpo.cli import PROG, add_config_arguments, config_from_args
    from megatron_arpo.config import validate_paths

    parser = argparse.ArgumentParser(prog=f"{PROG} sft", description=__doc__.split("\n\n")[0])
    add_config_arguments(parser)
    parser.add_argument("--world-size", type=int, default=None,
                        help="local ranks to spawn (default: actor tp x pp x dp from the config)")
    args = parser.parse_args(list(argv))
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    install_log_redaction()
    cfg = config_from_args(args)
    validate_paths(cfg, for_command="sft")
    start = time.time()
    result = run_sft(cfg, args.world_size)
    losses = result["losses"]
    print(f"SFT done in {time.time() - start:.1f}s: {result['steps']} steps on {result['num_examples']} "
          f"conversations, loss {losses[0]:.4f} -> {losses[-1]:.4f}")
    print(f"checkpoint: {result['checkpoint']}")
    if result["hf_dir"]:
        print(f"HF checkpoint: {result['hf_dir']}  (set model.hf_checkpoint to it for RL)")
    return 0
