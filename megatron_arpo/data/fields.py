"""One field resolver for the rows of every loader: RL prompts, evaluation samples and SFT conversations.

A row is a mapping (a JSONL line or a parquet row). ``resolve_prompt_row`` finds its prompt and its gold
answer; ``resolve_conversation`` its SFT conversation. The accepted shapes (docs/data.md):

- ARPO parquet: ``prompt`` (chat messages, system + user) and ``reward_model.ground_truth``;
- question / answer: the question in ``question``, ``Question`` (GAIA), ``problem`` (MATH, AIME25),
  ``query`` or a string ``prompt``; the answer in ``answer``, ``Final answer``, ``final_answer``,
  ``golden_answers`` (FlashRAG) or ``ground_truth``; a row's own ``system`` prompt is kept;
- alpaca (LLaMA-Factory): ``instruction`` [+ ``input``] -> ``output``, with optional ``system`` and
  ``history`` (``[[question, answer], ...]``);
- conversations (SFT): ``conversations`` or ``messages`` with ``from``/``value`` or ``role``/``content``.

``data.prompt_key`` / ``data.answer_key`` name the fields instead (a dotted key reads inside a mapping:
``reward_model.ground_truth``). Gold answers are strings or lists of strings; numbers and booleans are
written as strings.
"""

from __future__ import annotations

import json
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional

from megatron_arpo.errors import InputError
from megatron_arpo.rollout.protocol import RESULT_TEMPLATE

__all__ = [
    "ANSWER_KEYS", "ID_KEYS", "QUESTION_KEYS", "ROLE_ALIASES", "FieldKeys", "PromptRow", "RowError", "gold_value",
    "detect_format", "iter_file_rows", "lookup", "resolve_conversation", "resolve_prompt_row",
]

QUESTION_KEYS = ("question", "Question", "problem", "query", "prompt")
ANSWER_KEYS = ("answer", "Final answer", "final_answer", "golden_answers", "ground_truth")
ID_KEYS = ("id", "task_id", "unique_id", "idx", "qid")
CONVERSATION_KEYS = ("conversations", "messages")
PROMPT_ROLES = ("system", "user", "assistant")
# Conversation roles (ShareGPT ``from`` or ``role``). ``function_call`` / ``observation`` are LLaMA-Factory's
# tool turns: a call and its result, mapped into the assistant turn as tags (resolve_conversation).
ROLE_ALIASES = {"human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant", "system": "system",
                "function_call": "function_call", "observation": "observation", "tool": "tool", "function": "tool",
                "ipython": "tool"}
# The argument of a function_call written inside the tool's tag, by tool name.
CALL_ARGUMENT_KEYS = {"search": ("query", "queries", "q"), "python": ("code", "source", "script")}


class RowError(InputError):
    """A row whose prompt, answer or conversation cannot be found; the message names the fields to use."""


@dataclass(frozen=True)
class FieldKeys:
    """``data.prompt_key`` / ``data.answer_key``: None = the accepted names of the module docstring."""

    prompt_key: Optional[str] = None
    answer_key: Optional[str] = None


@dataclass(frozen=True)
class PromptRow:
    """A resolved prompt row: chat messages ending with the user's question, and the gold answer."""

    messages: tuple[dict[str, str], ...]
    answer: Any                       # as stored (None when the row has none); see gold_value
    answer_key: Optional[str]
    question_key: str
    own_system: bool                  # the row carries its own system prompt
    row_id: Optional[str] = None
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def question(self) -> str:
        return self.messages[-1]["content"]


def _plain(value: Any) -> Any:
    """numpy arrays (parquet lists) as Python lists."""
    return value.tolist() if hasattr(value, "tolist") and not isinstance(value, (str, bytes)) else value


def lookup(row: dict, key: str) -> tuple[bool, Any]:
    """``(found, value)`` of ``key``; a dotted key (``reward_model.ground_truth``) reads inside mappings."""
    if key in row:
        return True, row[key]
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def gold_value(value: Any) -> str | list[str] | None:
    """A gold answer as a non-empty string or list of strings (numbers and booleans written out); None if
    the value is not one (empty, a mapping, a list with such items)."""
    value = _plain(value)
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, str):
        return value if value.strip() else None
    if isinstance(value, (list, tuple)):
        items = [gold_value(v) for v in value]
        if not items or any(not isinstance(v, str) for v in items):
            return None
        return items
    return None


def _messages(value: Any, where: str, key: str) -> list[dict[str, str]]:
    value = _plain(value)
    if not isinstance(value, (list, tuple)) or not value:
        raise RowError(f"{where}: {key!r} must be a non-empty list of chat messages, got {value!r:.80}")
    messages = []
    for msg in value:
        if not isinstance(msg, dict) or not isinstance(msg.get("role"), str) or not isinstance(msg.get("content"), str):
            raise RowError(f"{where}: each {key!r} message needs string 'role' and 'content', got {msg!r:.80}")
        if msg["role"] not in PROMPT_ROLES:
            raise RowError(f"{where}: message role {msg['role']!r} is not one of {'/'.join(PROMPT_ROLES)}")
        messages.append({"role": msg["role"], "content": msg["content"]})
    if messages[-1]["role"] != "user":
        raise RowError(f"{where}: the last {key} message must be the user's question")
    return messages


def _history(row: dict, where: str) -> list[dict[str, str]]:
    """Alpaca ``history``: ``[[question, answer], ...]`` before the instruction."""
    history = _plain(row.get("history")) or []
    turns: list[dict[str, str]] = []
    for pair in history:
        pair = _plain(pair)
        if not isinstance(pair, (list, tuple)) or len(pair) != 2 or not all(isinstance(p, str) for p in pair):
            raise RowError(f"{where}: 'history' must be a list of [question, answer] string pairs, got {pair!r:.80}")
        turns += [{"role": "user", "content": pair[0]}, {"role": "assistant", "content": pair[1]}]
    return turns


def _system(row: dict, where: str) -> list[dict[str, str]]:
    system = row.get("system")
    if system is None or system == "":
        return []
    if not isinstance(system, str):
        raise RowError(f"{where}: 'system' must be a string, got {type(system).__name__}")
    return [{"role": "system", "content": system}]


def _find_answer(row: dict, keys: FieldKeys, alpaca: bool) -> tuple[Optional[str], Any]:
    if keys.answer_key:
        found, value = lookup(row, keys.answer_key)
        return (keys.answer_key, value) if found else (None, None)
    reward_model = row.get("reward_model")
    if isinstance(reward_model, dict) and "ground_truth" in reward_model:
        return "reward_model.ground_truth", reward_model["ground_truth"]
    for key in (("output",) if alpaca else ()) + ANSWER_KEYS:
        if key in row and row[key] is not None:
            return key, row[key]
    return None, None


def resolve_prompt_row(row: Any, where: str, keys: FieldKeys = FieldKeys()) -> PromptRow:
    """The prompt messages and the gold answer of ``row`` (RL and evaluation rows); raises RowError."""
    if not isinstance(row, dict):
        raise RowError(f"{where}: expected an object (a mapping of fields), got {type(row).__name__}")
    if keys.prompt_key is None and any(k in row for k in CONVERSATION_KEYS) and not any(
            k in row for k in QUESTION_KEYS + ("instruction",)):
        raise RowError(f"{where}: a conversation row ({'/'.join(k for k in CONVERSATION_KEYS if k in row)}) is SFT "
                       f"data; RL and evaluation rows need a question and a gold answer (fields: "
                       f"{', '.join(QUESTION_KEYS)} / {', '.join(ANSWER_KEYS)}), or set data.prompt_key")
    alpaca = keys.prompt_key is None and "instruction" in row
    messages: list[dict[str, str]]
    if keys.prompt_key is not None:
        found, value = lookup(row, keys.prompt_key)
        if not found:
            raise RowError(f"{where}: no field {keys.prompt_key!r} (data.prompt_key); found fields {sorted(row)}")
        qkey = keys.prompt_key
        messages = _prompt_value(value, row, where, qkey)
    elif alpaca:
        qkey = "instruction"
        instruction, extra_input = row.get("instruction"), row.get("input") or ""
        if not isinstance(instruction, str) or not instruction.strip() or not isinstance(extra_input, str):
            raise RowError(f"{where}: alpaca rows need a non-empty string 'instruction' (and a string 'input')")
        text = instruction + ("\n" + extra_input if extra_input.strip() else "")
        messages = _system(row, where) + _history(row, where) + [{"role": "user", "content": text}]
    else:
        qkey = next((k for k in QUESTION_KEYS if row.get(k) is not None), "")
        if not qkey:
            raise RowError(f"{where}: no question; expected one of the fields {list(QUESTION_KEYS)} (or "
                           f"'instruction'), found fields {sorted(row)}; name another with data.prompt_key")
        messages = _prompt_value(row[qkey], row, where, qkey)
    akey, answer = _find_answer(row, keys, alpaca)
    row_id = next((str(row[k]) for k in ID_KEYS if row.get(k) is not None), None)
    extra_info = row.get("extra_info")
    if row_id is None and isinstance(extra_info, dict) and extra_info.get("index") is not None:
        row_id = str(extra_info["index"])
    extra = {k: v for k, v in row.items() if k not in (qkey, akey)}
    return PromptRow(messages=tuple(messages), answer=_plain(answer), answer_key=akey, question_key=qkey,
                     own_system=messages[0]["role"] == "system", row_id=row_id, extra=extra)


def _prompt_value(value: Any, row: dict, where: str, key: str) -> list[dict[str, str]]:
    """A prompt field: a question string (the row's ``system`` prepended) or a list of chat messages."""
    value = _plain(value)
    if isinstance(value, str):
        if not value.strip():
            raise RowError(f"{where}: {key!r} is empty; the question must be a non-empty string")
        return _system(row, where) + [{"role": "user", "content": value}]
    if isinstance(value, (list, tuple)):
        return _messages(value, where, key)
    raise RowError(f"{where}: {key!r} must be a question string or a list of chat messages, got "
                   f"{json.dumps(value, default=str)[:60]} ({type(value).__name__})")


def _tag_call(value: Any, where: str) -> str:
    """A LLaMA-Factory ``function_call`` value (``{"name": ..., "arguments": ...}`` as JSON text or a mapping)
    written in the tag protocol: ``<name>argument</name>``."""
    call = value
    if isinstance(value, str):
        try:
            call = json.loads(value)
        except json.JSONDecodeError:
            call = None
    if isinstance(call, list) and len(call) == 1:
        call = call[0]
    if not isinstance(call, dict) or not isinstance(call.get("name"), str) or "arguments" not in call:
        raise RowError(f"{where}: a function_call turn must hold one JSON object {{\"name\": TOOL, \"arguments\": "
                       f"...}}, got {str(value)[:80]!r}")
    name, args = call["name"], call["arguments"]
    if isinstance(args, str):
        try:
            parsed = json.loads(args)
            args = parsed if isinstance(parsed, dict) else args
        except json.JSONDecodeError:
            pass
    if isinstance(args, dict):
        known = [k for k in CALL_ARGUMENT_KEYS.get(name, ()) if k in args]
        if known:
            args = args[known[0]]
        elif len(args) == 1:
            args = next(iter(args.values()))
        else:
            raise RowError(f"{where}: function_call {name!r} has arguments {sorted(args)}; the tag protocol takes one "
                           f"text argument (e.g. {{\"query\": ...}} for search, {{\"code\": ...}} for python)")
    if isinstance(args, list) and all(isinstance(a, str) for a in args):
        args = "\n".join(args)
    if not isinstance(args, str) or not args.strip():
        raise RowError(f"{where}: function_call {name!r} has no text argument (got {args!r:.60})")
    if not name.replace("_", "").isalnum():
        raise RowError(f"{where}: function_call name {name!r} cannot be a tag; use the tool's tag (search, python)")
    return f"<{name}>{args}</{name}>"


def resolve_conversation(row: Any, where: str, keys: FieldKeys = FieldKeys()) -> list[dict[str, str]]:
    """The SFT conversation of ``row`` as ``[{"role", "content"}]`` (system first when given).

    A conversation row (``conversations`` / ``messages``) is normalised: ``function_call`` turns become
    ``<tool>argument</tool>`` inside the assistant turn, the ``observation`` answering one becomes the
    rollout's result block (``" <result>\\n...\\n</result>"``), and the assistant text after it continues
    the same turn, as the model writes it in RL. An ``observation`` / ``tool`` turn that answers no
    function_call stays a ``tool`` message, rendered by the chat template. Any other row shape
    (resolve_prompt_row) becomes its prompt plus the answer as the assistant turn.
    """
    if not isinstance(row, dict):
        raise RowError(f"{where}: expected an object with 'conversations', got {type(row).__name__}")
    turns_key = next((k for k in CONVERSATION_KEYS if k in row), None) if keys.prompt_key is None else None
    if turns_key is None:
        prompt = resolve_prompt_row(row, where, keys)
        answer = gold_value(prompt.answer)
        if not isinstance(answer, str):
            raise RowError(f"{where}: the answer ({prompt.answer_key or 'none found'}) must be one non-empty string to "
                           f"train on, got {prompt.answer!r:.60}; expected one of {list(ANSWER_KEYS)} (or 'output'), or "
                           "set data.answer_key")
        return list(prompt.messages) + [{"role": "assistant", "content": answer}]
    turns = _plain(row[turns_key])
    if not isinstance(turns, (list, tuple)) or not turns:
        raise RowError(f"{where}: {turns_key!r} must be a non-empty list of turns")
    messages = _system(row, where)
    open_call = False      # the last assistant turn ended in a function_call (or its observation)
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict):
            raise RowError(f"{where}: turn {i} is not an object")
        raw_role = turn.get("from", turn.get("role"))
        content = _plain(turn.get("value", turn.get("content")))
        role = ROLE_ALIASES.get(str(raw_role).lower()) if raw_role is not None else None
        if role is None:
            raise RowError(f"{where}: turn {i} has role {raw_role!r}; allowed: {sorted(ROLE_ALIASES)}")
        if role == "function_call":
            text = _tag_call(content, f"{where} turn {i}")
        elif not isinstance(content, str):
            raise RowError(f"{where}: turn {i} ({raw_role}) has no string 'value'/'content'")
        else:
            text = content
        if role == "system" and messages and messages[0]["role"] == "system":
            raise RowError(f"{where}: a system turn and a 'system' field; give only one")
        if role == "function_call":
            if messages and messages[-1]["role"] == "assistant":
                messages[-1]["content"] += text
            else:
                messages.append({"role": "assistant", "content": text})
            open_call = True
        elif role == "observation" and open_call:
            messages[-1]["content"] += RESULT_TEMPLATE.format(payload=text)
        elif role == "assistant" and open_call:
            messages[-1]["content"] += text
            open_call = False
        else:
            if open_call:
                raise RowError(f"{where}: turn {i} ({raw_role}) follows a function_call without its observation")
            messages.append({"role": "tool" if role == "observation" else role, "content": text})
    if not any(m["role"] == "assistant" for m in messages):
        raise RowError(f"{where}: no assistant ('gpt') turn to train on")
    return messages


# ------------------------------------------------------------------------------------------------ files
FILE_FORMATS = ("auto", "parquet", "jsonl", "json")
_PARQUET_MAGIC = b"PAR1"


def _head(path: Path) -> bytes:
    with open(path, "rb") as fh:
        return fh.read(4096)


def detect_format(path: str | os.PathLike, fmt: str = "auto", setting: Optional[str] = "data.format") -> str:
    """``parquet``, ``jsonl`` (one object per line) or ``json`` (one list) for ``path``; a format that the
    file's bytes contradict (``jsonl`` on a parquet file, ``.jsonl`` holding parquet) raises RowError naming
    both and the fix. ``setting``: the config key that sets ``fmt`` (None: the suffix alone decides)."""
    path = Path(path)
    if fmt not in FILE_FORMATS:
        raise RowError(f"{setting} {fmt!r} is not supported; use one of {', '.join(FILE_FORMATS)}")
    head = _head(path)
    is_parquet = head.startswith(_PARQUET_MAGIC)
    first = head.lstrip()[:1]

    def or_set(value: str) -> str:
        return f", or set {setting}: {value}" if setting else ""

    if fmt == "auto":
        by_suffix = {".parquet": "parquet", ".jsonl": "jsonl"}.get(path.suffix)
        if path.suffix == ".json":
            by_suffix = "json" if first == b"[" else "jsonl"
        if by_suffix is None:
            if is_parquet:
                return "parquet"
            if first in (b"[", b"{"):
                return "json" if first == b"[" else "jsonl"
            raise RowError(f"{path}: cannot tell the format from the suffix {path.suffix!r} or the contents; name the "
                           f"file .parquet / .jsonl (one object per line) / .json (a list){or_set('parquet or jsonl')}")
        if by_suffix == "parquet" and not is_parquet and first in (b"[", b"{"):
            raise RowError(f"{path} ends in .parquet but holds JSON text; rename it to .jsonl (or .json){or_set('jsonl')}")
        if by_suffix != "parquet" and is_parquet:
            raise RowError(f"{path} ends in {path.suffix} but holds parquet data (it starts with PAR1); rename it to "
                           f".parquet{or_set('parquet')}")
        fmt = by_suffix
    elif fmt == "parquet" and not is_parquet and first in (b"[", b"{"):
        raise RowError(f"{setting} is parquet but {path} holds JSON text, not parquet; set {setting}: jsonl (or auto)")
    elif fmt in ("jsonl", "json") and is_parquet:
        raise RowError(f"{setting} is {fmt} but {path} is a parquet file (it starts with PAR1), which is why its "
                       f"rows do not decode as text; set {setting}: parquet (or auto)")
    if fmt == "jsonl" and first == b"[":
        return "json"
    return fmt


def iter_file_rows(path: str | os.PathLike, fmt: str) -> Iterable[tuple[int, Any, Optional[str]]]:
    """``(number, row, None)`` per row of a ``detect_format`` file, or ``(number, None, problem)`` for a row
    that does not parse (one bad JSONL line names its line and can be skipped). ``number``: the 1-based
    row (parquet, json list) or line (jsonl)."""
    path = Path(path)
    if fmt == "parquet":
        # deferred: pulls in pyarrow (heavy; this module imports without it)
        import pyarrow.parquet as pq  # pyarrow: needed only for parquet files

        try:
            table = pq.read_table(path)
        except Exception as exc:  # pyarrow raises several types for corrupt files
            raise RowError(f"{path}: not a readable parquet file ({exc})") from exc
        for i, row in enumerate(table.to_pylist(), start=1):
            yield i, row, None
        return
    if fmt == "json":
        try:
            rows = json.loads(path.read_bytes().decode("utf-8"))
        except UnicodeDecodeError as exc:
            raise RowError(f"{path}: not UTF-8 text (byte 0x{exc.object[exc.start]:02x} at offset {exc.start}); "
                           "save it as UTF-8") from None
        except json.JSONDecodeError as exc:
            raise RowError(f"{path}: invalid JSON ({exc.msg} at line {exc.lineno})") from None
        except RecursionError:
            raise RowError(f"{path}: JSON nested too deeply; flatten it") from None
        if not isinstance(rows, list):
            raise RowError(f"{path}: a .json data file must hold a list of rows (or use JSON lines, .jsonl)")
        for i, row in enumerate(rows, start=1):
            yield i, row, None
        return
    with open(path, "rb") as fh:  # decoded per line: a bad line names its row and can be skipped
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
                yield i, None, (f"JSON nested too deeply (deeper than Python's recursion limit of "
                                f"{sys.getrecursionlimit()}); flatten the row")
