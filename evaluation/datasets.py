"""Evaluation datasets: the registry of known benchmarks and loaders for the ARPO/Tool-Star layouts.

A registered dataset is one file, ``<data-dir>/<name>/test.jsonl``, one JSON object per line (the layout
of the ARPO evaluation data, docs/design/arpo_reference.md §9). A dataset can also be a file path
(``PATH[:TASK]``, parquet, JSONL or JSON): ARPO's ``gaia_test.parquet`` / ``hle_test.parquet`` rows carry
their prompt (system + user) and ``reward_model.ground_truth``, as the RL validation files do. Rows are
read by `megatron_arpo.data.fields` (the RL and SFT loaders' resolver); a row's own system prompt is
kept and the configured one is used for rows without one. The fields differ between sources:

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
A file path takes its task from ``:TASK`` or, without it, from the registered name its file name starts
with (``gaia_test.parquet`` -> gaia, qa).

Sample ids: the row's ``id`` / ``task_id`` / ``unique_id`` / ``idx`` when present (as a string), else the
0-based row number. Ids must be unique within a file: resuming an evaluation matches samples by id.
"""

from __future__ import annotations

import difflib
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from megatron_arpo.data.datasets import repair_boxed
from megatron_arpo.data.fields import (
    ANSWER_KEYS,
    FieldKeys,
    RowError,
    detect_format,
    gold_value,
    iter_file_rows,
    resolve_prompt_row,
)

logger = logging.getLogger(__name__)

__all__ = [
    "DATASETS", "DEFAULT_SAMPLE_CAP", "DatasetError", "DatasetSpec", "EvalSample", "TASKS", "TaskType",
    "dataset_path", "load_dataset", "parse_dataset_names", "resolve_dataset",
]

# The reference evaluates at most the first 500 rows of every set (COUNTS=500 in its scripts).
DEFAULT_SAMPLE_CAP = 500

_GSM8K_MARK = "####"
_FILE_SUFFIXES = (".parquet", ".jsonl", ".json")


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
    path: Optional[str] = None           # a dataset given as a file path (read instead of <data-dir>/<name>)

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
    # The row's own prompt (chat messages ending with the question) when it carries a system prompt.
    prompt: Optional[tuple[dict[str, str], ...]] = None


# ------------------------------------------------------------------------------------ name resolution
def _known_names() -> str:
    return ", ".join(sorted(DATASETS))


def _file_spec(raw: str) -> Optional[DatasetSpec]:
    """A ``PATH[:TASK]`` dataset (a file that exists, or a name ending in .parquet/.jsonl/.json); else None."""
    path, task = raw, None
    head, sep, tail = raw.rpartition(":")
    if sep and tail in TASKS:
        path, task = head, tail
    if not (Path(path).is_file() or path.endswith(_FILE_SUFFIXES)):
        return None
    stem = Path(path).stem
    if not Path(path).is_file():
        raise DatasetError(f"dataset file {path!r} not found; give an existing parquet/JSONL/JSON file, or a dataset "
                           f"name ({_known_names()}) with --data-dir")
    known = next((DATASETS[n] for n in sorted(DATASETS, key=len, reverse=True)
                  if re.match(rf"{re.escape(n)}(\b|_|-|$)", stem.lower())), None)
    if task is None:
        if known is None:
            raise DatasetError(f"dataset file {path!r}: cannot tell its task from the name; write {path}:qa or "
                               f"{path}:math")
        task = known.task
    return DatasetSpec(name=stem, task=task, description=f"file {path}", path=str(path),
                       gsm8k_answers=bool(known and known.gsm8k_answers))


def resolve_dataset(name: str) -> DatasetSpec:
    """The spec for a registered name (case-insensitive), a ``NAME:TASK`` custom dataset or a ``PATH[:TASK]``
    file."""
    raw = name.strip()
    if not raw:
        raise DatasetError(f"empty dataset name; known datasets: {_known_names()}")
    file_spec = _file_spec(raw)
    if file_spec is not None:
        return file_spec
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


def _parse_row(row: Any, spec: DatasetSpec, where: str, index: int, keys: FieldKeys) -> EvalSample:
    try:
        resolved = resolve_prompt_row(row, where, keys)
    except RowError as exc:
        raise DatasetError(str(exc)) from None
    akey, answer = resolved.answer_key, resolved.answer
    if akey is None:
        raise DatasetError(f"{where}: no gold answer; expected reward_model.ground_truth or one of the fields "
                           f"{list(ANSWER_KEYS)}, found fields {sorted(row)}; name another with data.answer_key")
    if spec.gsm8k_answers and isinstance(answer, str):
        try:
            answer = gsm8k_gold(answer)
        except ValueError as exc:
            raise DatasetError(f"{where}: {exc}; GSM8K answers end with '#### <number>'") from None
    gold = gold_value(answer)
    if gold is None:
        raise DatasetError(f"{where}: field {akey!r} must be a non-empty string, number or list of them, "
                           f"got {answer!r:.80}")
    messages = tuple({"role": m["role"], "content": repair_boxed(m["content"])[0]} for m in resolved.messages)
    return EvalSample(dataset=spec.name, sample_id=resolved.row_id if resolved.row_id is not None else str(index),
                      question=messages[-1]["content"], gold=gold, task=spec.task, extra=resolved.extra,
                      prompt=messages if resolved.own_system or len(messages) > 1 else None)


def load_dataset(spec: DatasetSpec | str, data_dir: str | Path | None, max_samples: Optional[int] = None,
                 keys: FieldKeys = FieldKeys()) -> list[EvalSample]:
    """The first ``max_samples`` (default: the spec's cap) samples of the spec's file, or of
    ``<data_dir>/<name>/test.jsonl``. ``keys``: ``data.prompt_key`` / ``data.answer_key``."""
    if isinstance(spec, str):
        spec = resolve_dataset(spec)
    if spec.path is not None:
        path = Path(spec.path)
    elif data_dir is None:
        raise DatasetError(f"dataset {spec.name!r}: no data directory; pass --data-dir DIR holding "
                           f"{spec.name}/test.jsonl, or give the dataset as a file path")
    else:
        path = dataset_path(data_dir, spec)
    if not path.exists():
        hint = "" if spec.path or Path(data_dir).is_dir() else f" (the data dir {str(data_dir)!r} does not exist)"
        raise DatasetError(f"dataset {spec.name!r}: file {str(path)!r} not found{hint}; each dataset is "
                           f"<data-dir>/<name>/test.jsonl — pass --data-dir pointing at the directory that "
                           f"holds {spec.name}/test.jsonl, or give the file's path in --datasets")
    cap = spec.max_samples if max_samples is None else max_samples
    if cap is not None and cap < 1:
        raise DatasetError(f"dataset {spec.name!r}: max_samples={cap} must be >= 1 (or null for the default cap)")
    samples: list[EvalSample] = []
    seen: dict[str, int] = {}
    try:
        fmt = detect_format(path, "auto", setting=None)
        unit = "line" if fmt == "jsonl" else "row"
        for number, row, problem in iter_file_rows(path, fmt):
            if cap is not None and len(samples) >= cap:
                break
            where = f"{path} {unit} {number}"
            if problem:
                raise DatasetError(f"{where}: {problem}")
            sample = _parse_row(row, spec, where, len(samples), keys)
            if sample.sample_id in seen:
                raise DatasetError(f"{where}: sample id {sample.sample_id!r} repeats {unit} {seen[sample.sample_id]}; "
                                   "ids must be unique (resume matches samples by id)")
            seen[sample.sample_id] = number
            samples.append(sample)
    except RowError as exc:
        raise DatasetError(str(exc)) from None
    if not samples:
        raise DatasetError(f"dataset {spec.name!r}: {path} has no rows")
    logger.info("dataset %s: %d samples from %s (task %s)", spec.name, len(samples), path, spec.task)
    return samples
