"""Aggregation of per-sample evaluation records into results.json and a markdown table.

Per dataset, from the records of k runs (run r = the r-th sample drawn for every question):
  - per-run means of every per-sample metric (em, f1, acc, math_equal, reward, and llm_equal when the
    judge ran), and pass@1 = mean ± std of those per-run means over the runs (population std; 0 for
    one run);
  - unbiased pass@k (`evaluation.metrics.pass_at_k`, 1 - C(n-c,k)/C(n,k)) averaged over questions, for
    k in 1, 2, 4, ... up to the number of runs and for the number of runs itself, where n is the runs
    a question has and c how many of them are correct. "Correct" is the task's 0/1 rule
    (``math_equal`` for math, ``em`` for qa) or, when the judge ran, ``llm_equal``;
  - tool calls per sample, in total and per tool, and the share of samples that called any tool.
The headline is ``llm_equal`` when the judge ran, else the task's headline (math_equal / f1), as in the
reference evaluation (docs/design/arpo_reference.md §9).

``llm_equal`` of a sample = the judge said correct OR the task's rule already matched (the reference's
``is_equiv(pred, gold) or judge``). When the judge is unavailable, ``llm_equal`` is left out entirely and
results.json carries ``judge: {"status": "unavailable", "reason": ...}``.
"""

from __future__ import annotations

import json
import math
import os
from collections import defaultdict
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

from evaluation.metrics import mean_std, pass_at_k
from megatron_arpo.fsutil import atomic_write

__all__ = ["aggregate_dataset", "format_markdown", "pass_k_values", "write_json_atomic", "write_jsonl_atomic",
           "write_text_atomic"]

RULE_METRICS = ("em", "f1", "acc", "math_equal", "reward")


def pass_k_values(num_runs: int) -> list[int]:
    """1, 2, 4, ... below ``num_runs``, plus ``num_runs`` itself."""
    ks, k = [], 1
    while k < num_runs:
        ks.append(k)
        k *= 2
    ks.append(num_runs)
    return ks


def _mean(values: Sequence[float]) -> float:
    return math.fsum(values) / len(values) if values else float("nan")


def aggregate_dataset(records: Sequence[dict], *, task: str, correct_metric: str, headline: str,
                      num_runs: int) -> dict[str, Any]:
    """Summary of one dataset's records (each with ``sample_id``, ``run``, ``metrics`` and tool counts)."""
    if not records:
        raise ValueError("aggregate_dataset: no records")
    metric_names = [m for m in (*RULE_METRICS, "llm_equal") if all(m in r["metrics"] for r in records)]
    by_run: dict[int, list[dict]] = defaultdict(list)
    by_sample: dict[str, list[dict]] = defaultdict(list)
    for r in records:
        by_run[int(r["run"])].append(r)
        by_sample[str(r["sample_id"])].append(r)
    runs = sorted(by_run)

    per_run = {m: [_mean([float(r["metrics"][m]) for r in by_run[run]]) for run in runs] for m in metric_names}
    pass1 = {}
    for m, values in per_run.items():
        mean, std = mean_std(values)
        pass1[m] = {"mean": mean, "std": std, "runs": values}

    counts = [len(rs) for rs in by_sample.values()]
    ks = [k for k in pass_k_values(num_runs) if k <= min(counts)]
    pass_k = {}
    for k in ks:
        scores = []
        for rs in by_sample.values():
            c = sum(1 for r in rs if float(r["metrics"][correct_metric]) >= 1.0)
            scores.append(pass_at_k(len(rs), c, k))
        pass_k[f"pass@{k}"] = _mean(scores)

    tool_totals: dict[str, float] = defaultdict(float)
    for r in records:
        for tool, n in (r.get("tool_calls_by_tool") or {}).items():
            tool_totals[tool] += n
    num = len(records)
    tools = {
        "calls_per_sample": _mean([float(r.get("num_tool_calls", 0)) for r in records]),
        "per_tool": {tool: total / num for tool, total in sorted(tool_totals.items())},
        "samples_with_tool_calls": sum(1 for r in records if r.get("num_tool_calls", 0) > 0) / num,
    }
    finish: dict[str, int] = defaultdict(int)
    for r in records:
        finish[str(r.get("finish_reason"))] += 1
    return {
        "task": task,
        "num_samples": len(by_sample),
        "num_runs": len(runs),
        "num_records": num,
        "headline": {"metric": headline, "mean": pass1[headline]["mean"], "std": pass1[headline]["std"]},
        "correct_metric": correct_metric,
        "pass@1": pass1,
        "pass@k": pass_k,
        "tool_calls": tools,
        "mean_response_tokens": _mean([float(r.get("num_response_tokens", 0)) for r in records]),
        "finish_reasons": dict(sorted(finish.items())),
    }


def _fmt(value: Optional[float], scale: float = 100.0) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "-"
    return f"{value * scale:.1f}"


def format_markdown(results: dict[str, Any]) -> str:
    """The summary table printed at the end of `megatron-arpo eval` (percentages)."""
    lines = [
        "| dataset | task | n | runs | headline | pass@1 (mean ± std) | pass@k | EM | F1 | acc | math_eq | tools/sample |",
        "|---|---|---:|---:|---|---|---|---:|---:|---:|---:|---:|",
    ]
    for name, d in results["datasets"].items():
        h = d["headline"]
        p1 = d["pass@1"]
        passk = ", ".join(f"{k}={_fmt(v)}" for k, v in d["pass@k"].items() if k != "pass@1") or "-"

        def m(key: str) -> str:
            return _fmt(p1[key]["mean"]) if key in p1 else "-"

        lines.append(
            f"| {name} | {d['task']} | {d['num_samples']} | {d['num_runs']} | {h['metric']} | "
            f"{_fmt(h['mean'])} ± {_fmt(h['std'])} | {passk} | {m('em')} | {m('f1')} | {m('acc')} | "
            f"{m('math_equal')} | {d['tool_calls']['calls_per_sample']:.2f} |"
        )
    judge = results.get("judge", {})
    if judge.get("status") == "unavailable":
        lines.append("")
        lines.append(f"Judge unavailable ({judge.get('reason')}); headline metrics are rule-based.")
    return "\n".join(lines) + "\n"


def write_json_atomic(path: str | os.PathLike, data: Any) -> Path:
    path = Path(path)
    with atomic_write(path) as fh:
        fh.write(json.dumps(data, indent=2, ensure_ascii=False, allow_nan=True) + "\n")
    return path


def write_text_atomic(path: str | os.PathLike, text: str) -> Path:
    path = Path(path)
    with atomic_write(path) as fh:
        fh.write(text)
    return path


def write_jsonl_atomic(path: str | os.PathLike, rows: Iterable[dict]) -> Path:
    path = Path(path)
    with atomic_write(path) as fh:
        fh.write("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in rows))
    return path
