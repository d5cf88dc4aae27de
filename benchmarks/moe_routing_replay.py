"""Routing replay (R3) on the tiny MoE: the train/inference log-prob mismatch with and without replay (issue 27).

The rollout side stands in for the inference engine: the actor's own forward at the initial weights, in
bf16 by default (as engines serve), gives each token's log-prob and its routing
(``compute_log_probs(record_routing=True)``). This isolates the actor: both sides see the same batch and the
same weights at every step, and a token's routing flip is visible. The RL loop with the engine's own routing
is benchmarks/moe_replay_rl.py. The training side is the fp32 actor (tiny-qwen3-moe at TP1 x DP2 x EP2
on gloo: the experts split over two ranks): on the same weights first (step 0: the precision mismatch
alone), then after each real PPO update on the batch (``MegatronActorWorker.update``), as the optimizer
steps of one RL step move it away from the rollout weights. Each time the actor's log-probs of the same
tokens are computed twice on the same weights: with its own routing and with the rollout's replayed. Per token (every predicted
token), against the rollout's log-probs: mean absolute difference, and the share of tokens whose
importance ratio ``exp(train - rollout)`` lies outside [0.8, 1.25]; also the share of tokens whose
own routing differs from the rollout's in some layer.

    python benchmarks/moe_routing_replay.py [--steps 4 --sequences 16 --lr 1e-5 --rollout-dtype bf16 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from megatron_arpo.device.local_ranks import run_distributed  # noqa: E402
from megatron_arpo.tiny.checkpoint import tiny_checkpoint  # noqa: E402

NAME = "tiny-qwen3-moe"
RATIO_BAND = (0.8, 1.25)
EP = 2


def mismatch(train: Sequence[torch.Tensor], rollout: Sequence[torch.Tensor],
             flipped: Sequence[torch.Tensor] | None = None) -> dict[str, float]:
    """Mean |train - rollout| and the share of ratios outside ``RATIO_BAND`` over tokens 1.. of each sequence.

    ``flipped`` (per sequence, per token: routed elsewhere than recorded) adds ``mean_abs_flipped``, the mean
    over the tokens predicted at a flipped position (token ``t + 1`` for a flip at ``t``).
    """
    diff = torch.cat([(t.double() - r.double())[1:] for t, r in zip(train, rollout)])
    ratio = diff.exp()
    outside = (ratio < RATIO_BAND[0]) | (ratio > RATIO_BAND[1])
    out = {"mean_abs": float(diff.abs().mean()), "outside": float(outside.double().mean()),
           "tokens": int(diff.numel())}
    if flipped is not None:
        at = torch.cat([f[:-1] for f in flipped])
        out["flipped_tokens"] = int(at.sum())
        out["mean_abs_flipped"] = float(diff[at].abs().mean()) if bool(at.any()) else 0.0
    return out


def flipped_tokens(own: Sequence[torch.Tensor], recorded: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Per sequence, per token: routed to another expert set than recorded in some layer (order ignored)."""
    return [(a.long().sort(dim=-1).values != b.long().sort(dim=-1).values).any(dim=-1).any(dim=-1)
            for a, b in zip(own, recorded)]


def changed_routing(own: Sequence[torch.Tensor], recorded: Sequence[torch.Tensor]) -> float:
    """Share of tokens routed to another expert set than recorded in at least one layer."""
    flips = flipped_tokens(own, recorded)
    return sum(int(f.sum()) for f in flips) / max(sum(f.numel() for f in flips), 1)


def _config(lr: float, replay: bool, dtype: str = "fp32"):
    from megatron_arpo.config import build_config

    return build_config({
        "model": {"config": NAME}, "tools": {"search": {"enabled": False}},
        "data": {"max_prompt_tokens": 32}, "rollout": {"response_length": 96, "n": 2, "initial_rollouts": 2},
        "trainer": {"train_batch_size": 4, "keep_last": 2},
        "algorithm": {"use_reference": False, "kl": {"coef": 0.0}},
        "actor": {"tensor_parallel": 1, "expert_parallel": EP, "params_dtype": dtype, "mini_batch_size": 4,
                  "micro_batch_tokens": 1024, "optimizer": {"lr": lr}, "moe_routing_replay": replay},
    })


def _batch(dp_rank: int, sequences: int, seed: int) -> tuple[list[list[int]], list[float]]:
    gen = torch.Generator().manual_seed(seed + dp_rank)
    seqs = [torch.randint(0, 1000, (int(n),), generator=gen).tolist()
            for n in torch.randint(48, 128, (sequences,), generator=gen)]
    return seqs, torch.randn(sequences, generator=gen).tolist()


def _rollout_worker(rank, world_size, hf_dir, sequences, seed, dtype) -> dict:
    """The rollout side: log-probs and routing of the batch at the initial weights, in ``dtype``."""
    from megatron_arpo.actor.worker import MegatronActorWorker

    worker = MegatronActorWorker(_config(1e-5, False, dtype), rank, world_size)  # no update on this side
    worker.init_model(hf_dir=hf_dir)
    seqs, _ = _batch(worker.dp_rank, sequences, seed)
    out = worker.compute_log_probs({"input_ids": seqs}, record_routing=True)
    return {"dp_rank": worker.dp_rank, "logprobs": out["logprobs"], "routed_experts": out["routed_experts"]}


def _train_worker(rank, world_size, hf_dir, rollouts, steps, sequences, lr, seed) -> dict:
    """The training side (fp32): the mismatch on the rollout weights, then after each PPO update."""
    import dataclasses

    from megatron_arpo.actor.worker import MegatronActorWorker

    worker = MegatronActorWorker(_config(lr, True), rank, world_size)
    worker.init_model(hf_dir=hf_dir)
    replay, plain = worker.actor, dataclasses.replace(worker.actor, moe_routing_replay=False)
    seqs, advantages = _batch(worker.dp_rank, sequences, seed)
    rollout = next(r for r in rollouts if r["dp_rank"] == worker.dp_rank)
    rows = []
    for step in range(steps + 1):
        worker.actor = plain  # the updates themselves run without replay: both measurements see the same weights
        if step:
            current = worker.compute_log_probs({"input_ids": seqs})
            worker.update({"input_ids": seqs, "loss_mask": [[1] * len(s) for s in seqs], "advantages": advantages,
                           "old_logprobs": current["logprobs"], "mini_batch": [0] * len(seqs),
                           "num_mini_batches": 1})
        own = worker.compute_log_probs({"input_ids": seqs}, record_routing=True)
        worker.actor = replay
        replayed = worker.compute_log_probs({"input_ids": seqs, "routed_experts": rollout["routed_experts"]})
        flips = flipped_tokens(own["routed_experts"], rollout["routed_experts"])
        rows.append({"step": step, "changed_routing": changed_routing(own["routed_experts"], rollout["routed_experts"]),
                     "without": mismatch(own["logprobs"], rollout["logprobs"], flips),
                     "with": mismatch(replayed["logprobs"], rollout["logprobs"], flips)})
    return {"dp_rank": worker.dp_rank, "rows": rows}


def _merge(results: list[dict]) -> list[dict]:
    """Token-weighted means over the DP ranks' shards."""
    merged = []
    for per_rank in zip(*(r["rows"] for r in results)):
        tokens = sum(r["without"]["tokens"] for r in per_rank)
        row = {"step": per_rank[0]["step"], "tokens": tokens}
        row["changed_routing"] = sum(r["changed_routing"] * r["without"]["tokens"] for r in per_rank) / tokens
        flipped = sum(r["without"]["flipped_tokens"] for r in per_rank)
        row["flipped_tokens"] = flipped
        for side in ("without", "with"):
            for key in ("mean_abs", "outside"):
                row[f"{side}_{key}"] = sum(r[side][key] * r[side]["tokens"] for r in per_rank) / tokens
            row[f"{side}_mean_abs_flipped"] = (sum(r[side]["mean_abs_flipped"] * r[side]["flipped_tokens"]
                                                   for r in per_rank) / max(flipped, 1))
        merged.append(row)
    return merged


def table(rows: list[dict]) -> str:
    lines = ["| optimizer steps after the rollout | tokens | routing changed (own vs rollout) | mean abs diff, without "
             "| mean abs diff, with replay | ... on tokens after a flip, without | ... with replay "
             "| ratio outside [0.8, 1.25], without | ratio outside, with replay |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['step']} | {r['tokens']} | {r['changed_routing']:.1%} | {r['without_mean_abs']:.4f} | "
                     f"{r['with_mean_abs']:.4f} | {r['without_mean_abs_flipped']:.4f} | "
                     f"{r['with_mean_abs_flipped']:.4f} | {r['without_outside']:.2%} | {r['with_outside']:.2%} |")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--sequences", type=int, default=16, help="sequences per DP rank")
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--rollout-dtype", choices=("bf16", "fp32"), default="bf16",
                        help="precision of the rollout side (the training side is fp32)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    hf_dir = str(tiny_checkpoint(NAME))
    rollouts = run_distributed(_rollout_worker, EP, hf_dir, args.sequences, args.seed, args.rollout_dtype,
                               timeout=600)
    results = run_distributed(_train_worker, EP, hf_dir, rollouts, args.steps, args.sequences, args.lr, args.seed,
                              timeout=1200)
    rows = _merge(results)
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
