"""Pure text helpers of the tools: auto-print, query normalisation, passage formatting, config parsing."""

import ast
import contextlib
import io
import json

import pytest

from megatron_arpo.tools import search
from megatron_arpo.tools.python_sandbox import _truncate_head, _truncate_tail, add_auto_print
from megatron_arpo.tools.registry import build_tools


def test_auto_print_v15():
    assert add_auto_print("a=[1,2]\nlen(a)") == "a=[1,2]\nprint(len(a))"


@pytest.mark.parametrize(
    "code",
    [
        "print(1)",
        "x = 1",
        "for i in range(3):\n    i",
        "def f(:\n  pass\nf()",  # does not parse: unchanged
        "",
        "import os",
    ],
)
def test_auto_print_leaves_code_unchanged(code):
    assert add_auto_print(code) == code


def test_auto_print_wraps_non_print_calls_and_keeps_line_numbers():
    code = "# comment\nx = 2\n\nx *  3  # trailing"
    out = add_auto_print(code)
    assert out == "# comment\nx = 2\n\nprint(x *  3)  # trailing"
    # attribute calls named print are not the builtin print: wrapped like the reference does
    assert add_auto_print("obj.print()") == "print(obj.print())"


def test_auto_print_multiline_and_unicode():
    code = "s = 'héllo wörld'; (len(s) +\n  1)"
    out = add_auto_print(code)
    # ast positions exclude the outer parentheses: the print lands inside them, still valid code
    assert out == "s = 'héllo wörld'; (print(len(s) +\n  1))"
    ast.parse(out)
    buffer = io.StringIO()
    with contextlib.redirect_stdout(buffer):
        exec(out, {})
    assert buffer.getvalue() == "12\n"


def test_truncation_markers():
    assert _truncate_head("abcdef", 10) == "abcdef"
    head = _truncate_head("a" * 50, 10)
    assert head.startswith("a" * 10) and "40 more characters" in head
    tail = _truncate_tail("x" * 40 + "END", 5)
    assert tail.endswith("x" * 2 + "END") and "38 earlier characters" in tail


def test_normalize_query_reference_cases():
    assert search.normalize_query('  "Eiffel Tower" height ') == "Eiffel Tower height"  # V14
    assert search.normalize_query("  Eiffel Tower: height? ", style="eval") == "eiffel tower height"  # V13
    with pytest.raises(ValueError, match="style"):
        search.normalize_query("q", style="other")


def test_format_passages():
    passages = [search.Passage("Alpha", "first   passage\ntext"), search.Passage("", "no title")]
    assert search.format_passages(passages) == "Page 1: Alpha: first passage text\nPage 2: no title"
    assert search.format_passages([search.Passage("T", "abcdef")], result_chars=3) == "Page 1: T: abc"
    assert search.format_passages([]) == search.NO_RESULTS


def test_passage_from_flashrag_contents():
    passage = search.passage_from_doc({"id": 7, "contents": '"Veloria"\nVeloria is an island.'}, 1.5)
    assert passage == search.Passage("Veloria", "Veloria is an island.", 1.5, "7")
    with pytest.raises(search.ToolError, match="title/text/contents"):
        search.passage_from_doc({"body": "x"})


def test_parse_bing_results_dedups_and_limits():
    answer = {
        "organic": [
            {"title": "A", "description": " one "},
            {"title": "B", "description": "one"},
            {"title": "C", "description": ""},
            {"title": "D", "description": "two"},
            {"title": "E", "description": "three"},
        ]
    }
    passages = search.parse_bing_results(answer, topk=2)
    assert [(p.title, p.text) for p in passages] == [("A", "one"), ("D", "two")]
    assert search.parse_bing_results({}, topk=3) == []


def test_web_backend_needs_key_from_environment(monkeypatch):
    monkeypatch.delenv("ARPO_TEST_BD_KEY", raising=False)
    with pytest.raises(ValueError, match="ARPO_TEST_BD_KEY"):
        search.WebSearchBackend(api_key_env="ARPO_TEST_BD_KEY")
    monkeypatch.setenv("ARPO_TEST_BD_KEY", "sk-not-a-real-key")
    backend = search.WebSearchBackend(api_key_env="ARPO_TEST_BD_KEY")
    assert "mkt=zh-CN" in backend.bing_url("埃菲尔铁塔 高度")
    assert "mkt=en-US" in backend.bing_url("eiffel tower height")
    assert "sk-not-a-real-key" not in repr(vars(backend))


def test_build_tools_rejects_unknown_keys():
    with pytest.raises(ValueError, match=r"tools: unknown keys \['timeout'\]"):
        build_tools({"timeout": 3})
    with pytest.raises(ValueError, match=r"tools.python: unknown keys \['memory'\]"):
        build_tools({"python": {"memory": 3}})
    with pytest.raises(ValueError, match="allowed values are"):
        build_tools({"search": {"backend": "bing"}})
    with pytest.raises(ValueError, match="tools.search.corpus is required"):
        build_tools({"search": {"backend": "local"}})


def test_build_tools_from_plain_dict(tmp_path):
    corpus = tmp_path / "c.jsonl"
    corpus.write_text(json.dumps({"id": "1", "title": "T", "contents": "text"}) + "\n")
    executor = build_tools(
        {
            "python": {"timeout_s": 2, "memory_mb": 256},
            "search": {"backend": "local", "corpus": str(corpus), "topk": 2, "max_concurrency": 16},
            "cache": {"path": str(tmp_path / "cache.sqlite")},
            "max_concurrency": 4,
            "timeout_s": 5,
            "retries": 1,
        }
    )
    assert executor.tags == ["python", "search"]
    assert executor.max_concurrency == 4 and executor.timeout_s == 5 and executor.retries == 1
    assert executor.tool_concurrency == {"python": 4, "search": 16}
    assert executor.tools["search"].topk == 2 and executor.tools["python"].timeout_s == 2
    assert executor.cache is not None
    assert build_tools({"python": {"enabled": False}, "search": None}).tags == []
