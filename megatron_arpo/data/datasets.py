"""Prompt datasets for RL: ARPO's parquet rows, question/answer and alpaca rows (JSONL, JSON or parquet).

Rows are read by `megatron_arpo.data.fields` (the resolver evaluation and SFT use too): ARPO parquet rows
carry ``prompt`` (chat messages, system + user), ``reward_model.ground_truth``, ``data_source``,
``ability`` and ``extra_info``; other rows a question and an answer under the names fields.py accepts, or
under ``data.prompt_key`` / ``data.answer_key``. A row's own system prompt is kept; rows without one get
the configured prompt (``data.system_prompt``: a built-in name of `megatron_arpo.data.system_prompts` or
the text). Every shipped ARPO row has its ``\\boxed`` corrupted into a backspace (0x08) followed by
``oxed`` (a non-raw Python string, Q13); we repair it on load so training and evaluation see the same prompt.

A malformed row raises ``DatasetError`` naming the file and the 1-based row number, or, with
``on_bad_row="skip"``, is skipped and counted in ``LoadStats``. Malformed includes a JSONL line that is not
UTF-8 and, with ``strict_answers`` (the built-in rewards), an answer that is not a non-empty string or a
non-empty list of strings (``[]``, ``{}``); numbers are written as strings.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Sequence

from megatron_arpo.data.fields import FieldKeys, RowError, detect_format, gold_value, iter_file_rows, resolve_prompt_row
from megatron_arpo.data.system_prompts import DEFAULT_SYSTEM_PROMPT, resolve_system_prompt
from megatron_arpo.errors import InputError

logger = logging.getLogger(__name__)

__all__ = ["DEFAULT_SYSTEM_PROMPT", "DatasetError", "LoadStats", "PromptRecord", "check_answer", "filter_by_length",
           "load_prompt_files", "load_prompts", "render_prompt", "repair_boxed"]

BACKSPACE_BOXED = "\x08oxed"


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


def check_answer(value: Any, where: str, key: str) -> None:
    """The built-in rewards take a non-empty string or a non-empty list of non-empty strings (numbers are
    written as strings, `fields.gold_value`)."""
    gold = gold_value(value)
    if isinstance(gold, str) or (isinstance(gold, list) and all(v.strip() for v in gold)):
        return
    shown = json.dumps(value, default=str)
    raise DatasetError(f"{where}: {key!r} is {shown[:60]} ({type(value).__name__}); the rewards need a non-empty "
                       f"string, number or a non-empty list of them")


def _record(row: Any, where: str, index: int, stats: LoadStats, system_prompt: Optional[str], default_source: str,
            keys: FieldKeys, strict_answers: bool) -> PromptRecord:
    try:
        resolved = resolve_prompt_row(row, where, keys)
    except RowError as exc:
        raise DatasetError(str(exc)) from None
    messages = [dict(m) for m in resolved.messages]
    if not resolved.own_system and system_prompt:
        messages.insert(0, {"role": "system", "content": system_prompt})
    for msg in messages:
        msg["content"], fixed = repair_boxed(msg["content"])
        stats.repaired_boxed += int(fixed)
    truth = resolved.answer
    if resolved.answer_key is not None and (truth is None or (isinstance(truth, str) and not truth.strip())):
        raise DatasetError(f"{where}: {resolved.answer_key} is empty")
    if resolved.answer_key is None:
        raise DatasetError(f"{where}: no gold answer; expected reward_model.ground_truth or one of the fields "
                           f"answer, Final answer, final_answer, golden_answers, ground_truth (alpaca: output), found "
                           f"fields {sorted(row)}; name another with data.answer_key")
    if strict_answers:
        check_answer(truth, where, resolved.answer_key)
        truth = gold_value(truth)
    source = row.get("data_source")
    source = source if isinstance(source, str) and source else default_source
    extra = row.get("extra_info")
    if extra is not None and not isinstance(extra, dict):
        raise DatasetError(f"{where}: 'extra_info' must be a mapping, got {type(extra).__name__}")
    if extra is None:
        extra = {k: v for k, v in resolved.extra.items() if k not in ("data_source", "ability")}
    uid = resolved.row_id if resolved.row_id is not None else str(index)
    return PromptRecord(uid=f"{source}-{uid}", messages=tuple(messages), ground_truth=truth, data_source=source,
                        ability=row.get("ability"), extra_info=dict(extra))


def load_prompts(
    path: str | os.PathLike,
    fmt: str = "auto",
    on_bad_row: str = "error",
    system_prompt: Optional[str] = DEFAULT_SYSTEM_PROMPT,
    strict_answers: bool = True,
    prompt_key: Optional[str] = None,
    answer_key: Optional[str] = None,
) -> tuple[list[PromptRecord], LoadStats]:
    """Load one dataset file into PromptRecords. ``system_prompt``: a built-in name or the text, for rows
    without their own; ``prompt_key`` / ``answer_key``: ``data.prompt_key`` / ``data.answer_key``
    (``strict_answers``: see the module docstring)."""
    if on_bad_row not in ("error", "skip"):
        raise DatasetError(f"on_bad_row {on_bad_row!r} is not supported; use error or skip")
    path = Path(path)
    if not path.exists():
        if path.is_symlink():
            raise DatasetError(f"dataset file {path} is a broken symlink or a symlink loop; point it at the file")
        raise DatasetError(f"dataset file {path} does not exist; check data.train_files / data.val_files")
    if path.is_dir():
        raise DatasetError(f"dataset file {path} is a directory; list the parquet/JSONL files inside it")
    system_text = resolve_system_prompt(system_prompt) if system_prompt else None
    keys = FieldKeys(prompt_key=prompt_key, answer_key=answer_key)
    stats = LoadStats(path=str(path))
    records: list[PromptRecord] = []
    try:
        fmt = detect_format(path, fmt)
        rows = list(iter_file_rows(path, fmt))
    except RowError as exc:
        raise DatasetError(str(exc)) from None
    for number, row, parse_error in rows:
        stats.rows += 1
        where = f"{path} row {number}"
        try:
            if parse_error:
                raise DatasetError(f"{where}: {parse_error}")
            record = _record(row, where, number - 1, stats, system_text, path.stem, keys, strict_answers)
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
