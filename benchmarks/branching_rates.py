"""Branching rates of the four entropy timing x estimator choices, and the tau/beta that give the paper's rates.

The paper's rates are those of the reference code (``branch_timing: reference``, ``entropy_estimator:
reference``, ARPO tau = 0.5, beta = 0.2): its first decision has dH = 0, so it branches with probability
exactly tau, and later ones with clip(tau + beta*dH, 0, 1). Our default (``after_result``) measures the first
tokens after the result, so dH != 0 from the first decision on, and the ``mean`` estimator lives on another
scale. ``megatron_arpo.algo.branching`` derives the conversion (its module docstring holds the table); this
script measures it with the real scheduler:

- a scripted tool-using policy (2-4 searches, then an answer) whose per-position top-10 distributions have a
  per-prompt first-segment entropy, a random change after every tool result (mean +0.1 of ln 10 per token,
  spread 0.5) and segment lengths of 6-45 tokens, so segments shorter than the 20-token window occur;
- each row runs the scheduler on the same prompts and seed, and reports, over its recorded decisions, the mean
  branch probability clip(tau + beta*dH, 0, 1) at the 1st, 2nd and 3rd tool result (the exact rate of each
  decision; less noisy than counting branches) and the branches actually taken;
- the "converted"/"calibrated" rows use the conversion: beta_mean = beta * window * ln(k) / ln|V| and, for
  ``after_result``, tau' = tau - beta' * mean dH at the first decision (measured here by a first run with the
  published values, as a user measures it from the ``rollout/entropy_after_tool`` and
  ``rollout/entropy_first_segment`` metrics of a first step).

    python benchmarks/branching_rates.py [--num-prompts 64 --n 8]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import math
import re
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the scripted engine (tests/support)

from megatron_arpo.rollout.group import RolloutGroup  # noqa: E402
from megatron_arpo.rollout.protocol import TagProtocol  # noqa: E402
from megatron_arpo.rollout.scheduler import RolloutOptions, RolloutPrompt, RolloutScheduler  # noqa: E402
from support.scripted import CharCodec, ScriptedEngine, ScriptedStep  # noqa: E402
from megatron_arpo.tools.base import Tool, ToolExecutor, ToolResult  # noqa: E402

CODEC = CharCodec()
RESULT_ID = CODEC.token_id("<result>")
RESULT_END_ID = CODEC.token_id("</result>")
VOCAB = 151_669    # Qwen3's |V|: the reference estimator's normaliser
TOPK = 10
WINDOW = 20
MIN_FILLER = 0     # --min-filler 20: every segment fills the entropy window


def _unit(*parts) -> float:
    digest = hashlib.sha256("/".join(map(str, parts)).encode()).digest()
    return int.from_bytes(digest[:8], "little") / 2 ** 64


def _top_prob(level: float) -> float:
    """q such that [q, (1-q)/9 x 9] has entropy level * ln(10) (bisection; entropy falls as q grows)."""
    target = min(max(level, 0.0), 0.999) * math.log(TOPK)
    lo, hi = 1.0 / TOPK, 1.0 - 1e-12
    for _ in range(60):
        q = (lo + hi) / 2
        h = -q * math.log(q) - (1 - q) * math.log((1 - q) / (TOPK - 1))
        lo, hi = (q, hi) if h > target else (lo, q)
    return (lo + hi) / 2


def _table(level: float) -> dict[int, float]:
    q = _top_prob(level)
    return {2000 + i: math.log(q if i == 0 else (1 - q) / (TOPK - 1)) for i in range(TOPK)}


def script(context, request):
    """Round r (results in the context): a segment of 6-45 tokens at entropy level e_r. Its text starts with a
    4-digit seed (the request's; a continuation after an after-result probe reads it back from the probe's
    tokens and emits the rest of the same text); the first segment also writes the plan (2-4 searches)."""
    r = context.count(RESULT_ID)
    prompt = CODEC.decode(context[:6])
    done = 0 if r == 0 else len(context) - (max(i for i, t in enumerate(context) if t == RESULT_END_ID) + 1)
    seed = request.seed % 10000 if done == 0 else int(CODEC.decode(context[len(context) - done:][:4]))
    planned = 2 + seed % 3 if r == 0 else int(re.search(r"plan (\d)", CODEC.decode(context)).group(1))
    e0 = 0.25 + 0.5 * _unit("h0", prompt)
    level = e0 if r == 0 else e0 - 0.15 + 0.5 * _unit("dh", prompt, r, seed)
    length = MIN_FILLER + int(40 * _unit("len", prompt, r, seed) ** 2)  # default: a third end inside the window
    filler = "".join("abcdefghij"[int(10 * _unit("c", prompt, r, seed, j))] for j in range(length))
    head = f"{seed:04d}" + (f"plan {planned} " if r == 0 else "")
    tail = f"<search>{prompt.strip()} {r}</search>" if r < planned else f"<answer>\\boxed{{{seed % 7}}}</answer><EOS>"
    return ScriptedStep(CODEC.encode(head + filler + tail)[done:], _table(level))


class Search(Tool):
    tag = "search"

    async def execute(self, query: str) -> ToolResult:
        return ToolResult(text=f"doc {query}")


async def run_row(args, timing: str, estimator: str, tau: float, beta: float, variant: str = "arpo") -> dict:
    engine = ScriptedEngine(script)
    tools = ToolExecutor([Search()], max_concurrency=256, timeout_s=60, retries=0)
    options = RolloutOptions(n=args.n, initial_rollouts=args.n // 2, beam_size=2, branch_threshold=tau,
                             entropy_weight=beta, entropy_estimator=estimator, branch_timing=timing,
                             entropy_window=WINDOW, logprobs_topk=TOPK, call_limit=6, response_length=2048,
                             seed=args.seed, variant=variant, consecutive_branch_penalty=0.0)
    sched = RolloutScheduler(RolloutGroup([engine]), tools, TagProtocol(CODEC, ["search"], vocab_size=VOCAB), options)
    prompts = [RolloutPrompt(f"p{i}", CODEC.encode(f"Q{i:04d}\n")) for i in range(args.num_prompts)]
    result = await sched.run(prompts)
    by_call: dict[int, list[float]] = {}
    dh_first, branched, decisions = [], 0, 0
    for t in result.trajectories():
        for d in t.decisions:
            dh = d.h_now - d.h0
            base = tau if variant == "arpo" else 1.0 - tau  # AEPO at c = 0 (no penalty here): s >= tau
            by_call.setdefault(d.tool_call_index, []).append(min(max(base + beta * dh, 0.0), 1.0))
            if d.tool_call_index == 0:
                dh_first.append(dh)
            branched += d.branched
            decisions += 1
    return {"p": [statistics.mean(by_call.get(k, [float("nan")])) for k in range(3)],
            "dh_first": statistics.mean(dh_first), "branched": branched, "decisions": decisions,
            "branches": int(result.stats["branches"])}


async def main_async(args) -> list[tuple[str, float, float, str, str, dict]]:
    tau, beta = 0.5, 0.2
    scale = WINDOW * math.log(TOPK) / math.log(VOCAB)   # reference value of a full window per unit of mean value
    rows = []

    async def add(name, timing, estimator, t, b, variant="arpo"):
        rows.append((name, t, b, timing, estimator, await run_row(args, timing, estimator, t, b, variant)))
        return rows[-1][-1]

    await add("paper (reference code)", "reference", "reference", tau, beta)
    ar = await add("after_result, published tau/beta", "after_result", "reference", tau, beta)
    await add("after_result, calibrated", "after_result", "reference", tau - beta * ar["dh_first"], beta)
    await add("AEPO (penalty 0), after_result, calibrated: tau = 1 - ARPO's", "after_result", "reference",
              1 - (tau - beta * ar["dh_first"]), beta, "aepo")
    await add("reference timing, mean, published", "reference", "mean", tau, beta)
    await add("reference timing, mean, beta converted (full windows)", "reference", "mean", tau, beta * scale)
    await add("reference timing, mean, beta for this length mix", "reference", "mean", tau, args.short_beta)
    am = await add("after_result, mean, beta converted", "after_result", "mean", tau, beta * scale)
    await add("after_result, mean, calibrated", "after_result", "mean", tau - beta * scale * am["dh_first"], beta * scale)
    return rows


def render(rows, args) -> str:
    lines = ["| row | timing | estimator | tau | beta | mean dH at 1st decision | P(branch) 1st | 2nd | 3rd "
             "| branches taken / decisions |", "|" + "---|" * 10]
    for name, t, b, timing, est, r in rows:
        p = " | ".join(f"{x:.3f}" for x in r["p"])
        lines.append(f"| {name} | {timing} | {est} | {t:.3f} | {b:.3f} | {r['dh_first']:+.3f} | {p} "
                     f"| {r['branched']} / {r['decisions']} |")
    lines.append("")
    lines.append(f"{args.num_prompts} prompts, n = {args.n}, initial {args.n // 2}, beam 2, window {WINDOW}, "
                 f"top-{TOPK}, |V| = {VOCAB}; scale window*ln(k)/ln|V| = {WINDOW * math.log(TOPK) / math.log(VOCAB):.3f}.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--num-prompts", type=int, default=128)
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--short-beta", type=float, default=0.36,
                        help="the mean-estimator beta tried for this policy's segment lengths (a third shorter than "
                             "the window): the reference estimator shrinks short segments, which no single factor "
                             "reproduces")
    parser.add_argument("--min-filler", type=int, default=0, help="20: every segment fills the window")
    args = parser.parse_args(argv)
    global MIN_FILLER
    MIN_FILLER = args.min_filler
    print(render(asyncio.run(main_async(args)), args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
