"""Cold-start SFT data: ShareGPT-style JSON/JSONL conversations -> token ids and an assistant-only loss mask.

Input rows (ARPO-SFT-54K / LLaMA-Factory "sharegpt" layout): ``{"conversations": [{"from": "human",
"value": ...}, {"from": "gpt", "value": ...}, ...], "system": "..."}``; ``role``/``content`` keys are
accepted too, as is ``messages`` for ``conversations``. Roles: ``human``/``user``, ``gpt``/``assistant``,
``system``, ``observation``/``tool``/``function`` (a tool turn). A ``.json`` file holds a list of rows, a
``.jsonl`` file one row per line.

Rendering is Qwen's ChatML, written out rather than taken from the tokenizer's template so the
trained/masked boundaries are exact (and Qwen3's template rewrites the reasoning of earlier assistant
turns, which SFT must not do):

    <|im_start|>system\\n{system}<|im_end|>\\n          (mask 0)
    <|im_start|>user\\n{text}<|im_end|>\\n              (mask 0)
    <|im_start|>user\\n<tool_response>\\n{text}\\n</tool_response><|im_end|>\\n   (tool turn, mask 0, Qwen's layout)
    <|im_start|>assistant\\n                           (mask 0)
    {assistant text}<|im_end|>                        (mask 1, except tool results, see below)
    \\n                                                (mask 0)

The prompt part is what ``tokenizer.apply_chat_template(..., add_generation_prompt=True)`` renders for
the Qwen templates. Tool results inside an assistant turn — each ``<result>…</result>`` span together
with the whitespace right before it, the same text the rollout injects (``" <result>\\n…\\n</result>"``)
— get mask 0, and the text after ``</result>`` is trained again, exactly as in RL
(ARPO_REFERENCE.md §3.2). An unclosed ``<result>`` masks the rest of the turn. Each piece is tokenized
on its own (``add_special_tokens=False``), as the rollout tokenizes tool results on their own.

Conversations longer than ``max_tokens`` are truncated (counted); ones left with no trained token are
dropped (counted). A malformed row (bad JSON, not UTF-8, wrong shape) raises ``SFTDataError`` naming the
file and line, or is skipped and counted with ``data.on_bad_row: skip``.
"""

from __future__ import annotations

import json
import logging
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from megatron_arpo.errors import InputError

logger = logging.getLogger(__name__)

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "system": "system", "observation": "tool", "tool": "tool", "function": "tool"}
RESULT_SPAN = re.compile(r"\s*<result>.*?</result>", re.DOTALL)
UNCLOSED_RESULT = re.compile(r"\s*<result>", re.DOTALL)


class SFTDataError(InputError):
    """A malformed SFT row; the message names the file, row and problem."""


@dataclass(frozen=True)
class SFTExample:
    input_ids: list[int]
    loss_mask: list[int]
    truncated: bool = False


@dataclass
class SFTLoadStats:
    rows: int = 0
    kept: int = 0
    truncated: int = 0
    dropped_no_target: int = 0
    result_spans: int = 0
    skipped_bad: int = 0
    files: list[str] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def normalize_conversation(row: Any, where: str) -> list[dict[str, str]]:
    """``[{"role", "content"}]`` from a ShareGPT row (system first when given); raises SFTDataError."""
    if not isinstance(row, dict):
        raise SFTDataError(f"{where}: expected an object with 'conversations', got {type(row).__name__}")
    turns = row.get("conversations", row.get("messages"))
    if not isinstance(turns, list) or not turns:
        raise SFTDataError(f"{where}: 'conversations' must be a non-empty list of turns")
    messages = []
    system = row.get("system")
    if system:
        if not isinstance(system, str):
            raise SFTDataError(f"{where}: 'system' must be a string")
        messages.append({"role": "system", "content": system})
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise SFTDataError(f"{where}: turn {i} is not an object")
        raw_role = turn.get("from", turn.get("role"))
        content = turn.get("value", turn.get("content"))
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise SFTDataError(f"{where}: turn {i} has role {raw_role!r}; allowed: {sorted(ROLE_ALIASES)}")
        if not isinstance(content, str):
            raise SFTDataError(f"{where}: turn {i} ({raw_role}) has no string 'value'/'content'")
        if role == "system" and messages and messages[0]["role"] == "system":
            raise SFTDataError(f"{where}: a system turn and a 'system' field; give only one")
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" for m in messages):
        raise SFTDataError(f"{where}: no assistant ('gpt') turn to train on")
    return messages


def split_tool_results(text: str) -> list[tuple[str, bool]]:
    """``[(piece, trained)]`` of an assistant turn: tool-result spans (with leading whitespace) untrained."""
    pieces: list[tuple[str, bool]] = []
    pos = 0
    for match in RESULT_SPAN.finditer(text):
        if match.start() > pos:
            pieces.append((text[pos:match.start()], True))
        pieces.append((match.group(0), False))
        pos = match.end()
    rest = text[pos:]
    unclosed = UNCLOSED_RESULT.search(rest)
    if unclosed:
        if unclosed.start() > 0:
            pieces.append((rest[:unclosed.start()], True))
        pieces.append((rest[unclosed.start():], False))
    elif rest:
        pieces.append((rest, True))
    return pieces


def render_pieces(messages: Sequence[dict[str, str]]) -> list[tuple[str, bool]]:
    """The conversation as ChatML text pieces with their trained flag (see the module docstring)."""
    pieces: list[tuple[str, bool]] = []
    for msg in messages:
        role, content = msg["role"], msg["content"]
        if role == "assistant":
            pieces.append(("<|im_start|>assistant\n", False))
            pieces.extend(split_tool_results(content))
            pieces.append(("<|im_end|>", True))
            pieces.append(("\n", False))
        elif role == "tool":
            pieces.append((f"<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n", False))
        else:
            pieces.append((f"<|im_start|>{role}\n{content}<|im_end|>\n", False))
    return pieces


def tokenize_conversation(tokenizer: Any, messages: Sequence[dict[str, str]], max_tokens: int) -> SFTExample:
    ids: list[int] = []
    mask: list[int] = []
    for text, trained in render_pieces(messages):
        if not text:
            continue
        piece = tokenizer.encode(text, add_special_tokens=False)
        ids.extend(piece)
        mask.extend([1 if trained else 0] * len(piece))
    truncated = len(ids) > max_tokens
    return SFTExample(ids[:max_tokens], mask[:max_tokens], truncated)


def _iter_rows(path: Path) -> Iterable[tuple[str, Any]]:
    """``(where, row)``; a row that cannot be parsed comes as ``(where, SFTDataError)``."""
    if path.suffix == ".jsonl":
        with open(path, "rb") as fh:  # decoded per line: a bad line names its row and can be skipped
            for line_no, raw in enumerate(fh, start=1):
                where = f"{path}:{line_no}"
                try:
                    line = raw.decode("utf-8")
                except UnicodeDecodeError as exc:
                    yield where, SFTDataError(f"{where}: not UTF-8 text (byte 0x{raw[exc.start]:02x} at column "
                                              f"{exc.start + 1})")
                    continue
                if not line.strip():
                    continue
                try:
                    yield where, json.loads(line)
                except json.JSONDecodeError as exc:
                    yield where, SFTDataError(f"{where}: invalid JSON ({exc.msg})")
    elif path.suffix == ".json":
        try:
            rows = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise SFTDataError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                               f"save it as UTF-8") from None
        except json.JSONDecodeError as exc:
            raise SFTDataError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
        if not isinstance(rows, list):
            raise SFTDataError(f"{path}: a .json SFT file must hold a list of conversations")
        for i, row in enumerate(rows, start=1):
            yield f"{path}[{i}]", row
    else:
        raise SFTDataError(f"{path}: SFT files must end in .json (a list) or .jsonl (one conversation per line)")


def iter_conversations(paths: Sequence[str | os.PathLike], on_bad_row: str = "error",
                       stats: SFTLoadStats | None = None) -> Iterable[list[dict[str, str]]]:
    """Normalized conversations of every file, in order; bad rows raise, or are counted in ``stats``
    and skipped with ``on_bad_row="skip"`` (``data.on_bad_row``)."""
    stats = stats if stats is not None else SFTLoadStats()
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise SFTDataError(f"SFT file {path} {'is a directory' if path.is_dir() else 'not found'}; check "
                               f"sft.train_files")
        stats.files.append(str(path))
        for where, row in _iter_rows(path):
            stats.rows += 1
            try:
                if isinstance(row, SFTDataError):
                    raise row
                messages = normalize_conversation(row, where)
            except SFTDataError as exc:
                if on_bad_row != "skip":
                    raise SFTDataError(f"{exc}. Fix the row, or set data.on_bad_row: skip to skip bad rows") from None
                stats.skipped_bad += 1
                stats.errors.append(str(exc))
                continue
            yield messages


def load_sft_examples(paths: Sequence[str | os.PathLike], tokenizer: Any, max_tokens: int,
                      on_bad_row: str = "error") -> tuple[list[SFTExample], SFTLoadStats]:
    """Tokenized examples of every file, in order, and what was truncated, dropped or skipped."""
    stats = SFTLoadStats()
    examples: list[SFTExample] = []
    for messages in iter_conversations(paths, on_bad_row, stats):
        stats.result_spans += sum(len(RESULT_SPAN.findall(m["content"])) for m in messages if m["role"] == "assistant")
        example = tokenize_conversation(tokenizer, messages, max_tokens)
        if not any(example.loss_mask[1:]):
            stats.dropped_no_target += 1
            continue
        stats.truncated += int(example.truncated)
        examples.append(example)
    stats.kept = len(examples)
    if stats.skipped_bad:
        logger.warning("skipped %d malformed SFT row(s) of %d (data.on_bad_row: skip); first: %s", stats.skipped_bad,
                       stats.rows, stats.errors[0])
    if stats.truncated:
        logger.warning("%d of %d SFT conversations truncated to sft.max_seq_tokens=%d", stats.truncated,
                       stats.rows, max_tokens)
    if stats.dropped_no_target:
        logger.warning("dropped %d SFT conversations with no assistant token left after truncation",
                       stats.dropped_no_target)
    if not examples:
        raise SFTDataError(f"no usable SFT conversation in {list(map(str, paths))}")
    return examples, stats
