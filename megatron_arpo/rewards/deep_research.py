"""The ARPO training reward, reproduced exactly (reference `verl/utils/reward_score/deep_research.py`).

`compute_score(solution_str, ground_truth)` returns the scalar the reference trainer uses;
`compute_score_details` returns {score, reason, answer, f1}. `solution_str` is the decoded response
(prompt excluded, special tokens skipped) INCLUDING the injected tool-result text. `ground_truth` is a
string or a list of strings (F1 is the maximum over them; an empty list scores like a wrong answer).

Score table: format error, missing answer or box-extraction error -> -1; F1 > 0 and the response
contains both `</search>` and `</python>` -> F1 + 0.1; F1 > 0 -> F1; otherwise 0.

Differences from the reference that do not change any score:
  - argument order: the reference is `compute_score(data_source, solution_str, ground_truth,
    extra_info)`; here `data_source` (ignored by the reference too) moved after `ground_truth`, the
    calling convention of every reward in this package;
  - the reference returns the dict (key `f1_score`) and prints every result; here the scalar function
    returns a float, the details carry the key `f1`, and results are logged at DEBUG level;
  - box-extraction failures carry a readable reason instead of a bare assertion message.

Quirks reproduced on purpose (docs/design/arpo_reference.md §5 and Q14); a fixed reward belongs in a new module, not here,
so that published hyperparameters keep their meaning:
  1. Format gate, checked in this order on the raw text: count(`<think>`) == count(`</think>`) (else
     "not paired"), then both >= 1 (else "not found"); exactly one `<answer>` and one `</answer>`; every
     `<search>` must be followed by `</search>`, `<result>`, `</result>` in that order, scanning on
     after that `</result>`; the same for `<python>`; `<answer>` before `</answer>`; the answer span
     must contain the literal `\\boxed{` and some `}`.
  2. The gate looks at tool results too: a `<think>` or `<answer>` inside a search result is a format
     error (-1) the model did not write.
  3. The tool scan resumes after each `</result>`, so a second `<search>` opened before the first
     result (an unanswered call) is never checked; a `<result>` may be "borrowed" from another tool.
  4. `\\boxed 42` alone fails the gate (R18), and so does `\\fbox{42}` alone (no `\\boxed{`).
  5. Boxed-space form: if the answer span contains `\\boxed ` (with a space) anywhere, the answer is the
     text after its LAST occurrence up to the first `$`, even when a `\\boxed{...}` comes later.
  6. Otherwise the answer is the last `\\boxed` (or, if none, `\\fbox`) with brace matching from that
     position; if the braces never balance, or the match does not start with `\\boxed{` (e.g. the last
     `\\boxed` is `\\boxedx{..}` or only `\\fbox{..}` matched), the score is -1.
  7. No math equivalence: answers are compared by SQuAD-normalised token F1, which deletes ASCII
     punctuation: hyphenated words join, `\\frac{1}{2}` -> `frac12` (so it matches `\\frac{1}{2}` but
     not `0.5` or `\\dfrac{1}{2}`), `\\text{Paris}` -> `textparis` (no match with `Paris`).
  8. yes/no/noanswer rule: if either normalised side is one of those words and they differ, F1 is 0.
  9. The +0.1 bonus needs F1 > 0 and both `</search>` and `</python>` anywhere in the response (tool
     results included); it rewards using both tools regardless of need and lifts the maximum to 1.1.
 10. If `extra_info["tokenizer"]` has an `eos_token` and the response ends with it, it is stripped before
     extraction (after the format gate); with `skip_special_tokens=True` decoding this never happens.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterable
from typing import Any

from megatron_arpo.rewards.text import find_closing_brace, max_token_f1

logger = logging.getLogger(__name__)

_ANSWER_SPAN = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_BOXED_SPACE = "\\boxed "
_BOXED_OPEN = "\\boxed{"


class _BoxError(ValueError):
    """The reference's remove_boxed/last_boxed_only_string pair failed (reference score -1)."""


def _check_tool_tags(text: str, tool: str) -> str | None:
    open_tag, close_tag = f"<{tool}>", f"</{tool}>"
    pos = 0
    while True:
        call_start = text.find(open_tag, pos)
        if call_start == -1:
            return None
        result_start = text.find("<result>", call_start)
        call_end = text.find(close_tag, call_start)
        result_end = text.find("</result>", result_start)
        if -1 in (result_start, call_end, result_end):
            return f"{tool}/result tags are incomplete"
        if not call_start < call_end < result_start < result_end:
            return f"{tool}/result tags are nested in the wrong order"
        pos = result_end


def validate_format(text: str) -> tuple[bool, str]:
    """The reference format gate (quirks 1-4); returns (is_valid, reason)."""
    if text.count("<think>") != text.count("</think>"):
        return False, "<think> </think> not paired"
    if text.count("<think>") == 0 or text.count("</think>") == 0:
        return False, "<think> or </think> not found"
    if text.count("<answer>") != 1 or text.count("</answer>") != 1:
        return False, "<answer> or </answer> not found"
    for tool in ("search", "python"):
        problem = _check_tool_tags(text, tool)
        if problem is not None:
            return False, problem
    answer_start = text.find("<answer>")
    answer_end = text.find("</answer>")
    if answer_start > answer_end:
        return False, "<answer> must be before </answer>"
    answer_span = text[answer_start:answer_end]
    if _BOXED_OPEN not in answer_span or "}" not in answer_span:
        return False, "answer is missing \\boxed{} format"
    return True, "format is correct"


def extract_boxed_answer(answer_span: str) -> str:
    """The reference's boxed extraction (quirks 5-6); raises _BoxError where the reference raised."""
    if _BOXED_SPACE in answer_span:
        return answer_span.split(_BOXED_SPACE)[-1].split("$")[0]
    start = answer_span.rfind("\\boxed")
    if start < 0:
        start = answer_span.rfind("\\fbox")
        if start < 0:
            raise _BoxError("no \\boxed or \\fbox in the answer")
    close = find_closing_brace(answer_span, start)
    if close is None:
        raise _BoxError("unbalanced braces after the last \\boxed")
    boxed = answer_span[start : close + 1]
    if not boxed.startswith(_BOXED_OPEN):
        raise _BoxError(f"last box {boxed!r} does not start with \\boxed{{")
    return boxed[len(_BOXED_OPEN) : -1]


def compute_score_details(
    solution_str: str,
    ground_truth: str | Iterable[str],
    data_source: str | None = None,
    extra_info: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """Score one response; returns {score, reason, answer, f1} exactly as the reference computes them."""
    del data_source  # ignored, as in the reference
    details: dict[str, Any] = {"score": 0.0, "reason": "", "answer": "", "f1": 0.0}
    valid, reason = validate_format(solution_str)
    if not valid:
        details.update(score=-1.0, reason=f"bad format: {reason}")
        logger.debug("deep_research reward: %s", details["reason"])
        return details

    response = solution_str
    tokenizer = (extra_info or {}).get("tokenizer")
    eos = getattr(tokenizer, "eos_token", None) if tokenizer is not None else None
    if eos and response.endswith(eos):
        response = response[: -len(eos)]

    match = _ANSWER_SPAN.search(response.strip())
    if match is None:  # unreachable after the gate; kept because the reference has it
        details.update(score=-1.0, reason="cannot extract answer")
        return details
    try:
        answer = extract_boxed_answer(match.group(1))
    except _BoxError as exc:
        details.update(score=-1.0, reason=f"find box error: {exc}")
        logger.debug("deep_research reward: %s", details["reason"])
        return details

    f1 = max_token_f1(answer, ground_truth)
    details.update(answer=answer, f1=f1)
    if f1 > 0 and "</search>" in response and "</python>" in response:
        details.update(score=f1 + 0.1, reason="correct answer using both search and python (+0.1)")
    elif f1 > 0:
        details.update(score=f1, reason="correct answer")
    else:
        details.update(score=0.0, reason="wrong answer but good format")
    logger.debug("deep_research reward: f1=%s answer=%r score=%s", f1, answer, details["score"])
    return details


def compute_score(
    solution_str: str,
    ground_truth: str | Iterable[str],
    data_source: str | None = None,
    extra_info: dict[str, Any] | None = None,
) -> float:
    """The reference ARPO reward as a float in {-1} U [0, 1.1]."""
    return float(compute_score_details(solution_str, ground_truth, data_source, extra_info)["score"])
