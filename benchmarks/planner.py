"""Planner formula vs `megatron-arpo plan --measure`: per-rank actor memory, stage by stage (issue 11).

Rows: the two shipped 32B recipes and two other layouts (an 8B model with TP=2 and no recompute on the
TE spec; a 14B model on the local spec with selective recompute and sequence parallelism). For every
pipeline stage of each, the formula's per-rank peak is compared with the peak measured on fake CUDA at
real shapes (``launchers.measure``); target: within 15% on every row. Then a QwQ-32B
``megatron-arpo plan --measure`` is timed end to end under ``/usr/bin/time -v`` (target: under 5 minutes,
peak RSS under 4 GB).

Run: ``.venv/bin/python benchmarks/planner.py`` (prints the markdown for benchmarks/RESULTS.md).
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from launchers.measure import measure  # noqa: E402
from launchers.planner import GiB, make_plan, plan_input_from_config  # noqa: E402

RECIPES = ["configs/qwq-32b-arpo-deepsearch.yaml", "configs/qwen3-32b-arpo-reasoning.yaml"]
OTHER = {
    "qwen3-8b TP2 PP1, no recompute, TE spec": {
        "model": {"config": "qwen3-8b"}, "tools": {"search": {"enabled": False}},
        "data": {"max_prompt_tokens": 1024}, "rollout": {"response_length": 3072, "tensor_parallel": 1},
        "trainer": {"train_batch_size": 64},
        "actor": {"tensor_parallel": 2, "pipeline_parallel": 1, "recompute": "none", "micro_batch_tokens": 8192,
                  "mini_batch_size": 16, "params_dtype": "bf16", "use_te": "auto"},
        "launcher": {"nodes": 1, "gpus_per_node": 8}},
    "qwen3-14b TP4 PP2 SP, selective, local spec": {
        "model": {"config": "qwen3-14b"}, "tools": {"search": {"enabled": False}},
        "data": {"max_prompt_tokens": 1024}, "rollout": {"response_length": 3072, "tensor_parallel": 2},
        "trainer": {"train_batch_size": 64},
        "actor": {"tensor_parallel": 4, "pipeline_parallel": 2, "sequence_parallel": True, "recompute": "selective",
                  "micro_batch_tokens": 4096, "mini_batch_size": 16, "params_dtype": "bf16", "use_te": "false"},
        "launcher": {"nodes": 2, "gpus_per_node": 8}},
}
TARGET = 0.15


def compare(name: str, raw: dict) -> list[str]:
    inputs = plan_input_from_config(raw)
    plan = make_plan(inputs, suggest=False)
    measured = measure(raw, inputs, plan, stages="all")
    rows = []
    for r in measured["stages"]:
        formula, got = r["formula_gib"], r["breakdown_bytes"]
        total = r["peak_bytes"] / GiB
        ratio = formula["total"] / total
        acts = (got["activations"] + got["temporaries"]) / GiB
        f_acts = formula["activations"] + formula["temporaries"]
        rows.append(f"| {name} | pp{r['stage']} | {formula['total']:.2f} | {total:.2f} | {ratio:.3f} | "
                    f"{f_acts:.2f} / {acts:.2f} | {r['build_s'] + r['run_s']:.0f} | "
                    f"{'yes' if abs(ratio - 1) <= TARGET else 'NO'} |")
    return rows


def timed_qwq_measure() -> str:
    time_bin = shutil.which("time") or "/usr/bin/time"
    cli = [sys.executable, "-m", "megatron_arpo.cli", "plan", "--config", RECIPES[0], "--measure"]
    start = time.perf_counter()
    proc = subprocess.run([time_bin, "-v", *cli], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    wall = time.perf_counter() - start
    rss_kb = int(re.search(r"Maximum resident set size \(kbytes\): (\d+)", proc.stderr).group(1))
    elapsed = re.search(r"Elapsed \(wall clock\) time.*: (\S+)", proc.stderr).group(1)
    verdict = "met" if wall < 300 and rss_kb < 4 * 10**6 else "NOT met"
    return (f"- `/usr/bin/time -v python -m megatron_arpo.cli plan --config {RECIPES[0]} --measure` (worst stage "
            f"only, exit {proc.returncode}): wall {elapsed} ({wall:.0f} s), peak RSS {rss_kb / 10**6:.2f} GB "
            f"(targets < 5 min and < 4 GB: {verdict})")


def main() -> int:
    lines = ["| layout | stage | formula GiB | measured GiB | formula / measured | activations + temporaries "
             "formula / measured GiB | measure s | within 15% |", "|---|---|---|---|---|---|---|---|"]
    for recipe in RECIPES:
        lines += compare(f"`{recipe}`", yaml.safe_load((ROOT / recipe).read_text()))
    for name, raw in OTHER.items():
        lines += compare(name, raw)
    print("\n".join(lines))
    print(timed_qwq_measure())
    return 0


if __name__ == "__main__":
    sys.exit(main())
