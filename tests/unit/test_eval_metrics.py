"""Evaluation metrics: answer extraction (V1-V5 of docs/design/arpo_reference.md §11.8), QA metrics (V7-V9, with our
documented V7 difference), math equivalence, pass@k against brute-force enumeration, mean±std."""

from __future__ import annotations

import itertools
import math
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction

import pytest

from evaluation.metrics import (
    accuracy,
    exact_match,
    extract_answer,
    math_equal,
    mean_std,
    pass_at_k,
    qa_f1,
)
from megatron_arpo.rewards import qa


# ---------------------------------------------------------------- extract_answer
@pytest.mark.parametrize("text, expected", [
    ("<think>x</think><answer>The answer is \\[ \\boxed{Paris} \\]</answer>", "Paris"),   # V1
    ("<answer>\\boxed{\\text{Paris}}</answer>", "Paris"),                                 # V2
    ("<answer>Paris</answer>", "Paris"),                                                  # V3
    ("blah \\boxed{42} no answer tags", "42"),                                            # V4
    ("<answer>\\boxed{1}</answer> later <answer>\\boxed{2}</answer>", "2"),              # V5
])
def test_extract_answer_reference_cases(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("<answer>\\boxed{\\frac{1}{2}}</answer>", "\\frac{1}{2}"),            # brace matching
    ("<answer>\\boxed{a} then \\boxed{b}</answer>", "b"),                  # last boxed in the span
    ("<answer>  Paris, France \n</answer>", "Paris, France"),               # raw span, stripped
    ("<answer>\\boxed{x+1</answer>", "x+1"),                               # unbalanced: the remainder
    ("<answer>\\boxed{\\text{a} + \\text{b}}</answer>", "\\text{a} + \\text{b}"),  # \text{} not outer
    ("\\boxed{1} text <answer>no box</answer>", "no box"),                 # tags win over earlier boxes
    ("no tags, no box", ""),
    ("", ""),
])
def test_extract_answer_edge_cases(text, expected):
    assert extract_answer(text) == expected


# ---------------------------------------------------------------- QA metrics
def test_v7_punctuation_is_removed_unlike_the_reference():
    # Reference evaluation keeps punctuation (em 0, acc 1, f1 0); we use SQuAD normalisation (documented).
    assert exact_match("Paris.", "Paris") == 1.0
    assert accuracy("Paris.", "Paris") == 1.0
    assert qa_f1("Paris.", "Paris") == 1.0


def test_v8_articles_are_removed():
    assert exact_match("the Paris", "Paris") == 1.0
    assert qa_f1("the Paris", "Paris") == 1.0


@pytest.mark.parametrize("gold", ["[Paris, Lyon]", " [Paris,Lyon] ", '["Paris", "Lyon"]',
                                  "['Paris', 'Lyon']", ["Paris", "Lyon"]])
def test_v9_bracketed_gold_is_a_list(gold):
    assert exact_match("Lyon", gold) == 1.0
    assert qa_f1("Lyon", gold) == 1.0
    assert accuracy("it is Lyon", gold) == 1.0
    assert exact_match("Marseille", gold) == 0.0


def test_json_list_items_keep_their_commas():
    assert exact_match("Washington, D.C.", '["Washington, D.C.", "DC"]') == 1.0


def test_qa_f1_partial_overlap_and_yes_no_rule():
    assert qa_f1("Eiffel Tower Paris", "the Eiffel Tower") == pytest.approx(0.8)
    assert qa_f1("yes", "no") == 0.0
    assert qa_f1("yes it is", "yes") == 0.0   # 'yes' gold vs a different prediction
    assert qa_f1("", "Paris") == 0.0
    assert exact_match("", "") == 1.0


def test_accuracy_is_containment_and_empty_gold_never_matches():
    assert accuracy("The capital is Paris, France", "paris") == 1.0
    assert accuracy("Lyon", "Paris") == 0.0
    assert accuracy("anything", "") == 0.0
    assert accuracy("anything", "the") == 0.0  # normalises to the empty string


def test_gold_type_errors_are_clear():
    with pytest.raises(TypeError, match="convert numbers to strings"):
        exact_match("42", 42)
    with pytest.raises(TypeError, match="list items must be str"):
        qa_f1("42", ["41", 42])


def test_reward_and_metric_are_the_same_scorer():
    output = "<think>x</think><answer>\\boxed{\\text{The Eiffel Tower}}</answer>"
    for gold in ("Eiffel Tower", "Eiffel Tower in Paris", "[Louvre, eiffel tower]"):
        answer = extract_answer(output)
        assert qa.compute_score_em(output, gold) == exact_match(answer, gold)
        assert qa.compute_score_f1(output, gold) == qa_f1(answer, gold)


# ---------------------------------------------------------------- math_equal
@pytest.mark.parametrize("prediction, gold", [
    ("0.5", "\\frac{1}{2}"),
    ("\\dfrac{1}{2}", "\\frac{1}{2}"),
    ("\\tfrac12", "0.5"),
    ("\\text{14}", "14"),
    ("14", "14.0"),
    ("1,000", "1000"),
    ("$42$", "42"),
    ("\\left( 1, 2 \\right)", "(1,2)"),
    ("x = 5", "5"),
    ("2\\sqrt{2}", "\\sqrt{8}"),
    ("90^\\circ", "90"),
    ("Paris", "paris"),
])
def test_math_equal_true(prediction, gold):
    assert math_equal(prediction, gold) is True


@pytest.mark.parametrize("prediction, gold", [
    ("0.5", "\\frac{1}{3}"),
    ("41", "42"),
    ("Paris", "Sirap"),          # anagrams: plain words are compared as strings
    ("Paris.", "Sirap"),
    ("", "0"),
    ("\\frac{1}{2", "0.5"),      # unparseable prediction
    ("(1, 2)", "(2, 1)"),
])
def test_math_equal_false(prediction, gold):
    assert math_equal(prediction, gold) is False


def test_math_equal_in_threads():
    pairs = [("0.5", "\\frac{1}{2}", True), ("\\sqrt{4}", "2", True), ("3", "4", False)] * 2
    with ThreadPoolExecutor(max_workers=2) as pool:
        results = list(pool.map(lambda p: math_equal(p[0], p[1]), pairs))
    assert results == [p[2] for p in pairs]


# ---------------------------------------------------------------- pass@k
def brute_force_pass_at_k(n: int, c: int, k: int) -> Fraction:
    """Fraction of all k-subsets of n samples (the first c correct) containing a correct sample."""
    subsets = list(itertools.combinations(range(n), k))
    hits = sum(1 for subset in subsets if any(i < c for i in subset))
    return Fraction(hits, len(subsets))


@pytest.mark.parametrize("n", range(1, 9))
def test_pass_at_k_matches_enumeration(n):
    for c in range(n + 1):
        for k in range(1, n + 1):
            assert pass_at_k(n, c, k) == pytest.approx(float(brute_force_pass_at_k(n, c, k)), abs=1e-12), (n, c, k)


def test_pass_at_k_known_values_and_large_n():
    assert pass_at_k(5, 1, 1) == pytest.approx(0.2)
    assert pass_at_k(5, 0, 5) == 0.0
    assert pass_at_k(5, 5, 1) == 1.0
    assert pass_at_k(1000, 1, 1) == pytest.approx(0.001)
    exact = 1 - Fraction(math.comb(150, 100), math.comb(200, 100))  # binomials far beyond float range
    assert pass_at_k(200, 50, 100) == pytest.approx(float(exact), rel=1e-12)


@pytest.mark.parametrize("args, error, message", [
    ((5, 6, 1), ValueError, "0 <= c <= n, got c=6, n=5"),
    ((5, -1, 1), ValueError, "0 <= c <= n, got c=-1"),
    ((5, 2, 0), ValueError, "1 <= k <= n, got k=0"),
    ((5, 2, 6), ValueError, "1 <= k <= n, got k=6, n=5"),
    ((0, 0, 1), ValueError, "n (samples per problem) must be >= 1"),
    ((5.0, 2, 1), TypeError, "n must be an integer, got float"),
    ((5, True, 1), TypeError, "c must be an integer, got bool"),
])
def test_pass_at_k_validation(args, error, message):
    with pytest.raises(error) as info:
        pass_at_k(*args)
    assert message in str(info.value)


# ---------------------------------------------------------------- mean_std
def test_mean_std():
    assert mean_std([1.0, 0.0, 1.0, 0.0]) == (0.5, 0.5)
    mean, std = mean_std([0.2, 0.4, 0.6], ddof=1)
    assert mean == pytest.approx(0.4) and std == pytest.approx(0.2)
    assert mean_std([0.7]) == (0.7, 0.0)


@pytest.mark.parametrize("values, ddof, message", [
    ([], 0, "no values"),
    ([0.5], 1, "ddof=1 needs more than 1 value"),
    ([0.5, 0.6], 2, "ddof must be 0 (population) or 1 (sample)"),
])
def test_mean_std_errors(values, ddof, message):
    with pytest.raises(ValueError) as info:
        mean_std(values, ddof=ddof)
    assert message in str(info.value)
