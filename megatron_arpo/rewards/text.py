"""Text helpers shared by the RL rewards and by evaluation: answer extraction, normalisation, EM/F1.

Training rewards (`megatron_arpo.rewards.*`) and evaluation metrics (`evaluation.metrics`) import these
functions from here, so the scorer used as the RL reward is the scorer evaluation reports.

Normalisation is the SQuAD one (`normalize_answer`): lowercase, delete every ASCII punctuation character
(`string.punctuation`, so hyphenated words join and `\\frac{1}{2}` becomes `frac12`), replace the whole
words a/an/the with a space, collapse whitespace. Non-ASCII punctuation is kept.

Token F1 (`token_f1`) is the HotpotQA variant of SQuAD F1: multiset overlap of whitespace tokens of the
normalised strings, plus the rule that when either normalised string is `yes`, `no` or `noanswer` and
the two differ, the score is 0. The ARPO training reward uses exactly this F1.

Answer extraction (`extract_answer`) follows the ARPO evaluation code (docs/design/arpo_reference.md §9):
  1. if the text has `<answer>...</answer>` spans, take the LAST one; inside it take the last
     `\\boxed{...}` (brace-matched; if the braces never close, everything after `\\boxed{` minus one
     trailing `}`), and unwrap an outer `\\text{...}`; if it has no `\\boxed{`, the stripped raw span;
  2. else the last `\\boxed{...}` anywhere in the text (same unwrapping);
  3. else "".
The training reward `deep_research` does NOT use this function: it reproduces the reference reward's own
(stricter) extraction, see that module.

Gold answers: a string, or a list of strings (any of them counts, metrics take the maximum). With
`split_list=True` a gold string that starts with `[` is a list as in the reference evaluation: it is
parsed as JSON when possible (`["a, b", "c"]`), otherwise the brackets are dropped and it is split on
commas, each item stripped of whitespace and quotes (`[Paris, Lyon]` -> `Paris`, `Lyon`).
"""

from __future__ import annotations

import json
import re
import string
from collections import Counter
from collections.abc import Iterable

_PUNCTUATION = frozenset(string.punctuation)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_ANSWER_SPAN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_YES_NO = frozenset({"yes", "no", "noanswer"})
_BOXED_OPEN = "\\boxed{"
_TEXT_OPEN = "\\text{"


def normalize_answer(text: str) -> str:
    """SQuAD normalisation: lowercase, drop ASCII punctuation, drop articles, collapse whitespace."""
    text = text.lower()
    text = "".join(ch for ch in text if ch not in _PUNCTUATION)
    text = _ARTICLES.sub(" ", text)
    return " ".join(text.split())


def token_f1(prediction: str, gold: str) -> float:
    """Token F1 of one prediction against one gold answer (HotpotQA yes/no/noanswer rule included)."""
    pred_norm = normalize_answer(prediction)
    gold_norm = normalize_answer(gold)
    if (pred_norm in _YES_NO or gold_norm in _YES_NO) and pred_norm != gold_norm:
        return 0.0
    pred_tokens = pred_norm.split()
    gold_tokens = gold_norm.split()
    num_same = sum((Counter(pred_tokens) & Counter(gold_tokens)).values())
    if num_same == 0:
        return 0.0
    precision = num_same / len(pred_tokens)
    recall = num_same / len(gold_tokens)
    return 2 * precision * recall / (precision + recall)


def parse_gold_list(gold: str) -> list[str]:
    """Split a gold string of the form `[a, b, ...]` into its items (see module docstring)."""
    stripped = gold.strip()
    if not stripped.startswith("["):
        return [gold]
    try:
        parsed = json.loads(stripped)
    except ValueError:
        parsed = None
    if isinstance(parsed, list) and all(isinstance(item, str) for item in parsed):
        return parsed
    body = stripped[1:-1] if stripped.endswith("]") else stripped[1:]
    return [item.strip().strip("'\"").strip() for item in body.split(",")]


def as_gold_list(gold: str | Iterable[str], split_list: bool = False) -> list[str]:
    """Turn a gold answer (string or iterable of strings, e.g. a numpy array from parquet) into a list."""
    if isinstance(gold, str):
        return parse_gold_list(gold) if split_list else [gold]
    if isinstance(gold, bytes) or not isinstance(gold, Iterable):
        raise TypeError(
            f"gold answer must be a str or a list of str, got {type(gold).__name__} ({gold!r}); "
            "convert numbers to strings in the dataset"
        )
    golds: list[str] = []
    for item in gold:
        if not isinstance(item, str):
            raise TypeError(
                f"gold answer list items must be str, got {type(item).__name__} ({item!r}) in {gold!r}; "
                "convert numbers to strings in the dataset"
            )
        golds.extend(parse_gold_list(item) if split_list else [item])
    return golds


def max_token_f1(prediction: str, gold: str | Iterable[str], split_list: bool = False) -> float:
    """Best token F1 over the gold answers (0.0 for an empty gold list)."""
    return max((token_f1(prediction, g) for g in as_gold_list(gold, split_list)), default=0.0)


def max_exact_match(prediction: str, gold: str | Iterable[str], split_list: bool = False) -> float:
    """1.0 if the normalised prediction equals any normalised gold answer, else 0.0."""
    pred_norm = normalize_answer(prediction)
    return float(any(pred_norm == normalize_answer(g) for g in as_gold_list(gold, split_list)))


def max_contains(prediction: str, gold: str | Iterable[str], split_list: bool = False) -> float:
    """1.0 if any non-empty normalised gold answer is a substring of the normalised prediction."""
    pred_norm = normalize_answer(prediction)
    for g in as_gold_list(gold, split_list):
        gold_norm = normalize_answer(g)
        if gold_norm and gold_norm in pred_norm:
            return 1.0
    return 0.0


def find_closing_brace(text: str, open_index: int) -> int | None:
    """Index of the `}` matching the `{` at `open_index`, or None if the braces never balance."""
    depth = 0
    for i in range(open_index, len(text)):
        ch = text[i]
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i
    return None


def last_boxed_content(text: str) -> str | None:
    """Content of the last `\\boxed{...}` in `text`; unbalanced: the rest of the text minus a final `}`."""
    start = text.rfind(_BOXED_OPEN)
    if start < 0:
        return None
    open_index = start + len(_BOXED_OPEN) - 1
    close_index = find_closing_brace(text, open_index)
    if close_index is None:
        rest = text[open_index + 1 :]
        return rest[:-1] if rest.endswith("}") else rest
    return text[open_index + 1 : close_index]


def strip_outer_text(answer: str) -> str:
    """`\\text{Paris}` -> `Paris`, only when that `\\text{...}` wraps the whole (stripped) answer."""
    stripped = answer.strip()
    if stripped.startswith(_TEXT_OPEN):
        open_index = len(_TEXT_OPEN) - 1
        if find_closing_brace(stripped, open_index) == len(stripped) - 1:
            return stripped[open_index + 1 : -1].strip()
    return stripped


def extract_answer(text: str) -> str:
    """The final answer of a model output (see module docstring for the rules)."""
    spans = _ANSWER_SPAN.findall(text)
    if spans:
        span = spans[-1]
        boxed = last_boxed_content(span)
        return span.strip() if boxed is None else strip_outer_text(boxed)
    boxed = last_boxed_content(text)
    return "" if boxed is None else strip_outer_text(boxed)
