"""Rewards: the reference ARPO reward (cases R1-R18 of docs/design/arpo_reference.md §11.1 and its quirks), the math
and QA rewards, and the reward registry (built-in names, custom dotted paths, error messages)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from megatron_arpo.rewards import BUILTIN_REWARDS, get_reward_fn
from megatron_arpo.rewards import deep_research, qa
from megatron_arpo.rewards import math as math_reward

T = "<think>r</think>"
TOOLS = T + "<search>q</search> <result>\nx\n</result><python>print(1)</python> <result>\n1\n</result>"


def custom_length_reward(solution_str, ground_truth, data_source=None, extra_info=None):
    """A custom reward reachable by dotted path in the registry tests."""
    return float(len(solution_str) == len(ground_truth))


NOT_CALLABLE = 42


# ---------------------------------------------------------------- deep_research: reference cases §11.1
REFERENCE_CASES = [
    ("R1", T + "<answer>The answer is \\boxed{Paris}</answer>", "Paris", 1.0, "correct answer"),
    ("R2", TOOLS + T + "<answer>\\boxed{Paris}</answer>", "Paris", 1.1, "both search and python"),
    ("R5", TOOLS + T + "<answer>\\boxed{London}</answer>", "Paris", 0.0, "wrong answer"),
    ("R6", "<answer>\\boxed{Paris}</answer>", "Paris", -1.0, "<think> or </think> not found"),
    ("R7", T + "<think>x<answer>\\boxed{Paris}</answer>", "Paris", -1.0, "not paired"),
    ("R8", T + "<answer>\\boxed{A}</answer><answer>\\boxed{Paris}</answer>", "Paris", -1.0,
     "<answer> or </answer> not found"),
    ("R9", T + "<answer>Paris</answer>", "Paris", -1.0, "answer is missing \\boxed{} format"),
    ("R10", T + "<search>q</search>" + T + "<answer>\\boxed{Paris}</answer>", "Paris", -1.0,
     "search/result tags are incomplete"),
    ("R13-no", T + "<answer>\\boxed{no}</answer>", "yes", 0.0, "wrong answer"),
    ("R13-yes", T + "<answer>\\boxed{Yes}</answer>", "yes", 1.0, "correct answer"),
    ("R15", T + "<answer>\\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}", 1.0, "correct answer"),
    ("R17", T + "<answer>\\boxed{3\\sqrt{3} - 6}</answer>", "3\\sqrt{3} - 6", 1.0, "correct answer"),
    ("R18", T + "<answer>\\boxed 42</answer>", "42", -1.0, "answer is missing \\boxed{} format"),
]


@pytest.mark.parametrize("case_id, solution, gold, score, reason", REFERENCE_CASES,
                         ids=[c[0] for c in REFERENCE_CASES])
def test_reference_cases(case_id, solution, gold, score, reason):
    details = deep_research.compute_score_details(solution, gold)
    assert details["score"] == pytest.approx(score, abs=1e-12)
    assert reason in details["reason"]
    value = deep_research.compute_score(solution, gold)
    assert isinstance(value, float) and value == details["score"]


def test_r2_is_exactly_f1_plus_bonus():
    details = deep_research.compute_score_details(TOOLS + T + "<answer>\\boxed{Paris}</answer>", "Paris")
    assert details["f1"] == 1.0 and details["answer"] == "Paris"
    assert details["score"] == 1.1


def test_partial_f1_and_bonus_on_partial_f1():
    solution = T + "<answer>\\boxed{Paris France}</answer>"
    assert deep_research.compute_score(solution, "Paris") == pytest.approx(2 / 3)
    with_tools = TOOLS + T + "<answer>\\boxed{Paris France}</answer>"
    assert deep_research.compute_score(with_tools, "Paris") == pytest.approx(2 / 3 + 0.1)


def test_bonus_needs_both_tools():
    only_search = T + "<search>q</search> <result>\nx\n</result>" + T + "<answer>\\boxed{Paris}</answer>"
    assert deep_research.compute_score(only_search, "Paris") == 1.0


def test_bonus_counts_closing_tags_inside_tool_results():
    # Quirk 9: "</python>" appearing only inside a search result still earns the bonus.
    solution = T + "<search>q</search> <result>\nuse </python> here\n</result>" + T + "<answer>\\boxed{Paris}</answer>"
    assert deep_research.compute_score(solution, "Paris") == 1.1


def test_ground_truth_list_takes_max_and_empty_list_scores_zero():
    solution = T + "<answer>\\boxed{Lyon}</answer>"
    assert deep_research.compute_score(solution, ["Paris", "Lyon"]) == 1.0
    assert deep_research.compute_score(solution, []) == 0.0
    # A string gold is never split on commas (the reference does not split): "paris lyon" vs "lyon".
    assert deep_research.compute_score(solution, "[Paris, Lyon]") == pytest.approx(2 / 3)


def test_ground_truth_of_wrong_type_is_a_clear_error():
    with pytest.raises(TypeError, match="convert numbers to strings"):
        deep_research.compute_score(T + "<answer>\\boxed{42}</answer>", 42)


# ---------------------------------------------------------------- deep_research: quirks (module docstring)
def test_think_inside_tool_result_is_a_format_error():
    solution = T + "<search>q</search> <result>\n<think>page text\n</result>" + T + "<answer>\\boxed{Paris}</answer>"
    details = deep_research.compute_score_details(solution, "Paris")
    assert details["score"] == -1.0 and "not paired" in details["reason"]


def test_answer_tag_inside_tool_result_is_a_format_error():
    solution = T + "<search>q</search> <result>\n<answer>x</answer>\n</result>" + T + "<answer>\\boxed{Paris}</answer>"
    assert deep_research.compute_score(solution, "Paris") == -1.0


def test_unanswered_second_call_is_not_checked():
    solution = T + "<search>a</search><search>b</search> <result>\nr\n</result>" + T + "<answer>\\boxed{Paris}</answer>"
    assert deep_research.compute_score(solution, "Paris") == 1.0


def test_tool_tags_in_wrong_order():
    solution = T + "<search>q <result>\nr\n</result></search>" + T + "<answer>\\boxed{Paris}</answer>"
    details = deep_research.compute_score_details(solution, "Paris")
    assert details["reason"] == "bad format: search/result tags are nested in the wrong order"
    python = T + "<python>x=1" + T + "<answer>\\boxed{Paris}</answer>"
    details = deep_research.compute_score_details(python, "Paris")
    assert details["reason"] == "bad format: python/result tags are incomplete"


def test_answer_close_before_open():
    details = deep_research.compute_score_details(T + "</answer>\\boxed{Paris}<answer>", "Paris")
    assert details["reason"] == "bad format: <answer> must be before </answer>"


def test_validator_needs_a_literal_boxed_brace():
    assert deep_research.compute_score(T + "<answer>\\fbox{Paris}</answer>", "Paris") == -1.0


def test_boxed_space_form_reads_up_to_dollar_and_wins_over_later_boxed():
    solution = T + "<answer>\\boxed{x} so $\\boxed 42$ done</answer>"
    details = deep_research.compute_score_details(solution, "42")
    assert details["answer"] == "42" and details["score"] == 1.0
    later = T + "<answer>\\boxed 1 then \\boxed{2}</answer>"
    details = deep_research.compute_score_details(later, "2")
    assert details["answer"] == "1 then \\boxed{2}"
    assert details["score"] == 0.0  # "1 then boxed2" shares no token with "2"


def test_last_boxed_with_brace_matching():
    solution = T + "<answer>\\boxed{A} and finally \\boxed{\\frac{1}{2}}</answer>"
    details = deep_research.compute_score_details(solution, "\\frac{1}{2}")
    assert details["answer"] == "\\frac{1}{2}" and details["score"] == 1.0


def test_unbalanced_or_malformed_last_box_is_minus_one():
    unbalanced = T + "<answer>\\boxed{A} then \\boxed{B</answer>"
    details = deep_research.compute_score_details(unbalanced, "B")
    assert details["score"] == -1.0 and details["reason"].startswith("find box error")
    malformed = T + "<answer>\\boxed{A} then \\boxedB{C}</answer>"
    assert deep_research.compute_score(malformed, "C") == -1.0


@pytest.mark.parametrize("answer, gold, f1", [
    ("\\text{Paris}", "Paris", 0.0),       # \text{} wrapper kept: "textparis"
    ("0.5", "\\frac{1}{2}", 0.0),          # no math equivalence
    ("\\dfrac{1}{2}", "\\frac{1}{2}", 0.0),
    ("well-known", "wellknown", 1.0),      # hyphens join words
    ("The Eiffel Tower!", "eiffel tower", 1.0),
    ("noanswer", "no answer", 0.0),        # yes/no/noanswer rule
])
def test_token_f1_quirks(answer, gold, f1):
    details = deep_research.compute_score_details(T + f"<answer>\\boxed{{{answer}}}</answer>", gold)
    assert details["f1"] == pytest.approx(f1)


# ---------------------------------------------------------------- math reward
@pytest.mark.parametrize("boxed, gold", [
    ("\\frac{1}{2}", "0.5"),
    ("0.5", "\\frac{1}{2}"),
    ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("\\text{5}", "5"),
    ("42", "42"),
    ("42", "42.0"),
    ("3\\sqrt{3} - 6", "-6 + 3\\sqrt{3}"),
    ("x = 5", "5"),
])
def test_math_reward_equivalences(boxed, gold):
    assert math_reward.compute_score(T + f"<answer>\\boxed{{{boxed}}}</answer>", gold) == 1.0


@pytest.mark.parametrize("solution, gold", [
    (T + "<answer>\\boxed{41}</answer>", "42"),
    (T + "<answer>\\boxed{\\frac{1}{3}}</answer>", "0.5"),
    ("no answer here at all", "42"),
    (T + "<answer>\\boxed{Paris}</answer>", "Sirap"),
])
def test_math_reward_non_equivalences(solution, gold):
    assert math_reward.compute_score(solution, gold) == 0.0


def test_math_reward_format_handling():
    # No <answer> tags: the last \boxed{} anywhere is the answer; no -1 penalty for format.
    assert math_reward.compute_score("so \\boxed{7} and finally \\boxed{8}", "8") == 1.0
    assert math_reward.compute_score("<answer>12</answer>", "12") == 1.0
    assert math_reward.compute_score(T + "<answer>\\boxed{3}</answer>", ["2", "3"]) == 1.0
    assert math_reward.compute_score(T + "<answer>\\boxed{[1, 2]}</answer>", "[1,2]") == 1.0


def test_math_reward_from_worker_threads():
    cases = [("\\frac{1}{2}", "0.5", 1.0), ("\\dfrac{3}{4}", "0.75", 1.0), ("7", "8", 0.0), ("\\text{9}", "9", 1.0)]

    def score(case):
        boxed, gold, _ = case
        return math_reward.compute_score(T + f"<answer>\\boxed{{{boxed}}}</answer>", gold)

    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(score, cases * 2))
    assert results == [c[2] for c in cases] * 2


def test_a_power_tower_scores_0_off_the_main_thread_and_the_next_answer_still_scores():
    """sympy holds the GIL building 9^(9^(9^9)): off the main thread the comparison runs in a worker process,
    which is killed at the limit (a thread could not be abandoned: the caller never got the GIL back)."""
    results = []

    def run():
        results.append(math_reward.compute_score(T + "<answer>\\boxed{9^{9^{9^9}}}</answer>", "5"))
        results.append(math_reward.math_equal("1/2", "0.5", timeout_seconds=5))

    worker = threading.Thread(target=run, daemon=True)
    worker.start()
    worker.join(300)
    assert not worker.is_alive(), "the math reward never returned off the main thread"
    assert results == [0.0, True]


def test_a_worker_that_overruns_is_killed_and_replaced(monkeypatch):
    from megatron_arpo.rewards import math_worker

    monkeypatch.setattr(math_worker, "GRACE_S", 0.0)
    worker = math_worker.VerifyWorker()
    assert worker.verify("1/2", "0.5", 5)
    worker.proc.send_signal(19)  # SIGSTOP: the child stops answering, as one stuck in C code does
    with pytest.raises(TimeoutError, match="did not finish within 1 s"):
        worker.verify("1/2", "0.5", 1)
    assert worker.proc.poll() is not None  # killed
    results = []
    thread = threading.Thread(target=lambda: results.append(math_reward.math_equal("1/2", "0.5")))
    thread.start()
    thread.join(300)
    assert results == [True]


def test_signals_are_used_only_in_a_main_thread_without_a_timer():
    # In a fresh process: the test runner may itself hold an ITIMER_REAL (pytest-timeout).
    code = textwrap.dedent("""
        import signal, threading
        from megatron_arpo.rewards import math as m
        assert m._can_use_signals()                                   # main thread, no timer: signals
        previous = signal.signal(signal.SIGALRM, lambda *_: None)
        signal.setitimer(signal.ITIMER_REAL, 600)
        assert not m._can_use_signals()                               # a timer is pending: the worker
        assert m.math_equal("0.5", "0.50") and m.math_equal("1/2", "0.5")
        assert signal.getitimer(signal.ITIMER_REAL)[0] > 0            # the other timer survived
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        assert m.math_equal("1/2", "0.5") and not m.math_equal("1/3", "0.5")
        assert signal.getitimer(signal.ITIMER_REAL) == (0.0, 0.0)    # math-verify cleaned up its alarm
        seen = []
        t = threading.Thread(target=lambda: seen.append(m._can_use_signals())); t.start(); t.join()
        assert seen == [False]
    """)
    result = subprocess.run([sys.executable, "-c", code], cwd=Path(__file__).resolve().parents[2],
                            capture_output=True, text=True)
    assert result.returncode == 0, result.stderr


def test_math_equal_rejects_non_strings():
    with pytest.raises(TypeError, match="once per answer"):
        math_reward.math_equal("1", ["1", "2"])


# ---------------------------------------------------------------- qa reward
def test_qa_reward_em_and_f1():
    solution = T + "<answer>\\boxed{\\text{The Eiffel Tower}}</answer>"
    assert qa.compute_score(solution, "Eiffel Tower", metric="em") == 1.0
    partial = T + "<answer>\\boxed{Eiffel Tower Paris}</answer>"
    assert qa.compute_score_em(partial, "Eiffel Tower") == 0.0
    assert qa.compute_score_f1(partial, "Eiffel Tower") == pytest.approx(0.8)
    assert qa.compute_score_f1(T + "<answer>Lyon</answer>", "[Paris, Lyon]") == 1.0
    assert qa.compute_score_em("no answer", "Paris") == 0.0


def test_qa_reward_rejects_unknown_metric():
    with pytest.raises(ValueError, match=r"'rouge'.*\['em', 'f1'\]"):
        qa.compute_score("x", "x", metric="rouge")


# ---------------------------------------------------------------- registry
def test_builtin_names_resolve():
    assert get_reward_fn("deep_research") is deep_research.compute_score
    assert get_reward_fn("math") is math_reward.compute_score
    assert get_reward_fn("qa_em") is qa.compute_score_em
    assert get_reward_fn("qa_f1") is qa.compute_score_f1
    assert set(BUILTIN_REWARDS) == {"deep_research", "math", "qa_em", "qa_f1"}


@pytest.mark.parametrize("sep", [":", "."])
def test_custom_reward_by_dotted_path(sep):
    fn = get_reward_fn(f"{__name__}{sep}custom_length_reward")
    assert fn is custom_length_reward
    assert fn("abc", "xyz") == 1.0 and fn("abc", "xy") == 0.0


@pytest.mark.parametrize("path, message", [
    ("nonexistent_reward", "neither a built-in reward"),
    ("no_such_package_xyz.rewards:score", "module 'no_such_package_xyz.rewards' not found"),
    (f"{__name__}:missing_function", "has no attribute 'missing_function'"),
    (f"{__name__}:NOT_CALLABLE", "is a int, not a function"),
    ("", "non-empty string"),
])
def test_registry_errors_name_the_problem_and_the_builtins(path, message):
    with pytest.raises(ValueError) as info:
        get_reward_fn(path)
    assert message in str(info.value)
    assert "deep_research" in str(info.value) and "qa_f1" in str(info.value)


def test_missing_dependency_inside_a_custom_reward_is_not_hidden(tmp_path, monkeypatch):
    (tmp_path / "reward_with_bad_import.py").write_text("import definitely_missing_dependency_xyz\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ModuleNotFoundError, match="definitely_missing_dependency_xyz"):
        get_reward_fn("reward_with_bad_import:compute_score")


def test_package_import_is_light():
    code = textwrap.dedent("""
        import sys
        import megatron_arpo.rewards, evaluation.metrics
        heavy = [m for m in ("sympy", "math_verify", "torch", "transformers") if m in sys.modules]
        assert not heavy, heavy
    """)
    repo_root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], check=True, cwd=repo_root)
