"""The evaluation runner: generate with the training rollout code, score, judge, aggregate, resume.

Generation goes through `megatron_arpo.rollout` exactly as training validation does: prompts rendered by
the checkpoint's `ChatFormat` (chat template, EOS ids, thinking prefix), a `RolloutGroup` of
`VllmEngine`s, the `RolloutScheduler` with its tag protocol (closing tags are stop strings, results are
spliced as ``" <result>\\n{payload}\\n</result>"``, tokenized once) and the `ToolExecutor` of
`megatron_arpo.tools` (sandboxed python, search backends, cache). Each (question, run) is one scheduler
call with n = 1 and no branching; greedy when the temperature is 0, else sampled with a per-call seed
derived from (dataset, sample id, run), so a rerun draws the same samples. Calls run concurrently
(``max_in_flight``), so the engine batches them continuously.

Scoring per sample reuses the training scorers: the answer is `evaluation.metrics.extract_answer`, the
metrics are em / f1 / acc / math_equal (evaluation.metrics) and ``reward`` is the dataset task's RL reward
from `megatron_arpo.rewards` on the full response text.

Output layout under ``out_dir``:
  ``<dataset>/samples.jsonl``  one record per (sample id, run) with the full trajectory; appended and
                               fsynced per sample, so an interrupted run loses at most the sample being
                               written (a torn last line is dropped on the next start);
  ``<dataset>/judged.jsonl``   per-sample judge verdicts (rewritten atomically each run, judge on only);
  ``results.json``, ``results.md``, ``judge_cache.sqlite``, ``eval_meta.json`` (generation settings).
Resume: a rerun skips every (dataset, sample id, run) already in samples.jsonl; only the judge and the
aggregation run again (the judge from its cache). A rerun whose generation settings differ from
eval_meta.json is refused (mixing samples of two setups would corrupt the numbers); a larger k is fine.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional, Protocol

from evaluation.datasets import DatasetSpec, EvalSample, load_dataset
from evaluation.metrics import accuracy, exact_match, extract_answer, math_equal, qa_f1
from evaluation.report import aggregate_dataset, format_markdown, write_json_atomic, write_jsonl_atomic, write_text_atomic
from megatron_arpo.data.fields import FieldKeys
from megatron_arpo.progress import Progress
from megatron_arpo.rewards import get_reward_fn
from megatron_arpo.rewards.text import as_gold_list
from megatron_arpo.rollout.group import RolloutGroup
from megatron_arpo.tools.registry import build_tools

logger = logging.getLogger(__name__)

__all__ = [
    "EngineSpec", "EvalError", "EvalSettings", "Generation", "LazyGenerator", "RolloutGenerator", "SampleStore",
    "eval_rollout_options", "open_rollout_generator", "run_evaluation", "score_response",
]

SAMPLES_FILE = "samples.jsonl"


class EvalError(ValueError):
    """An evaluation that cannot run as asked; the message names the problem and the fix."""


@dataclass
class EvalSettings:
    model: str
    datasets: list[DatasetSpec]
    data_dir: Optional[str]
    out_dir: Path
    k: int = 1
    temperature: float = 0.6
    top_p: float = 0.95
    max_samples: Optional[int] = None
    system_prompt: Optional[str] = None    # the text, for rows without their own system prompt
    max_in_flight: int = 32
    field_keys: FieldKeys = field(default_factory=FieldKeys)  # data.prompt_key / data.answer_key
    # Everything else that changes what is generated (response length, call limit, tools, seed, ...):
    # compared on resume.
    generation_meta: dict[str, Any] = field(default_factory=dict)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    def meta(self) -> dict[str, Any]:
        return {"model": str(self.model), "temperature": self.temperature, "top_p": self.top_p,
                "system_prompt": self.system_prompt, **self.generation_meta}


@dataclass
class Generation:
    trajectory: dict[str, Any]
    response_text: str
    finish_reason: Optional[str]
    num_response_tokens: int
    tool_calls: list[dict[str, Any]]


class Generator(Protocol):
    async def generate(self, sample: EvalSample, run: int, messages: list[dict[str, str]]) -> Generation: ...


# --------------------------------------------------------------------------------------- generation
class RolloutGenerator:
    """One question -> one trajectory through `megatron_arpo.rollout.RolloutScheduler` (n = 1, no branching).

    ``render(messages) -> token ids`` renders the chat prompt (the model's chat template); ``decode(ids)``
    turns response ids into the text that is scored (`TagProtocol.response_text`: the template's thinking
    prefix, then the response with special tokens dropped and tool tags kept), as in training.
    """

    def __init__(self, scheduler: Any, render: Callable[[list[dict[str, str]]], list[int]],
                 decode: Callable[[list[int]], str], options: Any):
        self.scheduler = scheduler
        self.render = render
        self.decode = decode
        self.options = options
        self.num_generations = 0

    async def generate(self, sample: EvalSample, run: int, messages: list[dict[str, str]]) -> Generation:
        # deferred: pulls in numpy, torch (heavy; this module imports without it)
        from megatron_arpo.rollout.scheduler import RolloutPrompt

        prompt = RolloutPrompt(prompt_id=sample.sample_id, token_ids=list(self.render(messages)))
        call_key = f"eval/{sample.dataset}/{sample.sample_id}/{run}"
        result = await self.scheduler.run([prompt], call_key=call_key, options=self.options)
        self.num_generations += 1
        (traj,) = result.groups[0]
        calls = [dataclasses.asdict(c) for c in traj.tool_calls]
        return Generation(trajectory=traj.to_dict(), response_text=self.decode(traj.response_ids),
                          finish_reason=traj.finish_reason, num_response_tokens=len(traj.response_ids),
                          tool_calls=calls)


@dataclass
class EngineSpec:
    """What `open_rollout_generator` needs to start the engine and tools."""

    model_dir: str
    chat: Any                         # megatron_arpo.data.chat.ChatFormat of the checkpoint
    rollout_section: Any              # megatron_arpo.config.RolloutSection
    tools_cfg: dict[str, Any]         # the plain `tools` section for megatron_arpo.tools.build_tools
    temperature: float
    top_p: float
    response_length: int
    call_limit: int
    seed: int = 0
    dtype: str = "auto"


class open_rollout_generator:
    """``async with open_rollout_generator(spec) as generator:`` one in-process `VllmEngine` in a
    `RolloutGroup`, the tools from `build_tools`, the tag protocol and a validation-mode scheduler.

    One engine: evaluation runs in the CLI process (rollout.num_engines > 1 is not used here).
    """

    def __init__(self, spec: EngineSpec):
        self.spec = spec
        self.engine: Any = None
        self.tools: Any = None
        self.generator: Optional[RolloutGenerator] = None

    async def __aenter__(self) -> RolloutGenerator:
        # deferred: pulls in torch (heavy; this module imports without it)
        from megatron_arpo.rollout.engine import EngineConfig, VllmEngine
        from megatron_arpo.rollout.scheduler import RolloutScheduler

        s = self.spec
        if getattr(s.rollout_section, "num_engines", 1) > 1:
            logger.info("evaluation uses one in-process engine; rollout.num_engines=%d is ignored",
                        s.rollout_section.num_engines)
        self.tools = build_tools(s.tools_cfg)
        protocol = s.chat.protocol(self.tools.tags)
        self.engine = VllmEngine(EngineConfig.from_rollout_section(s.model_dir, s.rollout_section, dtype=s.dtype))
        options = eval_rollout_options(s.rollout_section, temperature=s.temperature, top_p=s.top_p,
                                       response_length=s.response_length, call_limit=s.call_limit, seed=s.seed,
                                       max_model_len=self.engine.max_model_len)
        scheduler = RolloutScheduler(RolloutGroup([self.engine]), self.tools, protocol, options)
        self.generator = RolloutGenerator(scheduler, s.chat.render, protocol.response_text, options)
        return self.generator

    async def __aexit__(self, *exc: Any) -> None:
        if self.tools is not None:
            await self.tools.close()
        if self.engine is not None:
            await self.engine.shutdown()


class LazyGenerator:
    """Opens an async-context generator factory (e.g. `open_rollout_generator`) on the first request only,
    so a fully resumed evaluation never starts an engine. ``num_generations`` counts requests served."""

    def __init__(self, factory: Callable[[], Any]):
        self.factory = factory
        self.num_generations = 0
        self.started = False
        self._context: Any = None
        self._generator: Optional[Generator] = None
        self._lock: Optional[asyncio.Lock] = None

    async def generate(self, sample: EvalSample, run: int, messages: list[dict[str, str]]) -> Generation:
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:
            if self._generator is None:
                self._context = self.factory()
                self._generator = await self._context.__aenter__()
                self.started = True
        self.num_generations += 1
        return await self._generator.generate(sample, run, messages)

    async def close(self) -> None:
        if self._context is not None:
            context, self._context, self._generator = self._context, None, None
            await context.__aexit__(None, None, None)


def eval_rollout_options(rollout_section: Any, *, temperature: float, top_p: float, response_length: int,
                         call_limit: int, seed: int, max_model_len: Optional[int]) -> Any:
    """Validation-mode scheduler options: n = 1, no branching, greedy iff temperature == 0."""
    # deferred: pulls in numpy, torch (heavy; this module imports without it)
    from megatron_arpo.rollout.scheduler import RolloutOptions

    base = RolloutOptions.from_config(rollout_section) if rollout_section is not None else RolloutOptions()
    return dataclasses.replace(
        base, n=1, initial_rollouts=1, beam_size=1, dynamic_initial_rollouts=False, greedy=temperature == 0,
        temperature=temperature if temperature > 0 else 1.0, top_p=top_p, response_length=response_length,
        call_limit=call_limit, seed=seed, max_model_len=max_model_len)


# -------------------------------------------------------------------------------------------- scoring
def score_response(sample: EvalSample, response_text: str, reward_fn: Callable[..., float]) -> tuple[str, dict]:
    """(prediction, metrics) of one response; metrics are floats in [0, 1] (reward: the reward's range)."""
    prediction = extract_answer(response_text)
    golds = as_gold_list(sample.gold, split_list=sample.task == "qa")
    metrics = {
        "em": exact_match(prediction, sample.gold),
        "f1": qa_f1(prediction, sample.gold),
        "acc": accuracy(prediction, sample.gold),
        "math_equal": float(bool(prediction) and any(math_equal(prediction, g) for g in golds)),
        "reward": float(reward_fn(response_text, sample.gold, data_source=sample.dataset)),
    }
    return prediction, metrics


# ------------------------------------------------------------------------------------------ the store
class SampleStore:
    """Append-only JSONL of finished samples of one dataset (see module docstring)."""

    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    def load(self) -> dict[tuple[str, int], dict]:
        if not self.path.exists():
            return {}
        raw = self.path.read_bytes()
        keep = raw
        if raw and not raw.endswith(b"\n"):
            # A crash mid-write leaves a torn last line: drop it so the next append starts clean.
            keep = raw[: raw.rfind(b"\n") + 1]
            logger.warning("%s: dropping a torn last line (%d bytes) from an interrupted run", self.path,
                           len(raw) - len(keep))
            with open(self.path, "r+b") as fh:
                fh.truncate(len(keep))
                fh.flush()
                os.fsync(fh.fileno())
        out: dict[tuple[str, int], dict] = {}
        for line_no, line in enumerate(keep.decode("utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
                out[(str(rec["sample_id"]), int(rec["run"]))] = rec
            except (json.JSONDecodeError, KeyError, TypeError, ValueError) as exc:
                raise EvalError(f"{self.path}:{line_no}: not an evaluation record ({exc}); move the file away "
                                "to regenerate this dataset") from exc
        return out

    def append(self, record: dict) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with open(self.path, "a", encoding="utf-8") as fh:
            fh.write(line)
            fh.flush()
            os.fsync(fh.fileno())


def _check_meta(out_dir: Path, meta: dict[str, Any]) -> None:
    path = out_dir / "eval_meta.json"
    if path.exists():
        old = json.loads(path.read_text())
        diff = sorted(k for k in set(old) | set(meta) if old.get(k) != meta.get(k))
        if diff:
            details = "; ".join(f"{k}: {old.get(k)!r} -> {meta.get(k)!r}" for k in diff[:5])
            raise EvalError(f"{out_dir} holds samples generated with other settings ({details}); resuming would "
                            "mix two setups. Use another --out directory, or the original settings")
    else:
        write_json_atomic(path, meta)


# ------------------------------------------------------------------------------------------- the run
def build_messages(sample: EvalSample, system_prompt: Optional[str]) -> list[dict[str, str]]:
    """The chat prompt of ``sample``: the row's own prompt when it has one (ARPO parquet rows carry their
    system prompt), the configured ``system_prompt`` (text) for rows without a system message."""
    messages = list(sample.prompt) if sample.prompt else [{"role": "user", "content": sample.question}]
    if messages[0]["role"] != "system" and system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    return messages


async def _generate_dataset(spec: DatasetSpec, samples: list[EvalSample], settings: EvalSettings,
                            generator: Generator, store: SampleStore) -> dict[str, int]:
    reward_fn = get_reward_fn(spec.task_type.reward)
    done = store.load()
    todo = [(s, run) for run in range(settings.k) for s in samples if (s.sample_id, run) not in done]
    skipped = len(samples) * settings.k - len(todo)
    if skipped:
        logger.info("%s: %d of %d (sample, run) pairs already done; generating %d", spec.name, skipped,
                    len(samples) * settings.k, len(todo))
    semaphore = asyncio.Semaphore(settings.max_in_flight)
    report = Progress(f"eval {spec.name}", len(todo), unit="sample", rate_unit="tok")

    async def one(sample: EvalSample, run: int) -> None:
        async with semaphore:
            start = time.monotonic()
            gen = await generator.generate(sample, run, build_messages(sample, settings.system_prompt))
        prediction, metrics = score_response(sample, gen.response_text, reward_fn)
        by_tool: dict[str, int] = {}
        for call in gen.tool_calls:
            by_tool[call["tool"]] = by_tool.get(call["tool"], 0) + 1
        store.append({
            "dataset": spec.name, "sample_id": sample.sample_id, "run": run, "task": spec.task,
            "question": sample.question, "gold": sample.gold, "prediction": prediction, "metrics": metrics,
            "finish_reason": gen.finish_reason, "num_response_tokens": gen.num_response_tokens,
            "num_tool_calls": len(gen.tool_calls), "tool_calls_by_tool": by_tool,
            "response_text": gen.response_text, "tool_calls": gen.tool_calls,
            "latency_s": time.monotonic() - start, "trajectory": gen.trajectory,
        })
        report.update(1, float(gen.num_response_tokens))

    tasks = [asyncio.ensure_future(one(s, run)) for s, run in todo]
    try:
        await asyncio.gather(*tasks)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    finally:
        report.close()
    return {"generated": len(todo), "skipped": skipped}


async def _judge_records(records: list[dict], judge: Any) -> None:
    """Adds ``metrics.llm_equal`` and ``judge`` to each record (in memory) if the judge answers them all."""
    verdicts = await judge.judge_many([(r["question"], r["gold"], r["prediction"]) for r in records])
    if judge.unavailable_reason is not None:
        return
    for r, v in zip(records, verdicts):
        rule = float(r["metrics"][r["_correct_rule"]]) >= 1.0
        r["judge"] = None if v is None else {"correct": v.correct, "parsed": v.parsed, "cached": v.cached}
        r["metrics"]["llm_equal"] = float(rule or (v is not None and v.correct))


async def run_evaluation(settings: EvalSettings, generator: Generator, judge: Any = None) -> dict[str, Any]:
    """Generate what is missing, score, judge and aggregate; writes the outputs and returns results.json."""
    if settings.k < 1:
        raise EvalError(f"k={settings.k} must be >= 1")
    if settings.greedy and settings.k > 1:
        raise EvalError(f"k={settings.k} with temperature 0 (greedy) would repeat one sample {settings.k} times; "
                        "set a temperature > 0 for pass@k, or k=1")
    out_dir = Path(settings.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # Load every dataset first, so a missing file fails before any engine time is spent.
    loaded = [(spec, load_dataset(spec, settings.data_dir, settings.max_samples, settings.field_keys))
              for spec in settings.datasets]
    _check_meta(out_dir, settings.meta())

    counts: dict[str, dict[str, int]] = {}
    all_records: dict[str, list[dict]] = {}
    for spec, samples in loaded:
        store = SampleStore(out_dir / spec.name / SAMPLES_FILE)
        counts[spec.name] = await _generate_dataset(spec, samples, settings, generator, store)
        stored = store.load()
        keys = [(s.sample_id, run) for run in range(settings.k) for s in samples]
        records = [dict(stored[key], _correct_rule=spec.task_type.correct) for key in keys]
        all_records[spec.name] = records

    judge_info: dict[str, Any] = {"status": "disabled"}
    if judge is not None:
        flat = [r for recs in all_records.values() for r in recs]
        await _judge_records(flat, judge)
        judge_info = judge.status()
        if judge_info["status"] == "unavailable":
            judge_info["note"] = "the judge could not be reached; headline metrics fall back to rule metrics"
        else:
            for name, recs in all_records.items():
                write_jsonl_atomic(out_dir / name / "judged.jsonl", [
                    {"sample_id": r["sample_id"], "run": r["run"], "prediction": r["prediction"], "gold": r["gold"],
                     "llm_equal": r["metrics"]["llm_equal"], "judge": r.get("judge")} for r in recs])

    datasets: dict[str, Any] = {}
    for spec, _ in loaded:
        judged = judge_info["status"] == "ok"
        datasets[spec.name] = aggregate_dataset(
            all_records[spec.name], task=spec.task,
            correct_metric="llm_equal" if judged else spec.task_type.correct,
            headline="llm_equal" if judged else spec.task_type.headline, num_runs=settings.k)
        datasets[spec.name].update(counts[spec.name])
    results = {
        "model": str(settings.model),
        "k": settings.k,
        "settings": settings.meta(),
        "judge": judge_info,
        "datasets": datasets,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }
    write_json_atomic(out_dir / "results.json", results)
    write_text_atomic(out_dir / "results.md", format_markdown(results))
    return results
