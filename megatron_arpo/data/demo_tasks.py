"""The synthetic task set of the CPU demo (`make demo`): prompts for ARPO and cold-start SFT trajectories.

Two task families, both phrased with a handful of fixed templates so that a 2-layer model can learn the
mapping question -> tool call -> answer:

- ``demo_arith``: ``What is 37 * 48?`` (``+``, ``-``, ``*`` on two-digit numbers). The tool trajectory
  copies the numbers into ``<python>print(37*48)</python>`` and copies the printed value into
  ``\\boxed{}``.
- ``demo_search``: questions about invented towns (``What is the population of Kelford?``, ``In which
  year was Kelford founded?``, ``In which country is Kelford?``). Every town has one passage in the demo
  corpus, written from one template; the countries are the ones of the shipped mini corpus (Veloria,
  Norvania, Ostrel). The tool trajectory searches ``Kelford population`` and copies the value out of the
  BM25 result. The demo corpus is the mini corpus (``builtin/mini_corpus.jsonl``, as distractors) plus
  the town passages.

The two assistant texts (then ``<|im_end|>``)::

    <think>I need to compute 37*48.</think><python>print(37*48)</python> <result>\\n1776\\n</result><answer>\\boxed{1776}</answer>
    <think>I need to compute 37*48.</think><answer>\\boxed{1776}</answer>

There is no second ``<think>`` after the result, to keep trajectories short: the value is copied once,
straight into ``\\boxed{}``.

Towns and number pairs are split three ways without overlap: SFT, RL train, validation. So the
validation reward measures a skill (copy the entity into the call, copy the value out of the result),
not memorised facts.

Cold-start SFT data is a deliberate MIXTURE: a fraction ``sft_tool_fraction`` of the trajectories call
the tool; the others answer directly after the same ``<think>`` (with the correct value, as a person
who knows it would). Both kinds have the same prefix, so the SFT model calls the tool about that often,
and its direct answers, which a tiny model cannot compute or recall for unseen towns, are mostly wrong.
This leaves RL the headroom the demo exists to show: GRPO raises the reward mainly by raising the rate
of tool calls, and by making the copies more reliable.

Tool results inside the SFT trajectories come from the REAL tools (the python sandbox and BM25 over the
demo corpus, with the demo's ``topk``/``result_chars``), spliced exactly as the rollout splices them:
``" <result>\\n{payload}\\n</result>"`` right after the closing tool tag (rollout/protocol.py).

Ground truths are plain strings (integers, a country name) that the deep_research reward scores with
F1 = 1 when the boxed answer is right; ``tests/unit/test_demo_tasks.py`` checks this for every row.

Determinism: one PRNG stream seeded with ``seed`` that uses only ``random.Random.random()`` (the one
method Python guarantees to reproduce across versions); files are written with sorted keys, atomically.
Nothing is shipped: the SFT file is about 1 MB and must be produced by the real tools with the demo's
search settings, so `make demo` writes everything into the run directory first:
``python -m megatron_arpo.data.demo_tasks --out runs/demo/data`` (about 15 s, mostly sandbox starts), or
``ensure_demo_tasks(out_dir)`` from Python, which builds only when the files are missing or were built
with other settings.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from megatron_arpo.fsutil import atomic_write

logger = logging.getLogger(__name__)

BUILTIN_DIR = Path(__file__).resolve().parent / "builtin"
MINI_CORPUS = BUILTIN_DIR / "mini_corpus.jsonl"

# File names written by build_demo_tasks (configs/demo.yaml points at them).
CORPUS_FILE = "demo_corpus.jsonl"
TRAIN_FILE = "demo_train.jsonl"
VAL_FILE = "demo_val.jsonl"
SFT_FILE = "demo_sft.jsonl"
STAMP_FILE = "demo_tasks.stamp.json"

# Shorter than data.datasets.DEFAULT_SYSTEM_PROMPT (about 45 instead of 124 tokens of the tiny tokenizer):
# on the demo model the prompt is most of every sequence. configs/demo.yaml sets data.system_prompt to it.
DEMO_SYSTEM_PROMPT = (
    "Solve the question. Think inside <think> </think>. You can search with <search> query </search> "
    "or run code with <python> code </python>; the tool output comes inside <result> </result>. "
    "Give the final answer inside <answer> </answer> as \\boxed{answer}."
)

ARITH_SOURCE = "demo_arith"
SEARCH_SOURCE = "demo_search"

COUNTRIES = ("Veloria", "Norvania", "Ostrel")  # the countries of the mini corpus
# 30 x 16 = 480 invented town names; none collides with a mini-corpus title (checked in build_towns).
_TOWN_HEADS = ("Ash", "Bar", "Cor", "Dun", "El", "Fen", "Gar", "Hol", "Kel", "Lor", "Mar", "Nor", "Pel",
               "Ros", "Sel", "Tor", "Val", "Wen", "Yar", "Brom", "Cal", "Dor", "Har", "Lin", "Mor", "Pen", "Red",
               "Sil", "Thorn", "Wil")
_TOWN_TAILS = ("ford", "mere", "wick", "dale", "holm", "by", "stead", "ton", "burg", "field", "gate", "well",
               "brook", "haven", "ridge", "moor")

# (relation, question template, query template, thought) for the town facts.
_SEARCH_TEMPLATES = (
    ("population", "What is the population of {town}?", "{town} population", "the population of {town}"),
    ("year", "In which year was {town} founded?", "{town} founded", "the year {town} was founded"),
    ("country", "In which country is {town}?", "{town} country", "the country of {town}"),
)
_ARITH_OPS = ("+", "-", "*")

# Split sizes (towns for the search family, distinct questions for the arithmetic family).
NUM_TOWNS = {"sft": 300, "train": 120, "val": 60}
NUM_ARITH = {"sft": 900, "train": 360, "val": 60}
NUM_SEARCH_VAL = 60  # val questions drawn from the 60 val towns x 3 relations


@dataclass(frozen=True)
class DemoTask:
    question: str
    answer: str
    data_source: str
    tool: str          # "python" | "search"
    tool_query: str    # what the tool trajectory writes between the tool tags
    thought: str       # the first <think> (shared by the tool and the direct trajectory)

    def prompt_row(self, index: int) -> dict:
        return {"id": f"{self.data_source}-{index}", "question": self.question, "answer": self.answer,
                "data_source": self.data_source, "ability": self.tool}


@dataclass(frozen=True)
class Town:
    name: str
    country: str
    year: int
    population: int

    def passage(self) -> dict:
        text = (f"{self.name} is a town in {self.country}. It was founded in {self.year}. "
                f"Its population is {self.population}.")
        return {"id": f"town-{self.name.lower()}", "title": self.name, "contents": text}

    def fact(self, relation: str) -> str:
        return {"population": str(self.population), "year": str(self.year), "country": self.country}[relation]


def _randint(rng: random.Random, low: int, high: int) -> int:
    # random() is the only Random method whose output Python promises to keep across versions.
    return low + int(rng.random() * (high - low + 1))


def _shuffle(rng: random.Random, items: list) -> list:
    items = list(items)
    for i in range(len(items) - 1, 0, -1):
        j = _randint(rng, 0, i)
        items[i], items[j] = items[j], items[i]
    return items


def _mini_corpus_titles() -> set[str]:
    with open(MINI_CORPUS, encoding="utf-8") as fh:
        return {json.loads(line)["title"].lower() for line in fh if line.strip()}


def build_towns(rng: random.Random) -> list[Town]:
    names = [head + tail for head in _TOWN_HEADS for tail in _TOWN_TAILS]
    clash = sorted(set(n.lower() for n in names) & _mini_corpus_titles())
    if clash:
        raise RuntimeError(f"demo town names {clash} collide with mini-corpus titles; change _TOWN_HEADS/_TAILS")
    towns = []
    for name in _shuffle(rng, names):
        towns.append(Town(name=name, country=COUNTRIES[_randint(rng, 0, len(COUNTRIES) - 1)],
                          year=_randint(rng, 1100, 1990), population=_randint(rng, 1000, 99999)))
    return towns


def _search_task(town: Town, template: tuple[str, str, str, str]) -> DemoTask:
    relation, question, query, thought = template
    return DemoTask(question=question.format(town=town.name), answer=town.fact(relation),
                    data_source=SEARCH_SOURCE, tool="search", tool_query=query.format(town=town.name),
                    thought=f"I need {thought.format(town=town.name)}.")


def _arith_task(a: int, op: str, b: int) -> DemoTask:
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    return DemoTask(question=f"What is {a} {op} {b}?", answer=str(value), data_source=ARITH_SOURCE,
                    tool="python", tool_query=f"print({a}{op}{b})", thought=f"I need to compute {a}{op}{b}.")


def _arith_tasks(rng: random.Random, count: int, seen: set) -> list[DemoTask]:
    tasks = []
    while len(tasks) < count:
        op = _ARITH_OPS[_randint(rng, 0, len(_ARITH_OPS) - 1)]
        a, b = _randint(rng, 10, 99), _randint(rng, 10, 99)
        if op == "-" and a < b:  # keep answers non-negative: the reward's F1 drops the minus sign
            a, b = b, a
        if (a, op, b) in seen:
            continue
        seen.add((a, op, b))
        tasks.append(_arith_task(a, op, b))
    return tasks


def generate_demo_tasks(seed: int = 0) -> tuple[dict[str, list[DemoTask]], list[dict]]:
    """The task splits ``{"sft", "train", "val"}`` and the town passages of the demo corpus."""
    rng = random.Random(seed)
    towns = build_towns(rng)
    assert len(towns) >= sum(NUM_TOWNS.values())
    town_splits, start = {}, 0
    for split in ("val", "train", "sft"):
        town_splits[split] = towns[start:start + NUM_TOWNS[split]]
        start += NUM_TOWNS[split]
    seen: set = set()
    splits: dict[str, list[DemoTask]] = {}
    for split in ("val", "train", "sft"):
        search = [_search_task(town, template) for town in town_splits[split] for template in _SEARCH_TEMPLATES]
        if split == "val":
            search = _shuffle(rng, search)[:NUM_SEARCH_VAL]
        arith = _arith_tasks(rng, NUM_ARITH[split], seen)
        splits[split] = _shuffle(rng, search + arith)
    passages = [town.passage() for town in towns]
    return splits, passages


def _read_jsonl(path: Path) -> list[dict]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _write_jsonl_atomic(path: Path, rows: list[dict]) -> None:
    with atomic_write(path) as fh:
        for row in rows:
            fh.write(json.dumps(row, sort_keys=True, ensure_ascii=False) + "\n")


def result_block(payload: str) -> str:
    """The text the rollout splices after a closing tool tag (rollout/protocol.py RESULT_TEMPLATE)."""
    return f" <result>\n{payload}\n</result>"


def tool_trajectory(task: DemoTask, payload: str) -> str:
    return (f"<think>{task.thought}</think><{task.tool}>{task.tool_query}</{task.tool}>{result_block(payload)}"
            f"<answer>\\boxed{{{task.answer}}}</answer>")


def direct_trajectory(task: DemoTask) -> str:
    return f"<think>{task.thought}</think><answer>\\boxed{{{task.answer}}}</answer>"


async def _run_tools(tasks: list[DemoTask], corpus: Path, topk: int, result_chars: int,
                     max_concurrency: int = 4) -> list[str]:
    # deferred: pulls in ctypes, which this module's importers need not load
    from megatron_arpo.tools.python_sandbox import PythonSandboxTool
    from megatron_arpo.tools.search import LocalBM25Backend, SearchTool

    tools = {"python": PythonSandboxTool(timeout_s=10, memory_mb=512),
             "search": SearchTool(LocalBM25Backend(str(corpus)), topk=topk, result_chars=result_chars)}
    semaphore = asyncio.Semaphore(max_concurrency)
    cache: dict[tuple[str, str], asyncio.Task] = {}

    async def call(tool: str, query: str) -> str:
        async with semaphore:
            result = await tools[tool].execute(query)
        if not result.ok:
            raise RuntimeError(f"demo SFT data: the {tool} tool failed on {query!r}: {result.error}: {result.text}")
        return result.text

    for task in tasks:
        key = (task.tool, task.tool_query)
        if key not in cache:
            cache[key] = asyncio.ensure_future(call(*key))
    try:
        return [await cache[(task.tool, task.tool_query)] for task in tasks]
    finally:
        for tool in tools.values():
            await tool.close()


def build_sft_rows(tasks: list[DemoTask], payloads: list[Optional[str]], system_prompt: str) -> list[dict]:
    """ShareGPT rows; the trajectory of task i calls the tool iff payloads[i] is not None."""
    rows = []
    for task, payload in zip(tasks, payloads):
        text = tool_trajectory(task, payload) if payload is not None else direct_trajectory(task)
        rows.append({"system": system_prompt,
                     "conversations": [{"from": "human", "value": task.question}, {"from": "gpt", "value": text}]})
    return rows


DEFAULT_SFT_TOOL_FRACTION = 0.5


def _settings(seed: int, sft_tool_fraction: float, topk: int, result_chars: int, system_prompt: str) -> dict:
    return {"seed": seed, "sft_tool_fraction": sft_tool_fraction, "topk": topk, "result_chars": result_chars,
            "system_prompt": system_prompt, "generator": Path(__file__).read_text(encoding="utf-8")}


def build_demo_tasks(out_dir: str | os.PathLike, seed: int = 0, *,
                     sft_tool_fraction: float = DEFAULT_SFT_TOOL_FRACTION, topk: int = 1, result_chars: int = 300,
                     system_prompt: str = DEMO_SYSTEM_PROMPT) -> dict[str, Path]:
    """Write the demo corpus, the train/val prompt JSONL files and the SFT trajectories into ``out_dir``.

    ``topk``/``result_chars`` must equal ``tools.search.topk``/``result_chars`` of the demo config, so the
    SFT results look exactly like the RL ones. Returns the written paths keyed corpus/train/val/sft.
    A stamp file (``demo_tasks.stamp.json``, written last) records the settings for ensure_demo_tasks.
    """
    if not 0.0 <= sft_tool_fraction <= 1.0:
        raise ValueError(f"sft_tool_fraction={sft_tool_fraction} must lie in [0, 1]")
    if topk < 1 or result_chars < 1:
        raise ValueError(f"topk={topk} and result_chars={result_chars} must be >= 1 (tools.search of the config)")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / STAMP_FILE).unlink(missing_ok=True)
    splits, town_passages = generate_demo_tasks(seed)
    paths = {"corpus": out / CORPUS_FILE, "train": out / TRAIN_FILE, "val": out / VAL_FILE, "sft": out / SFT_FILE}
    _write_jsonl_atomic(paths["corpus"], _read_jsonl(MINI_CORPUS) + town_passages)
    for split in ("train", "val"):
        _write_jsonl_atomic(paths[split], [task.prompt_row(i) for i, task in enumerate(splits[split])])

    sft_tasks = splits["sft"]
    # Which SFT trajectories call the tool: an exact fraction per family, at positions drawn from the seed.
    choice_rng = random.Random(seed + 1)
    use_tool = [False] * len(sft_tasks)
    for source in (ARITH_SOURCE, SEARCH_SOURCE):
        idx = [i for i, task in enumerate(sft_tasks) if task.data_source == source]
        for i in _shuffle(choice_rng, idx)[: round(sft_tool_fraction * len(idx))]:
            use_tool[i] = True
    tool_tasks = [task for task, flag in zip(sft_tasks, use_tool) if flag]
    results = iter(asyncio.run(_run_tools(tool_tasks, paths["corpus"], topk, result_chars)))
    payloads = [next(results) if flag else None for flag in use_tool]
    _write_jsonl_atomic(paths["sft"], build_sft_rows(sft_tasks, payloads, system_prompt))
    stamp = _settings(seed, sft_tool_fraction, topk, result_chars, system_prompt)
    _write_jsonl_atomic(out / STAMP_FILE, [stamp])
    logger.info("demo tasks: %d train, %d val prompts, %d SFT trajectories (%d with a tool call) in %s",
                len(splits["train"]), len(splits["val"]), len(sft_tasks), len(tool_tasks), out)
    return paths


def ensure_demo_tasks(out_dir: str | os.PathLike, seed: int = 0, **kwargs) -> dict[str, Path]:
    """build_demo_tasks unless ``out_dir`` already holds a complete build with the same settings and code."""
    out = Path(out_dir)
    paths = {"corpus": out / CORPUS_FILE, "train": out / TRAIN_FILE, "val": out / VAL_FILE, "sft": out / SFT_FILE}
    stamp_path = out / STAMP_FILE
    wanted = _settings(seed, kwargs.get("sft_tool_fraction", DEFAULT_SFT_TOOL_FRACTION), kwargs.get("topk", 1),
                       kwargs.get("result_chars", 300), kwargs.get("system_prompt", DEMO_SYSTEM_PROMPT))
    if stamp_path.is_file() and all(p.is_file() for p in paths.values()):
        try:
            if _read_jsonl(stamp_path) == [wanted]:
                return paths
        except ValueError:
            pass  # a damaged stamp: rebuild
    return build_demo_tasks(out, seed, **kwargs)


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="output directory, e.g. runs/demo/data")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--sft-tool-fraction", type=float, default=DEFAULT_SFT_TOOL_FRACTION)
    parser.add_argument("--topk", type=int, default=1, help="= tools.search.topk of the demo config")
    parser.add_argument("--result-chars", type=int, default=300, help="= tools.search.result_chars")
    parser.add_argument("--force", action="store_true", help="rebuild even if an up-to-date build exists")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    build = build_demo_tasks if args.force else ensure_demo_tasks
    paths = build(args.out, args.seed, sft_tool_fraction=args.sft_tool_fraction, topk=args.topk,
                  result_chars=args.result_chars)
    for name, path in paths.items():
        print(f"{name}: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
