"""Math reward: 1.0 if the final answer is mathematically equivalent to the gold answer, else 0.0.

Not a reference reward (ARPO scores math with token F1, see `deep_research`); this is the equivalence
reward of the reasoning recipes and the `math_equal` metric of evaluation (`evaluation.metrics`
re-exports `math_equal` from here, so reward and metric cannot drift).

Format handling of `compute_score`:
  - the answer is `megatron_arpo.rewards.text.extract_answer` (last `<answer>` span, last `\\boxed{}` in
    it, outer `\\text{}` removed; else the last `\\boxed{}` anywhere); no answer -> 0.0;
  - there is no format penalty (no -1): a malformed response simply scores 0.0;
  - `ground_truth` is a string or a list of strings (any match scores 1.0); gold strings are NOT split
    on commas, because `[1, 2]` is an interval in math data.

`math_equal(prediction, gold)`:
  1. equal after a light LaTeX string normalisation (`normalize_math_string`) -> True;
  2. two different plain words (letters only, e.g. `paris` vs `sirap`) -> False without math-verify,
     which would parse them as commuting products of symbols and call anagrams equal;
  3. otherwise math-verify: both sides wrapped as `\\boxed{...}` (so the string is taken as the final
     answer: `0.5` == `\\frac{1}{2}` == `\\dfrac{1}{2}` == `1/2`, `x = 5` == `5`), `verify(gold, pred)`;
     a side that does not parse, an error or a timeout -> False.

Timeouts: math-verify guards sympy with `signal.alarm`, which only works in the main thread and cancels
any other ITIMER_REAL timer of the process. In the main thread with no timer pending we let it do that;
anywhere else (worker threads, async actors, under pytest-timeout) the comparison runs in a child process
(`megatron_arpo.rewards.math_worker`) that is killed when it overruns: sympy can hold the GIL for minutes
(`\\boxed{9^{9^{9^9}}}`), so neither a thread nor a signal would get control back. A timeout scores 0.0
and logs the reason.
"""

from __future__ import annotations

import logging
import re
import signal
import threading
from collections.abc import Iterable
from typing import Any

from megatron_arpo.rewards.math_worker import verify_here, verify_in_worker
from megatron_arpo.rewards.text import as_gold_list, extract_answer

logger = logging.getLogger(__name__)

DEFAULT_TIMEOUT_SECONDS = 5

_PLAIN_WORDS = re.compile(r"[a-z]+( [a-z]+)*")
# Wrappers whose content is the answer: \text{Paris} -> Paris.
_UNWRAP = re.compile(r"\\(?:text|textbf|mathrm|mathbf|mbox)\{([^{}]*)\}")
_REMOVE = (
    "\\left", "\\right", "\\!", "\\,", "\\;", "\\:", "\\displaystyle",
    "^{\\circ}", "^\\circ", "\\%", "%", "\\$", "$",
)


def normalize_math_string(answer: str) -> str:
    """A light, conservative LaTeX normalisation for string comparison of math answers."""
    text = answer.strip()
    for fraction in ("\\dfrac", "\\tfrac"):
        text = text.replace(fraction, "\\frac")
    for token in _REMOVE:
        text = text.replace(token, "")
    text = _UNWRAP.sub(r"\1", text)
    text = " ".join(text.split()).rstrip(".").strip().lower()
    if text.startswith("\\(") and text.endswith("\\)") or text.startswith("\\[") and text.endswith("\\]"):
        text = text[2:-2].strip()
    return text.replace(" ", "")


def _can_use_signals() -> bool:
    if threading.current_thread() is not threading.main_thread():
        return False
    if not hasattr(signal, "setitimer"):
        return False
    return signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)


def math_equal(prediction: str, gold: str, timeout_seconds: int = DEFAULT_TIMEOUT_SECONDS) -> bool:
    """True if `prediction` and `gold` are the same math answer (see module docstring)."""
    for name, value in (("prediction", prediction), ("gold", gold)):
        if not isinstance(value, str):
            raise TypeError(
                f"math_equal: {name} must be a str, got {type(value).__name__} ({value!r}); "
                "for several gold answers call it once per answer"
            )
    pred_norm = normalize_math_string(prediction)
    gold_norm = normalize_math_string(gold)
    if not pred_norm or not gold_norm:
        return False
    if pred_norm == gold_norm:
        return True
    words = [" ".join(side.lower().split()).rstrip(".") for side in (prediction, gold)]
    if all(_PLAIN_WORDS.fullmatch(side) for side in words):
        return False
    if timeout_seconds <= 0:
        raise ValueError(f"timeout_seconds must be a positive integer, got {timeout_seconds!r}")
    try:
        if _can_use_signals():
            return verify_here(prediction, gold, timeout_seconds)
        return verify_in_worker(prediction, gold, timeout_seconds)
    except TimeoutError as exc:
        logger.warning("math reward: %s comparing %.80r with %.80r; scored as not equal", exc, prediction, gold)
        return False
    except Exception as exc:  # noqa: BLE001 - any parser failure means "not shown equal"
        logger.debug("math-verify failed on %r vs %r: %s", prediction, gold, exc)
        return False


def compute_score(
    solution_str: str,
    ground_truth: str | Iterable[str],
    data_source: str | None = None,
    extra_info: dict[str, Any] | None = None,
) -> float:
    """1.0 if the extracted final answer equals any gold answer mathematically, else 0.0."""
    del data_source, extra_info
    answer = extract_answer(solution_str)
    if not answer:
        return 0.0
    return float(any(math_equal(answer, gold) for gold in as_gold_list(ground_truth)))
