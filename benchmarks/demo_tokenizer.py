"""Demo cost with the real Qwen tokenizer vs the small local one (issue 13: "the demo should run on the real
tokenizer if it still learns in the same time").

The demo's model (tiny-qwen3: 2 layers, hidden 256) is built twice from the same seed: with the local
1,000-token tokenizer (what `make demo` uses) and with the real Qwen3 tokenizer, whose release vocabulary
(151,936 LM-head rows) the model then needs. The two run the demo's own stages with the demo's own
settings (configs/demo.yaml), alternating, in one run:

- SFT: ``megatron-arpo sft`` on the first ``--sft-rows`` demo SFT conversations (global batch 16 as in the
  demo), seconds per optimizer step from the step log lines (the first step excluded: it warms up);
- RL: ``megatron-arpo train`` from that SFT export, ``--rl-steps`` ARPO steps of the demo's size (8 prompts x
  n = 8, response 160 tokens, python + BM25 search), ``time/step_s`` of every step after the first.

The projection multiplies by the demo's step counts (788 SFT steps, 20 RL steps); evaluation and start-up
are left out (they grow too, so the projection is a lower bound for the real tokenizer).

    python benchmarks/demo_tokenizer.py [--repeats 2] [--sft-rows 80] [--rl-steps 3] [--out runs/bench-demo-tokenizer]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

DEMO_SFT_STEPS, DEMO_RL_STEPS = 788, 20
STEP_LINE = re.compile(r"^(\S+ \S+) INFO megatron_arpo\.sft: sft step (\d+)/(\d+)", re.M)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    env.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", "RAY_AUTH_MODE": "disabled",
                "RAY_USAGE_STATS_ENABLED": "0", "WANDB_MODE": "disabled", "GLOO_SOCKET_IFNAME": "lo",
                "TOKENIZERS_PARALLELISM": "false"})
    return env


def _cli(args: list[str], log: Path) -> None:
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "megatron_arpo", *args], cwd=REPO, env=_env(), stdout=out,
                              stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        raise SystemExit(f"{args[0]} failed ({proc.returncode}); see {log}")


def _sets(items: dict[str, str]) -> list[str]:
    return [arg for key, value in items.items() for arg in ("--set", f"{key}={value}")]


def prepare(out: Path, sft_rows: int) -> dict[str, dict]:
    from megatron_arpo.data.demo_tasks import ensure_demo_tasks
    from megatron_arpo.model_config import load_model_config
    from megatron_arpo.tiny.checkpoint import build_tiny_checkpoint

    paths = ensure_demo_tasks(out / "data", 0)
    subset = out / "data" / "sft_subset.jsonl"
    subset.write_text("".join(paths["sft"].read_text().splitlines(keepends=True)[:sft_rows]))
    demo_model = load_model_config("tiny-qwen3")
    wide = out / "demo-qwen3-qwen-vocab.yaml"  # the demo's architecture at Qwen3's release vocabulary
    text = (REPO / "model_configs" / "tiny-qwen3.yaml").read_text()
    wide.write_text(text.replace("name: tiny-qwen3", "name: demo-qwen3-qwen-vocab")
                    .replace(f"vocab_size: {demo_model.vocab_size}", "vocab_size: 151936"))
    variants = {"local": {"config": "tiny-qwen3", "tokenizer": "local"},
                "qwen3": {"config": str(wide), "tokenizer": "qwen3"}}
    for name, v in variants.items():
        v["init"] = out / f"init-{name}"
        if not (v["init"] / "config.json").exists():
            build_tiny_checkpoint(v["config"], v["init"], seed=0, overwrite=True, tokenizer=v["tokenizer"])
    return {"paths": paths, "subset": subset, "variants": variants}


def sft_seconds_per_step(log: Path) -> list[float]:
    stamps = [datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f") for m in STEP_LINE.finditer(log.read_text())]
    return [(b - a).total_seconds() for a, b in zip(stamps, stamps[1:])]


def run_variant(out: Path, setup: dict, name: str, rep: int, rl_steps: int) -> dict:
    v = setup["variants"][name]
    paths = setup["paths"]
    base = {"model.config": v["config"], "tools.search.corpus": paths["corpus"],
            "tools.cache.path": out / f"cache-{name}-{rep}.sqlite", "logging.wandb.mode": "disabled"}
    sft_dir = out / f"sft-{name}-{rep}"
    sft_log = out / f"sft-{name}-{rep}.log"
    _cli(["sft", "--config", "configs/demo.yaml", *_sets({**base, "model.hf_checkpoint": v["init"],
                                                          "model.tokenizer": v["init"], "sft.epochs": 1,
                                                          "sft.train_files": f"[{setup['subset']}]",
                                                          "sft.output_dir": sft_dir, "sft.export_hf": "true",
                                                          "trainer.run_dir": out / f"sft-run-{name}-{rep}"})], sft_log)
    run_dir = out / f"run-{name}-{rep}"
    _cli(["train", "--config", "configs/demo.yaml", "--resume", "none",
          *_sets({**base, "model.hf_checkpoint": sft_dir / "hf", "data.train_files": f"[{paths['train']}]",
                  "data.val_files": "[]", "trainer.total_steps": rl_steps, "trainer.val_before_train": "false",
                  "trainer.save_every": 0, "trainer.export_hf_at_end": "false", "trainer.run_dir": run_dir})],
         out / f"train-{name}-{rep}.log")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return {"sft": sft_seconds_per_step(sft_log)[1:], "rl": [r["time/step_s"] for r in rows if r["step"] > 1]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", default=str(REPO / "runs" / "bench-demo-tokenizer"))
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sft-rows", type=int, default=80, help="SFT conversations (16 per step)")
    parser.add_argument("--rl-steps", type=int, default=3)
    args = parser.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    setup = prepare(out, args.sft_rows)
    samples: dict[str, dict[str, list[float]]] = {n: {"sft": [], "rl": []} for n in setup["variants"]}
    start = time.time()
    for rep in range(args.repeats):
        for name in setup["variants"]:
            got = run_variant(out, setup, name, rep, args.rl_steps)
            for key in ("sft", "rl"):
                samples[name][key] += got[key]
            print(f"repeat {rep} {name}: sft s/step {got['sft']}, rl s/step {got['rl']}", flush=True)
    med = {n: {k: statistics.median(v) for k, v in s.items()} for n, s in samples.items()}
    print(f"\n{args.repeats} repeats, {time.time() - start:.0f} s; medians:\n")
    print("| tokenizer | vocab (LM-head rows) | SFT s/step | RL s/step | projected demo SFT + RL |")
    print("|---|---|---|---|---|")
    for name, vocab in (("local", 1000), ("qwen3", 151936)):
        m = med[name]
        projected = (DEMO_SFT_STEPS * m["sft"] + DEMO_RL_STEPS * m["rl"]) / 60
        print(f"| {name} | {vocab} | {m['sft']:.2f} | {m['rl']:.1f} | {projected:.0f} min |")
    print(f"\nqwen3 / local: SFT {med['qwen3']['sft'] / med['local']['sft']:.1f}x, RL {med['qwen3']['rl'] / med['local']['rl']:.1f}x")


if __name__ == "__main__":
    main()
