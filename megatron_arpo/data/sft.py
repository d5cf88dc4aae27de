"""Cold-start SFT data: ShareGPT-style JSON/JSONL conversations -> token ids and an assistant-only loss mask.

Input rows (ARPO-SFT-54K / LLaMA-Factory "sharegpt" layout): ``{"conversations": [{"from": "human",
"value": ...}, {"from": "gpt", "value": ...}, ...], "system": "..."}``; ``role``/``content`` keys are
accepted too, as is ``messages`` for ``conversations``. Roles: ``human``/``user``, ``gpt``/``assistant``,
``system``, ``observation``/``tool``/``function`` (a tool turn). A ``.json`` file holds a list of rows, a
``.jsonl`` file one row per line.

Rendering, with the tag protocol the rollout uses (`megatron_arpo.rollout.protocol.TagProtocol`):

    chat.render(messages before the first assistant turn)   (mask 0; the checkpoint's chat template with the
                                                               generation prompt: exactly an RL prompt)
    {assistant text}                                        (mask 1, except tool results, see below)
    <eos>                                                   (mask 1; the tokenizer's eos, <|im_end|> for Qwen)
    \\n                                                     (mask 0)
    later turns (multi-turn rows), ChatML as every supported model (qwen2, qwen3) uses:
    <|im_start|>user\\n{text}<|im_end|>\\n                    (mask 0)
    <|im_start|>user\\n<tool_response>\\n{text}\\n</tool_response><|im_end|>\\n   (tool turn, mask 0, Qwen's layout)
    <|im_start|>assistant\\n{thinking prefix}                (mask 0), then the answer as above

When the template's generation prompt opens a thinking block (QwQ: ``<think>\\n``; see
`megatron_arpo.data.chat`), the prompt already holds it, so an answer that starts with it has it stripped
(counted in ``prefix_stripped``). Tool results inside an assistant turn — each ``<result>…</result>`` block
with the whitespace before it — are re-spliced by `TagProtocol.encode_written_response`: mask 0, the same
tokens the rollout splices for that payload (template text, payload as plain text), and the text after
``</result>`` is trained again, exactly as in RL (docs/design/arpo_reference.md §3.2). An unclosed ``<result>`` masks
the rest of the turn.

Conversations longer than ``max_tokens`` are truncated (counted); ones left with no trained token are
dropped (counted). A malformed row (bad JSON, not UTF-8, wrong shape) raises ``SFTDataError`` naming the
file and line, or is skipped and counted with ``data.on_bad_row: skip``.
"""

from __future__ import annotations

import json
import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from megatron_arpo.errors import InputError

logger = logging.getLogger(__name__)

ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant",
                "system": "system", "observation": "tool", "tool": "tool", "function": "tool"}


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
    prefix_stripped: int = 0
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


def _strip_prefix(content: str, prefix: str) -> tuple[str, bool]:
    """The answer without the template's thinking prefix (already in the prompt), and whether it had it."""
    if prefix and content.startswith(prefix):
        return content[len(prefix):], True
    stem = prefix.strip()
    if stem and content.lstrip().startswith(stem):
        return content.lstrip()[len(stem):].lstrip(), True
    return content, False


def tokenize_conversation(chat: Any, messages: Sequence[dict[str, str]], max_tokens: int,
                          protocol: Any = None) -> tuple[SFTExample, dict[str, int]]:
    """``chat``: the checkpoint's `ChatFormat`; ``protocol``: its `TagProtocol` (default ``chat.protocol([])``).

    Returns the example and counts (``result_spans``, ``prefix_stripped``).
    """
    protocol = protocol if protocol is not None else chat.protocol([])
    first = next(i for i, m in enumerate(messages) if m["role"] == "assistant")
    if first == 0:
        raise SFTDataError("the conversation starts with an assistant turn; it needs a user question before it")
    ids = chat.render(messages[:first])
    mask = [0] * len(ids)
    counts = {"result_spans": 0, "prefix_stripped": 0}

    def add(text: str, trained: int) -> None:
        piece = protocol.encode_text(text)
        ids.extend(piece)
        mask.extend([trained] * len(piece))

    for index, msg in enumerate(messages[first:], start=first):
        role, content = msg["role"], msg["content"]
        if role == "assistant":
            if index > first:
                add("<|im_start|>assistant\n" + protocol.response_prefix, 0)
            content, stripped = _strip_prefix(content, protocol.response_prefix)
            counts["prefix_stripped"] += int(stripped)
            piece, piece_mask, blocks = protocol.encode_written_response(content)
            counts["result_spans"] += blocks
            ids.extend(piece + [protocol.eos_token_id])
            mask.extend(piece_mask + [1])
            add("\n", 0)
        elif role == "tool":
            add(f"<|im_start|>user\n<tool_response>\n{content}\n</tool_response><|im_end|>\n", 0)
        else:
            add(f"<|im_start|>{role}\n{content}<|im_end|>\n", 0)
    truncated = len(ids) > max_tokens
    return SFTExample(ids[:max_tokens], mask[:max_tokens], truncated), counts


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
                except RecursionError:
                    yield where, SFTDataError(f"{where}: JSON nested too deeply; flatten the row")
    elif path.suffix == ".json":
        try:
            rows = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise SFTDataError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                               f"save it as UTF-8") from None
        except json.JSONDecodeError as exc:
            raise SFTDataError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
        except RecursionError:
            raise SFTDataError(f"{path}: JSON nested too deeply; flatten it") from None
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


def load_sft_examples(paths: Sequence[str | os.PathLike], chat: Any, max_tokens: int,
                      on_bad_row: str = "error") -> tuple[list[SFTExample], SFTLoadStats]:
    """Tokenized examples of every file, in order, and what was truncated, dropped or skipped
    (``chat``: the checkpoint's `ChatFormat`)."""
    protocol = chat.protocol([])
    stats = SFTLoadStats()
    examples: list[SFTExample] = []
    for messages in iter_conversations(paths, on_bad_row, stats):
        try:
            example, counts = tokenize_conversation(chat, messages, max_tokens, protocol)
        except SFTDataError as exc:  # a row without a question before the answer
            if on_bad_row != "skip":
                raise SFTDataError(f"SFT row {stats.rows} of {stats.files[-1]}: {exc}. Fix the row, or set "
                                   "data.on_bad_row: skip to skip bad rows") from None
            stats.skipped_bad += 1
            stats.errors.append(str(exc))
            continue
        stats.result_spans += counts["result_spans"]
        stats.prefix_stripped += counts["prefix_stripped"]
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
