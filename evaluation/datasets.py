"""Evaluation datasets: the registry of known benchmarks and loaders for the ARPO/Tool-Star JSONL layouts.

Every dataset is one file, ``<data-dir>/<name>/test.jsonl``, one JSON object per line (the layout of the
ARPO evaluation data, docs/design/arpo_reference.md §9). The fields differ between sources:

  - ``question`` / ``answer``: most sets (AIME24, HotpotQA, 2Wiki, MuSiQue, Bamboogle, WebWalker, ...);
  - ``Question`` with ``Final answer`` (or ``answer``): GAIA;
  - ``problem`` / ``answer``: AIME25 and MATH / MATH500;
  - GSM8K: ``question`` / ``answer``, where the answer is a worked solution ending in ``#### <number>``;
    the gold answer is that number with thousands separators removed (``#### 2,400`` -> ``2400``);
  - FlashRAG-style ``golden_answers`` (a list) is accepted wherever ``answer`` is.
A gold answer is a string or a list of strings (any counts). Numbers are turned into strings.

Each registered dataset has a task type (``math`` or ``qa``, `TASKS`), which fixes its reward function
(from `megatron_arpo.rewards`, the training scorer), its headline metric and the binary "correct" rule
used for pass@k; and a sample cap (the reference caps every set at its first 500 rows, ``COUNTS=500``).
A dataset not in the registry is named ``NAME:TASK`` (``mydata:qa``) and read from ``<data-dir>/NAME``.

Sample ids: the row's ``id`` / ``task_id`` / ``unique_id`` / ``idx`` when present (as a string), else the
0-based row number. Ids must be unique within a file: resuming an evaluation matches samples by id.
"""

from __future__ import annotations

import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

logger = logging.getLogger(__name__)

__all__ = [
    "DATASETS", "DEFAULT_SAMPLE_CAP", "DatasetError", "DatasetSpec", "EvalSample", "TASKS", "TaskType",
    "dataset_path", "load_dataset", "parse_dataset_names", "resolve_dataset",
]

# The reference evaluates at most the first 500 rows of every set (COUNTS=500 in its scripts).
DEFAULT_SAMPLE_CAP = 500

QUESTION_KEYS = ("question", "Question", "problem")
ANSWER_KEYS = ("answer", "Final answer", "final_answer", "golden_answers")
ID_KEYS = ("id", "task_id", "unique_id", "idx", "qid")
_GSM8K_MARK = "####"


class DatasetError(ValueError):
    """A dataset that cannot be evaluated; the message names the dataset, file, row and the fix."""


@dataclass(frozen=True)
class TaskType:
    """How answers of one kind of task are scored.

    ``reward``: the `megatron_arpo.rewards` scorer (the RL reward) reported per sample as ``reward``.
    ``headline``: the metric shown first when no LLM judge ran. ``correct``: the per-sample 0/1 metric
    that pass@k counts when no judge ran.
    """

    name: str
    reward: str
    headline: str
    correct: str


TASKS: dict[str, TaskType] = {
    "math": TaskType("math", reward="math", headline="math_equal", correct="math_equal"),
    "qa": TaskType("qa", reward="qa_f1", headline="f1", correct="em"),
}


@dataclass(frozen=True)
class DatasetSpec:
    name: str
    task: str
    max_samples: Optional[int] = DEFAULT_SAMPLE_CAP
    gsm8k_answers: bool = False          # answers are worked solutions ending in "#### <number>"
    description: str = ""

    @property
    def task_type(self) -> TaskType:
        return TASKS[self.task]


def _spec(name: str, task: str, description: str, **kwargs: Any) -> tuple[str, DatasetSpec]:
    return name, DatasetSpec(name=name, task=task, description=description, **kwargs)


DATASETS: dict[str, DatasetSpec] = dict([
    _spec("aime24", "math", "AIME 2024 (30)"),
    _spec("aime25", "math", "AIME 2025 (30), `problem` field"),
    _spec("math500", "math", "MATH-500, `problem` field"),
    _spec("math", "math", "MATH test, `problem` field"),
    _spec("gsm8k", "math", "GSM8K test; gold = the number after ####", gsm8k_answers=True),
    _spec("hotpotqa", "qa", "HotpotQA dev"),
    _spec("2wiki", "qa", "2WikiMultihopQA dev"),
    _spec("musique", "qa", "MuSiQue dev"),
    _spec("bamboogle", "qa", "Bamboogle (125)"),
    _spec("nq", "qa", "Natural Questions"),
    _spec("triviaqa", "qa", "TriviaQA"),
    _spec("popqa", "qa", "PopQA"),
    _spec("gaia", "qa", "GAIA text-only (103), `Question` / `Final answer`"),
    _spec("hle", "qa", "Humanity's Last Exam subset"),
    _spec("webwalker", "qa", "WebWalkerQA"),
    _spec("simpleqa", "qa", "SimpleQA"),
    _spec("xbench", "qa", "xbench-DeepSearch (Chinese)"),
])


@dataclass(frozen=True)
class EvalSample:
    dataset: str
    sample_id: str
    question: str
    gold: str | list[str]
    task: str
    extra: dict[str, Any] = field(default_factory=dict)


# ------------------------------------------------------------------------------------ name resolution
def _known_names() -> str:
    return ", ".join(sorted(DATASETS))


def resolve_dataset(name: str) -> DatasetSpec:
    """The spec for a registered name (case-insensitive) or a ``NAME:TASK`` custom dataset."""
    raw = name.strip()
    if not raw:
        raise DatasetError(f"empty dataset name; known datasets: {_known_names()}")
    if ":" in raw:
        base, _, task = raw.partition(":")
        if task not in TASKS:
            raise DatasetError(f"dataset {raw!r}: task {task!r} is not a task type; use one of {sorted(TASKS)}, "
                               f"e.g. {base}:qa")
        if not re.fullmatch(r"[\w.-]+", base):
            raise DatasetError(f"dataset {raw!r}: {base!r} is not a directory name (letters, digits, _ . -)")
        known = DATASETS.get(base.lower())
        if known is not None:
            return DatasetSpec(name=base, task=task, max_samples=known.max_samples,
                               gsm8k_answers=known.gsm8k_answers, description=known.description)
        return DatasetSpec(name=base, task=task, description="custom")
    spec = DATASETS.get(raw.lower())
    if spec is None:
        import difflib

        close = difflib.get_close_matches(raw.lower(), list(DATASETS), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        raise DatasetError(f"unknown dataset {raw!r}{hint}; known datasets: {_known_names()}. For another "
                           f"dataset give its task type: {raw}:qa or {raw}:math")
    return spec


def parse_dataset_names(value: str | list[str]) -> list[DatasetSpec]:
    """``"aime24,gsm8k"`` or a list of names -> specs, in order, duplicates rejected."""
    names = value.split(",") if isinstance(value, str) else list(value)
    names = [n.strip() for n in names if n and n.strip()]
    if not names:
        raise DatasetError(f"no datasets given; pass --datasets with a comma-separated list from: {_known_names()}")
    specs = [resolve_dataset(n) for n in names]
    seen: set[str] = set()
    for spec in specs:
        if spec.name in seen:
            raise DatasetError(f"dataset {spec.name!r} is listed twice in {names}")
        seen.add(spec.name)
    return specs


def dataset_path(data_dir: str | Path, spec: DatasetSpec) -> Path:
    """``<data-dir>/<name>/test.jsonl``; a directory differing only in case (``SimpleQA``) also counts."""
    root = Path(data_dir)
    path = root / spec.name / "test.jsonl"
    if path.exists() or not root.is_dir():
        return path
    for child in root.iterdir():
        if child.is_dir() and child.name.lower() == spec.name.lower() and (child / "test.jsonl").exists():
            return child / "test.jsonl"
    return path


# ------------------------------------------------------------------------------------------- loading
def gsm8k_gold(answer: str) -> str:
    """The number after the last ``####`` of a GSM8K solution, thousands separators removed."""
    if _GSM8K_MARK not in answer:
        raise ValueError(f"no '####' in the GSM8K answer {answer[-80:]!r}")
    return answer.rsplit(_GSM8K_MARK, 1)[1].strip().replace(",", "")


def _gold_value(value: Any) -> str | list[str] | None:
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, list):
        items = [_gold_value(v) for v in value]
        if not items or any(not isinstance(v, str) for v in items):
            return None
        return items
    return None


def _first(row: dict, keys: tuple[str, ...]) -> tuple[Optional[str], Any]:
    for key in keys:
        if key in row and row[key] is not None:
            return key, row[key]
    return None, None


def _parse_row(row: Any, spec: DatasetSpec, where: str, index: int) -> EvalSample:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    qkey, question = _first(row, QUESTION_KEYS)
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(f"{where}: no question; expected a non-empty string in one of the fields "
                           f"{list(QUESTION_KEYS)}, found fields {sorted(row)}")
    akey, answer = _first(row, ANSWER_KEYS)
    if akey is None:
        raise DatasetError(f"{where}: no gold answer; expected one of the fields {list(ANSWER_KEYS)}, "
                           f"found fields {sorted(row)}")
    if spec.gsm8k_answers and isinstance(answer, str):
        try:
            answer = gsm8k_gold(answer)
        except ValueError as exc:
            raise DatasetError(f"{where}: {exc}; GSM8K answers end with '#### <number>'") from None
    gold = _gold_value(answer)
    if gold is None:
        raise DatasetError(f"{where}: field {akey!r} must be a non-empty string, number or list of them, "
                           f"got {answer!r:.80}")
    _, sample_id = _first(row, ID_KEYS)
    extra = {k: v for k, v in row.items() if k not in (qkey, akey)}
    return EvalSample(dataset=spec.name, sample_id=str(sample_id if sample_id is not None else index),
                      question=question, gold=gold, task=spec.task, extra=extra)


def load_dataset(spec: DatasetSpec | str, data_dir: str | Path, max_samples: Optional[int] = None) -> list[EvalSample]:
    """The first ``max_samples`` (default: the spec's cap) samples of ``<data_dir>/<name>/test.jsonl``."""
    if isinstance(spec, str):
        spec = resolve_dataset(spec)
    path = dataset_path(data_dir, spec)
    if not path.exists():
        hint = "" if Path(data_dir).is_dir() else f" (the data dir {str(data_dir)!r} does not exist)"
        raise DatasetError(f"dataset {spec.name!r}: file {str(path)!r} not found{hint}; each dataset is "
                           f"<data-dir>/<name>/test.jsonl — pass --data-dir pointing at the directory that "
                           f"holds {spec.name}/test.jsonl")
    cap = spec.max_samples if max_samples is None else max_samples
    if cap is not None and cap < 1:
        raise DatasetError(f"dataset {spec.name!r}: max_samples={cap} must be >= 1 (or null for the default cap)")
    samples: list[EvalSample] = []
    seen: dict[str, int] = {}
    with open(path, encoding="utf-8") as fh:
        for line_no, line in enumerate(fh, start=1):
            if cap is not None and len(samples) >= cap:
                break
            if not line.strip():
                continue
            where = f"{path} line {line_no}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise DatasetError(f"{where}: invalid JSON ({exc.msg} at column {exc.colno})") from None
            except RecursionError:
                raise DatasetError(f"{where}: JSON nested too deeply (deeper than Python's recursion limit); "
                                   f"flatten the row") from None
            sample = _parse_row(row, spec, where, index=len(samples))
            if sample.sample_id in seen:
                raise DatasetError(f"{where}: sample id {sample.sample_id!r} repeats line {seen[sample.sample_id]}; "
                                   "ids must be unique (resume matches samples by id)")
            seen[sample.sample_id] = line_no
            samples.append(sample)
    if not samples:
        raise DatasetError(f"dataset {spec.name!r}: {path} has no rows")
    logger.info("dataset %s: %d samples from %s (task %s)", spec.name, len(samples), path, spec.task)
    return samples
