"""Prompt datasets for RL: the ARPO RL parquet layout and plain question/answer JSONL.

ARPO parquet rows (docs/design/arpo_reference.md §7) carry ``prompt`` (chat messages, system + user),
``reward_model.ground_truth``, ``data_source``, ``ability`` and ``extra_info``. Every shipped row has its
``\\boxed`` corrupted into a backspace (0x08) followed by ``oxed`` (a non-raw Python string, Q13); we
repair it on load so training and evaluation see the same prompt.

JSONL rows are ``{"question": ..., "answer": ...}`` (optionally ``data_source``, ``ability``, ``id``);
the configured system prompt is prepended.

A malformed row raises ``DatasetError`` naming the file and the 1-based row number, or, with
``on_bad_row="skip"``, is skipped and counted in ``LoadStats``. Malformed includes a JSONL line that is not
UTF-8 and, with ``strict_answers`` (the built-in rewards), an answer that is not a non-empty string or a
non-empty list of strings (``[]``, ``{}``, ``42``): the rewards would only fail on it after a rollout.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from megatron_arpo.errors import InputError

logger = logging.getLogger(__name__)

BACKSPACE_BOXED = "\x08oxed"

# Our own wording of the tool-use instruction (same tag protocol as ARPO's system prompt, §1).
DEFAULT_SYSTEM_PROMPT = (
    "You are a helpful assistant that solves the user's question step by step. You may use two tools "
    "while you think: a search engine and a python interpreter. Put your reasoning inside <think> "
    "</think>. To search, write a query inside <search> </search>; to run code, write python inside "
    "<python> </python>. The tool output is returned to you inside <result> </result>. When you are "
    "done, give the final answer inside <answer> </answer>, with the exact answer written as "
    "\\boxed{answer}."
)


class DatasetError(InputError):
    """A dataset file or row that cannot be used; the message names the file, row and fix."""


@dataclass(frozen=True)
class PromptRecord:
    uid: str
    messages: tuple[dict[str, str], ...]
    ground_truth: Any
    data_source: str
    ability: str | None = None
    extra_info: dict[str, Any] = field(default_factory=dict)

    @property
    def question(self) -> str:
        return next((m["content"] for m in reversed(self.messages) if m["role"] == "user"), "")


@dataclass
class LoadStats:
    path: str
    rows: int = 0
    loaded: int = 0
    skipped_bad: int = 0
    repaired_boxed: int = 0
    errors: list[str] = field(default_factory=list)


def repair_boxed(text: str) -> tuple[str, bool]:
    """Undo the reference's ``"\\boxed"`` -> backspace + ``oxed`` corruption (Q13)."""
    if BACKSPACE_BOXED in text:
        return text.replace(BACKSPACE_BOXED, "\\boxed"), True
    return text, False


def _as_messages(value: Any, where: str) -> list[dict[str, str]]:
    if hasattr(value, "tolist"):
        value = value.tolist()
    if not isinstance(value, (list, tuple)) or not value:
        raise DatasetError(f"{where}: 'prompt' must be a non-empty list of chat messages, got {value!r:.80}")
    messages = []
    for msg in value:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(
            msg.get("content"), str
        ):
            raise DatasetError(f"{where}: each prompt message needs string 'role' and 'content', got {msg!r:.80}")
        if msg["role"] not in ("system", "user", "assistant"):
            raise DatasetError(f"{where}: message role {msg['role']!r} is not one of system/user/assistant")
        messages.append({"role": msg["role"], "content": msg["content"]})
    if messages[-1]["role"] != "user":
        raise DatasetError(f"{where}: the last prompt message must be the user's question")
    return messages


def check_answer(value: Any, where: str, key: str) -> None:
    """The built-in rewards take a non-empty string or a non-empty list of non-empty strings."""
    if isinstance(value, str):
        if value.strip():
            return
    elif isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v.strip() for v in value):
        return
    shown = json.dumps(value, default=str)
    raise DatasetError(f"{where}: {key!r} is {shown[:60]} ({type(value).__name__}); the rewards need a non-empty "
                       f"string or a non-empty list of strings (write a number as a string, e.g. \"42\")")


def _parquet_row(row: dict[str, Any], where: str, index: int, stats: LoadStats,
                 strict_answers: bool = True) -> PromptRecord:
    messages = _as_messages(row.get("prompt"), where)
    for msg in messages:
        msg["content"], fixed = repair_boxed(msg["content"])
        stats.repaired_boxed += int(fixed)
    reward_model = row.get("reward_model")
    if not isinstance(reward_model, dict) or "ground_truth" not in reward_model:
        raise DatasetError(f"{where}: 'reward_model' must be a mapping with a 'ground_truth' key")
    truth = reward_model["ground_truth"]
    if hasattr(truth, "tolist"):
        truth = truth.tolist()
    if truth is None or (isinstance(truth, str) and not truth.strip()):
        raise DatasetError(f"{where}: reward_model.ground_truth is empty")
    if strict_answers:
        check_answer(truth, where, "reward_model.ground_truth")
    data_source = row.get("data_source")
    if not isinstance(data_source, str) or not data_source:
        raise DatasetError(f"{where}: 'data_source' must be a non-empty string")
    extra = row.get("extra_info") or {}
    if not isinstance(extra, dict):
        raise DatasetError(f"{where}: 'extra_info' must be a mapping, got {type(extra).__name__}")
    uid = str(extra.get("index", index))
    return PromptRecord(uid=f"{data_source}-{uid}", messages=tuple(messages), ground_truth=truth,
                        data_source=data_source, ability=row.get("ability"), extra_info=dict(extra))


def _jsonl_row(row: Any, where: str, index: int, system_prompt: str | None, default_source: str,
               strict_answers: bool = True) -> PromptRecord:
    if not isinstance(row, dict):
        raise DatasetError(f"{where}: expected a JSON object, got {type(row).__name__}")
    question = row.get("question")
    if not isinstance(question, str) or not question.strip():
        raise DatasetError(f"{where}: 'question' must be a non-empty string")
    if "answer" not in row or row["answer"] is None or row["answer"] == "":
        raise DatasetError(f"{where}: 'answer' is missing or empty")
    if strict_answers:
        check_answer(row["answer"], where, "answer")
    messages = ([{"role": "system", "content": system_prompt}] if system_prompt else []) + [
        {"role": "user", "content": question}
    ]
    source = row.get("data_source", default_source)
    return PromptRecord(uid=f"{source}-{row.get('id', index)}", messages=tuple(messages),
                        ground_truth=row["answer"], data_source=str(source), ability=row.get("ability"),
                        extra_info={k: v for k, v in row.items() if k not in ("question", "answer")})


def _detect_format(path: Path, fmt: str) -> str:
    if fmt != "auto":
        if fmt not in ("parquet", "jsonl"):
            raise DatasetError(f"data format {fmt!r} is not supported; use auto, parquet or jsonl")
        return fmt
    if path.suffix == ".parquet":
        return "parquet"
    if path.suffix in (".jsonl", ".json"):
        return "jsonl"
    raise DatasetError(f"{path}: cannot tell the format from the extension; set data.format to parquet or jsonl")


def _iter_rows(path: Path, fmt: str) -> Iterable[tuple[int, Any, str | None]]:
    """Yield (1-based row number, row or None, parse error or None)."""
    if fmt == "parquet":
        import pyarrow.parquet as pq

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise DatasetError(f"{path}: not a readable parquet file ({exc})") from exc
        for i, row in enumerate(table.to_pylist(), start=1):
            yield i, row, None
        return
    with open(path, "rb") as fh:  # decoded per line, so one bad line names its row and can be skipped
        for i, raw in enumerate(fh, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as exc:
                yield i, None, f"not UTF-8 text (byte 0x{raw[exc.start]:02x} at column {exc.start + 1})"
                continue
            if not line.strip():
                continue
            try:
                yield i, json.loads(line), None
            except json.JSONDecodeError as exc:
                yield i, None, f"invalid JSON ({exc.msg} at column {exc.colno})"
            except RecursionError:
                yield i, None, f"JSON nested too deeply (deeper than Python's recursion limit of " \
                               f"{sys.getrecursionlimit()}); flatten the row"


def load_prompts(
    path: str | os.PathLike,
    fmt: str = "auto",
    on_bad_row: str = "error",
    system_prompt: str | None = DEFAULT_SYSTEM_PROMPT,
    strict_answers: bool = True,
) -> tuple[list[PromptRecord], LoadStats]:
    """Load one dataset file into PromptRecords (``strict_answers``: see the module docstring)."""
    if on_bad_row not in ("error", "skip"):
        raise DatasetError(f"on_bad_row {on_bad_row!r} is not supported; use error or skip")
    path = Path(path)
    if not path.exists():
        if path.is_symlink():
            raise DatasetError(f"dataset file {path} is a broken symlink or a symlink loop; point it at the file")
        raise DatasetError(f"dataset file {path} does not exist; check data.train_files / data.val_files")
    if path.is_dir():
        raise DatasetError(f"dataset file {path} is a directory; list the parquet/JSONL files inside it")
    fmt = _detect_format(path, fmt)
    stats = LoadStats(path=str(path))
    records: list[PromptRecord] = []
    for number, row, parse_error in _iter_rows(path, fmt):
        stats.rows += 1
        where = f"{path} row {number}"
        try:
            if parse_error:
                raise DatasetError(f"{where}: {parse_error}")
            if fmt == "parquet":
                record = _parquet_row(row, where, number - 1, stats, strict_answers)
            else:
                record = _jsonl_row(row, where, number - 1, system_prompt, default_source=path.stem,
                                    strict_answers=strict_answers)
        except RecursionError:  # a deep value that parsed, met by a recursive check of the row
            exc = DatasetError(f"{where}: JSON nested too deeply; flatten the row")
            if on_bad_row == "error":
                raise DatasetError(f"{exc}. Fix the row, or set data.on_bad_row: skip to skip bad rows") from None
            stats.skipped_bad += 1
            stats.errors.append(str(exc))
            continue
        except DatasetError as exc:
            if on_bad_row == "error":
                raise DatasetError(f"{exc}. Fix the row, or set data.on_bad_row: skip to skip bad rows") from None
            stats.skipped_bad += 1
            stats.errors.append(str(exc))
            continue
        records.append(record)
    stats.loaded = len(records)
    if stats.skipped_bad:
        logger.warning("%s: skipped %d malformed row(s) of %d; first: %s", path, stats.skipped_bad, stats.rows,
                       stats.errors[0])
    if stats.repaired_boxed:
        logger.info("%s: repaired the backspace-corrupted \\boxed in %d message(s)", path, stats.repaired_boxed)
    if not records:
        raise DatasetError(f"{path}: no usable rows ({stats.rows} rows, {stats.skipped_bad} malformed)")
    return records, stats


def load_prompt_files(paths: Sequence[str | os.PathLike], **kwargs: Any) -> tuple[list[PromptRecord], list[LoadStats]]:
    records: list[PromptRecord] = []
    all_stats = []
    for path in paths:
        recs, stats = load_prompts(path, **kwargs)
        records.extend(recs)
        all_stats.append(stats)
    uids = [r.uid for r in records]
    if len(set(uids)) != len(uids):
        # Duplicate ids would merge GRPO groups; make them unique by position instead.
        records = [PromptRecord(uid=f"{r.uid}#{i}", messages=r.messages, ground_truth=r.ground_truth,
                                data_source=r.data_source, ability=r.ability, extra_info=r.extra_info)
                   for i, r in enumerate(records)]
    return records, all_stats


def render_prompt(chat: Any, record: PromptRecord) -> list[int]:
    """Prompt token ids: the checkpoint's chat template with the assistant turn opened
    (``chat``: a `megatron_arpo.data.chat.ChatFormat`)."""
    return chat.render(record.messages)


def filter_by_length(
    records: Sequence[PromptRecord], token_ids: Sequence[Sequence[int]], max_prompt_tokens: int
) -> tuple[list[int], int]:
    """Indices of prompts within ``max_prompt_tokens``; logs how many were dropped."""
    keep = [i for i, ids in enumerate(token_ids) if len(ids) <= max_prompt_tokens]
    dropped = len(records) - len(keep)
    if dropped:
        longest = max(len(ids) for ids in token_ids)
        logger.warning("dropped %d of %d prompts longer than data.max_prompt_tokens=%d (longest: %d tokens)",
                       dropped, len(records), max_prompt_tokens, longest)
    if not keep:
        raise DatasetError(
            f"every prompt is longer than data.max_prompt_tokens={max_prompt_tokens}; raise the limit"
        )
    return keep, dropped
