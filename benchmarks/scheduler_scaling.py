"""Scheduler time per engine request as the group grows: n = 8 vs n = 512 trajectories per prompt (issue 30).

The scripted tool-using policy of benchmarks/rollout.py (ARPO: initial n/2, beam 2, after-result probes)
on an engine and a tool that answer at once, so the wall time is the scheduler's own work (plus the
script's, constant per request). Every configuration runs the same number of trajectories (``--total``):
``total / n`` prompts of ``n``. Per-rollout statistics are computed the way they are now
(``shared_prefix_tokens``: two lexicographic neighbours per trajectory) and, for comparison in the same
run, with the earlier pairwise comparison of every trajectory with every earlier one of its prompt.
Target: time per request at n = 512 within 1.5x of n = 8.

    python benchmarks/scheduler_scaling.py [--total 512 --ns 8 128 512 --repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the scripted engine (tests/support)
sys.path.insert(0, str(Path(__file__).resolve().parent))

import rollout as bench_rollout  # noqa: E402  (benchmarks/rollout.py: the policy and the search tool)
from megatron_arpo.rollout import scheduler as scheduler_module  # noqa: E402
from megatron_arpo.rollout.group import RolloutGroup  # noqa: E402
from megatron_arpo.rollout.protocol import TagProtocol  # noqa: E402
from megatron_arpo.rollout.scheduler import RolloutOptions, RolloutPrompt, RolloutScheduler  # noqa: E402
from megatron_arpo.rollout.trajectory import shared_prefix_tokens  # noqa: E402
from megatron_arpo.tools.base import ToolExecutor  # noqa: E402
from support.scripted import ScriptedEngine  # noqa: E402

CODEC = bench_rollout.CODEC


def pairwise_shared_prefix_tokens(trajectories) -> int:
    """The statistic as computed before issue 30: every trajectory against every earlier one of its prompt."""
    by_prompt: dict[int, list] = {}
    for t in trajectories:
        by_prompt.setdefault(t.prompt_index, []).append(t)
    saved = 0
    for group in by_prompt.values():
        seqs = [t.context() for t in sorted(group, key=lambda t: t.index)]
        for i in range(1, len(seqs)):
            best = 0
            for j in range(i):
                a, b = seqs[i], seqs[j]
                k, limit = 0, min(len(a), len(b))
                while k < limit and a[k] == b[k]:
                    k += 1
                best = max(best, k)
            saved += best
    return saved


async def one_rollout(n: int, total: int, seed: int, prompt_chars: int) -> dict:
    engine = ScriptedEngine(bench_rollout.policy("late"), block_size=16)
    tools = ToolExecutor([bench_rollout.BenchSearch(0.0, 0.0, 0.0)], max_concurrency=100000, timeout_s=60,
                         retries=0)
    options = RolloutOptions(n=n, initial_rollouts=n // 2, beam_size=2, branch_threshold=0.5, entropy_weight=0.2,
                             branch_timing="after_result", call_limit=6, response_length=2048, seed=seed)
    sched = RolloutScheduler(RolloutGroup([engine]), tools, TagProtocol(CODEC, ["search"]), options)
    system = ("You answer questions. Think inside <think></think>, look facts up inside <search></search>, answer "
              "inside <answer></answer>. " * 8)[:prompt_chars]
    prompts = [RolloutPrompt(f"p{i}", CODEC.encode(f"Q{i:03d}: what is fact {i}? Use search.\n{system}"))
               for i in range(total // n)]
    start = time.perf_counter()
    result = await sched.run(prompts)
    wall = time.perf_counter() - start
    requests = result.stats["engine_requests"]
    return {"n": n, "prompts": len(prompts), "requests": requests, "wall_s": wall,
            "us_per_request": 1e6 * wall / requests, "shared_prefix_tokens": result.stats["shared_prefix_tokens"]}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--total", type=int, default=512, help="trajectories per configuration")
    ap.add_argument("--ns", type=int, nargs="+", default=[8, 128, 512])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--prompt-chars", type=int, default=600, help="system text after each question (1 char = 1 token)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    variants = {"pairwise (before)": pairwise_shared_prefix_tokens, "neighbours (now)": shared_prefix_tokens}
    runs: dict[tuple, list] = {}
    for _ in range(args.repeats):  # alternated: every configuration once per repeat
        for variant, stat in variants.items():
            scheduler_module.shared_prefix_tokens = stat
            for n in args.ns:
                runs.setdefault((variant, n), []).append(
                    asyncio.run(one_rollout(n, args.total, args.seed, args.prompt_chars)))
    scheduler_module.shared_prefix_tokens = shared_prefix_tokens
    rows = []
    for (variant, n), done in runs.items():
        per = sorted(r["us_per_request"] for r in done)
        rows.append({**done[0], "variant": variant, "us_per_request": statistics.median(per), "min_us": per[0],
                     "max_us": per[-1]})
    print("| statistic | n | prompts | requests | us/request (median) | min-max | vs n = %d |" % args.ns[0])
    print("|---|---|---|---|---|---|---|")
    for row in rows:
        base = next(r for r in rows if r["variant"] == row["variant"] and r["n"] == args.ns[0])
        print(f"| {row['variant']} | {row['n']} | {row['prompts']} | {row['requests']:.0f} | {row['us_per_request']:.0f} | "
              f"{row['min_us']:.0f}-{row['max_us']:.0f} | {row['us_per_request'] / base['us_per_request']:.2f}x |")
    same = {(r["n"], r["shared_prefix_tokens"]) for r in rows}
    assert len(same) == len(args.ns), f"the two statistics disagree: {sorted(same)}"
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
