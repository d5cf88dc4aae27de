"""Cold-start SFT data: conversations -> token ids and an assistant-only loss mask, in the checkpoint's template.

Rows (`megatron_arpo.data.fields.resolve_conversation`, docs/data.md): ShareGPT / LLaMA-Factory
``{"conversations": [{"from": "human", "value": ...}, {"from": "gpt", ...}], "system": ...}`` (or
``messages`` with ``role``/``content``), with LLaMA-Factory's ``function_call`` / ``observation`` turns
written into the assistant turn in the tag protocol; alpaca rows; question/answer and ARPO parquet rows
(the answer is the assistant turn). Files: ``.jsonl``, ``.json`` (a list) or ``.parquet``.

Rendering: everything but the assistant text comes from the checkpoint's chat template
(``ChatFormat.render_text``): the text before each assistant turn is the template's rendering of the
conversation so far with the generation prompt (so the first one is exactly an RL prompt), and the
text after it the template's end of turn. The assistant text itself is written as given (mask 1), as
the model writes it in RL, followed by the end-of-turn token (mask 1, an eos id of the checkpoint) and
the rest of the template's text (mask 0). Consecutive ``tool`` turns are therefore merged, or not,
exactly as the template does (Qwen: one user turn of ``<tool_response>`` blocks).

One deliberate difference from ``apply_chat_template`` on the whole conversation: templates that drop
the reasoning of earlier assistant turns from the history (Qwen3 before the last user turn, QwQ on every
turn but the last) would train the model to answer without it; the assistant text is trained as written.

When the template's generation prompt opens a thinking block (QwQ: ``<think>\\n``; see
`megatron_arpo.data.chat`), the prompt already holds it, so an answer that starts with it has it stripped
(counted in ``prefix_stripped``). Tool results inside an assistant turn — each ``<result>…</result>`` block
with the whitespace before it — are re-spliced by `TagProtocol.encode_written_response`: mask 0, the same
tokens the rollout splices for that payload, and the text after ``</result>`` is trained again, exactly as
in RL (docs/design/arpo_reference.md §3.2). An unclosed ``<result>`` masks the rest of the turn.

Conversations longer than ``max_tokens`` are truncated (counted); ones left with no trained token are
dropped (counted). A malformed row raises ``SFTDataError`` naming the file and row, or is skipped and
counted with ``data.on_bad_row: skip``.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Sequence

from megatron_arpo.data.datasets import repair_boxed
from megatron_arpo.data.fields import ROLE_ALIASES, FieldKeys, RowError, detect_format, iter_file_rows, resolve_conversation
from megatron_arpo.errors import InputError

logger = logging.getLogger(__name__)

__all__ = ["ROLE_ALIASES", "SFTDataError", "SFTExample", "SFTLoadStats", "iter_conversations", "load_sft_examples",
           "normalize_conversation", "render_turn_texts", "tokenize_conversation"]

_TURN_MARK = "@@ARPO-SFT-TURN-{}@@"


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


def normalize_conversation(row: Any, where: str, keys: FieldKeys = FieldKeys()) -> list[dict[str, str]]:
    """``[{"role", "content"}]`` of any accepted row (system first when given; ARPO's corrupted ``\\boxed``
    repaired as for RL); raises SFTDataError."""
    try:
        messages = resolve_conversation(row, where, keys)
    except RowError as exc:
        raise SFTDataError(str(exc)) from None
    return [{"role": m["role"], "content": repair_boxed(m["content"])[0]} for m in messages]


def _strip_prefix(content: str, prefix: str) -> tuple[str, bool]:
    """The answer without the template's thinking prefix (already in the prompt), and whether it had it."""
    if prefix and content.startswith(prefix):
        return content[len(prefix):], True
    stem = prefix.strip()
    if stem and content.lstrip().startswith(stem):
        return content.lstrip()[len(stem):].lstrip(), True
    return content, False


def render_turn_texts(chat: Any, messages: Sequence[dict[str, str]]) -> list[str]:
    """The template's text around the assistant turns: ``[before turn 0, between 0 and 1, ..., after the last]``.

    Each piece comes from rendering the conversation with every assistant text replaced by a marker, then
    taking what follows the previous turn's marker: the template's end of that turn, the user / tool turns
    after it and the generation prompt of the next (the last piece: the end of the last turn). Markers keep
    templates from rewriting assistant text (reasoning removal) while they render everything else.
    """
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    mark = _TURN_MARK
    while any(mark.format("") in m["content"] for m in messages):
        mark = "@" + mark + "@"
    marks = [mark.format(j) for j in range(len(turns))]
    placed = [dict(m) for m in messages]
    for j, i in enumerate(turns):
        placed[i]["content"] = marks[j]
    texts = [chat.render_text(placed[:turns[0]], add_generation_prompt=True)]
    ends = [(chat.render_text(placed[:turns[j]], add_generation_prompt=True), marks[j - 1]) for j in range(1, len(turns))]
    ends.append((chat.render_text(placed[:turns[-1] + 1], add_generation_prompt=False), marks[-1]))
    for text, turn_mark in ends:
        if text.count(turn_mark) != 1:
            raise SFTDataError("the chat template does not write an assistant turn's text once and unchanged (a "
                               "marker turn came out " + str(text.count(turn_mark)) + " times); SFT cannot find the "
                               "assistant tokens in its rendering. Set data.chat_template to a template that does")
        texts.append(text[text.index(turn_mark) + len(turn_mark):])
    return texts


def tokenize_conversation(chat: Any, messages: Sequence[dict[str, str]], max_tokens: int,
                          protocol: Any = None) -> tuple[SFTExample, dict[str, int]]:
    """``chat``: the checkpoint's `ChatFormat`; ``protocol``: its `TagProtocol` (default ``chat.protocol([])``).

    Returns the example and counts (``result_spans``, ``prefix_stripped``). Turns after the last assistant
    turn are dropped (nothing after it is trained).
    """
    protocol = protocol if protocol is not None else chat.protocol([])
    turns = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    if turns[0] == 0:
        raise SFTDataError("the conversation starts with an assistant turn; it needs a user question before it")
    texts = render_turn_texts(chat, messages)
    eos_ids = set(protocol.end_token_ids)
    ids = protocol.encode_text(texts[0])
    mask = [0] * len(ids)
    counts = {"result_spans": 0, "prefix_stripped": 0}
    for j, index in enumerate(turns):
        content, stripped = _strip_prefix(messages[index]["content"], protocol.response_prefix)
        counts["prefix_stripped"] += int(stripped)
        piece, piece_mask, blocks = protocol.encode_written_response(content)
        counts["result_spans"] += blocks
        ids.extend(piece)
        mask.extend(piece_mask)
        after = protocol.encode_text(texts[j + 1])
        if not after or after[0] not in eos_ids:
            raise SFTDataError(f"the chat template ends an assistant turn with {texts[j + 1][:24]!r}, which does not "
                               f"start with an end-of-turn id of generation_config.json ({sorted(eos_ids)}); the model "
                               "would not learn to stop. Fix eos_token_id there, or data.chat_template")
        ids.extend(after)
        mask.extend([1] + [0] * (len(after) - 1))  # the end-of-turn token is what the model must write
    truncated = len(ids) > max_tokens
    return SFTExample(ids[:max_tokens], mask[:max_tokens], truncated), counts


def _iter_rows(path: Path, fmt: str) -> Iterable[tuple[str, Any]]:
    """``(where, row)``; a row that cannot be parsed comes as ``(where, SFTDataError)``."""
    try:
        fmt = detect_format(path, fmt, setting=None if fmt == "auto" else "data.format")
        for number, row, problem in iter_file_rows(path, fmt):
            where = f"{path}:{number}" if fmt == "jsonl" else f"{path}[{number}]"
            yield where, (SFTDataError(f"{where}: {problem}") if problem else row)
    except RowError as exc:
        raise SFTDataError(str(exc)) from None


def iter_conversations(paths: Sequence[str | os.PathLike], on_bad_row: str = "error",
                       stats: SFTLoadStats | None = None, fmt: str = "auto",
                       keys: FieldKeys = FieldKeys()) -> Iterable[list[dict[str, str]]]:
    """Normalized conversations of every file, in order; bad rows raise, or are counted in ``stats``
    and skipped with ``on_bad_row="skip"`` (``data.on_bad_row``). ``fmt``: ``data.format``; ``keys``:
    ``data.prompt_key`` / ``data.answer_key`` for rows that are not conversations."""
    stats = stats if stats is not None else SFTLoadStats()
    for path in paths:
        path = Path(path)
        if not path.is_file():
            raise SFTDataError(f"SFT file {path} {'is a directory' if path.is_dir() else 'not found'}; check "
                               f"sft.train_files")
        stats.files.append(str(path))
        for where, row in _iter_rows(path, fmt):
            stats.rows += 1
            try:
                if isinstance(row, SFTDataError):
                    raise row
                messages = normalize_conversation(row, where, keys)
            except SFTDataError as exc:
                if on_bad_row != "skip":
                    raise SFTDataError(f"{exc}. Fix the row, or set data.on_bad_row: skip to skip bad rows") from None
                stats.skipped_bad += 1
                stats.errors.append(str(exc))
                continue
            yield messages


def load_sft_examples(paths: Sequence[str | os.PathLike], chat: Any, max_tokens: int,
                      on_bad_row: str = "error", fmt: str = "auto",
                      keys: FieldKeys = FieldKeys()) -> tuple[list[SFTExample], SFTLoadStats]:
    """Tokenized examples of every file, in order, and what was truncated, dropped or skipped
    (``chat``: the checkpoint's `ChatFormat`)."""
    protocol = chat.protocol([])
    stats = SFTLoadStats()
    examples: list[SFTExample] = []
    for messages in iter_conversations(paths, on_bad_row, stats, fmt, keys):
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
