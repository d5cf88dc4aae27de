"""ToolExecutor semantics with small in-test tools: retries, timeouts, empty queries, stats, caching."""

import asyncio

import pytest

from megatron_arpo.tools.base import Tool, ToolError, ToolExecutor, ToolResult, TransportError
from megatron_arpo.tools.cache import ToolCache


class FlakyTool(Tool):
    """Raises TransportError for the first `failures` calls, then answers."""

    tag = "flaky"

    def __init__(self, failures: int, text: str = "ok"):
        self.failures = failures
        self.text = text
        self.calls = 0

    async def execute(self, query):
        self.calls += 1
        if self.calls <= self.failures:
            raise TransportError(f"connection refused (call {self.calls})")
        return ToolResult(text=f"{self.text}:{query}")


class ScriptedTool(Tool):
    """Returns a fixed result or raises a fixed exception; counts calls."""

    def __init__(self, tag="scripted", text="", exc=None, cacheable=False):
        self.tag = tag
        self.text = text
        self.exc = exc
        self.cacheable = cacheable
        self.calls = 0

    async def execute(self, query):
        self.calls += 1
        if self.exc is not None:
            raise self.exc
        return ToolResult(text=self.text)


class SlowTool(Tool):
    tag = "slow"

    def __init__(self, seconds):
        self.seconds = seconds
        self.cancelled = False
        self.active = 0
        self.max_active = 0

    async def execute(self, query):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await asyncio.sleep(self.seconds)
        except asyncio.CancelledError:
            self.cancelled = True
            raise
        finally:
            self.active -= 1
        return ToolResult(text="done")


def run(coro):
    return asyncio.run(coro)


def test_transport_errors_are_retried_until_success():
    tool = FlakyTool(failures=2)
    executor = ToolExecutor([tool], retries=2, backoff_s=0.001)
    result = run(executor.execute("flaky", "q"))
    assert result.ok and result.text == "ok:q"
    assert tool.calls == 3
    stats = executor.stats()["flaky"]
    assert stats["retries"] == 2 and stats["transport_failures"] == 2 and stats["errors"] == 0


def test_transport_errors_exhaust_retries_into_an_error_result():
    tool = FlakyTool(failures=10)
    executor = ToolExecutor([tool], retries=2, backoff_s=0.001)
    result = run(executor.execute("flaky", "q"))
    assert result.error == "transport"
    assert "3 attempts" in result.text and "connection refused" in result.text
    assert tool.calls == 3


def test_empty_output_is_a_valid_result_and_not_retried():
    tool = ScriptedTool(text="")
    executor = ToolExecutor([tool], retries=3, backoff_s=0.001)
    result = run(executor.execute("scripted", "x=1"))
    assert result.ok and result.text == ""
    assert tool.calls == 1
    assert executor.stats()["scripted"]["retries"] == 0


@pytest.mark.parametrize(
    "exc, error", [(ToolError("HTTP 404"), "tool error"), (RuntimeError("bug in tool"), "exception")]
)
def test_non_transport_errors_are_not_retried(exc, error):
    tool = ScriptedTool(exc=exc)
    executor = ToolExecutor([tool], retries=3, backoff_s=0.001)
    result = run(executor.execute("scripted", "q"))
    assert result.error == error
    assert str(exc) in result.text
    assert tool.calls == 1


@pytest.mark.parametrize("query", ["", "   ", "\n\t "])
def test_empty_query_returns_an_error_result_without_calling_the_tool(query):
    tool = ScriptedTool(text="never")
    executor = ToolExecutor([tool])
    result = run(executor.execute("scripted", query))
    assert result.error == "empty query"
    assert "empty query" in result.text and "<scripted>" in result.text
    assert tool.calls == 0
    assert executor.stats()["scripted"]["empty_queries"] == 1


def test_timeout_fires_and_cancels_the_tool():
    tool = SlowTool(seconds=60)
    executor = ToolExecutor([tool], timeout_s=0.2)
    result = run(executor.execute("slow", "q"))
    assert result.error == "timeout"
    assert "timed out" in result.text
    assert tool.cancelled
    stats = executor.stats()["slow"]
    assert stats["timeouts"] == 1 and stats["errors"] == 1


def test_concurrency_is_bounded():
    tool = SlowTool(seconds=0.05)
    executor = ToolExecutor([tool], max_concurrency=3)

    async def many():
        return await asyncio.gather(*(executor.execute("slow", f"q{i}") for i in range(10)))

    results = run(many())
    assert all(r.text == "done" for r in results)
    assert tool.max_active == 3


class GatedTool(Tool):
    """Runs until its gate opens; records how many of its calls run at once and which finished."""

    def __init__(self, tag, gate):
        self.tag = tag
        self.gate = gate
        self.active = 0
        self.max_active = 0
        self.finished = []

    async def execute(self, query):
        self.active += 1
        self.max_active = max(self.max_active, self.active)
        try:
            await self.gate.wait()
            self.finished.append(query)
            return ToolResult(text=f"{self.tag}:{query}")
        finally:
            self.active -= 1


def test_each_tool_has_its_own_concurrency_limit():
    """Sandbox runs holding every slot of their tool do not hold up a search (one shared semaphore did)."""

    async def scenario():
        sandbox_gate, search_gate = asyncio.Event(), asyncio.Event()
        sandbox, search = GatedTool("python", sandbox_gate), GatedTool("search", search_gate)
        executor = ToolExecutor([sandbox, search], max_concurrency=2, tool_concurrency={"search": 3})
        runs = [asyncio.ensure_future(executor.execute("python", f"code{i}")) for i in range(5)]
        await asyncio.sleep(0.01)
        pending = asyncio.gather(*(executor.execute("search", f"q{i}") for i in range(6)))
        await asyncio.sleep(0.01)
        search_gate.set()
        searches = await asyncio.wait_for(pending, timeout=5)
        still_running = sandbox.active
        sandbox_gate.set()
        await asyncio.gather(*runs)
        return sandbox, search, searches, still_running

    sandbox, search, searches, still_running = run(scenario())
    assert [r.text for r in searches] == [f"search:q{i}" for i in range(6)]
    assert still_running == 2 and sandbox.max_active == 2 and len(sandbox.finished) == 5
    assert search.max_active == 3


def test_a_bad_per_tool_limit_names_the_key():
    with pytest.raises(ValueError, match=r"tools.search.max_concurrency=0 must be >= 1"):
        ToolExecutor([ScriptedTool(tag="search")], tool_concurrency={"search": 0})
    with pytest.raises(ValueError, match=r"tool_concurrency names 'python', which is not a tool of this executor"):
        ToolExecutor([ScriptedTool(tag="search")], tool_concurrency={"python": 2})


def test_unknown_tag_is_an_error_result():
    executor = ToolExecutor([ScriptedTool()])
    result = run(executor.execute("browser", "q"))
    assert result.error == "unknown tool" and "scripted" in result.text


def test_duplicate_tags_are_rejected():
    with pytest.raises(ValueError, match="share the tag"):
        ToolExecutor([ScriptedTool(tag="a"), ScriptedTool(tag="a")])


def test_stats_and_metrics(tmp_path):
    tool = ScriptedTool(text="r", cacheable=True)
    executor = ToolExecutor([tool], cache=ToolCache(str(tmp_path / "c.sqlite")))

    async def calls():
        first = await executor.execute("scripted", "same")
        second = await executor.execute("scripted", "same")
        await executor.execute("scripted", " ")
        return first, second

    first, second = run(calls())
    assert not first.cached and second.cached and second.text == "r"
    assert tool.calls == 1
    stats = executor.stats()
    assert stats["scripted"]["calls"] == 3
    assert stats["scripted"]["cache_hits"] == 1
    assert stats["scripted"]["errors"] == 1
    assert stats["cache"]["hits"] == 1 and stats["cache"]["misses"] == 1
    metrics = executor.metrics()
    assert metrics["tools/scripted/calls"] == 3.0
    assert metrics["tools/cache/hit_rate"] == 0.5


def test_error_results_are_not_cached(tmp_path):
    tool = ScriptedTool(exc=ToolError("denied"), cacheable=True)
    cache = ToolCache(str(tmp_path / "c.sqlite"))
    executor = ToolExecutor([tool], cache=cache)

    async def calls():
        await executor.execute("scripted", "q")
        return await executor.execute("scripted", "q")

    result = run(calls())
    assert result.error == "tool error" and not result.cached
    assert tool.calls == 2
    assert len(cache) == 0


def test_executor_can_be_reused_across_event_loops():
    tool = SlowTool(seconds=0.01)
    executor = ToolExecutor([tool], max_concurrency=1)

    async def two():
        return await asyncio.gather(executor.execute("slow", "a"), executor.execute("slow", "b"))

    assert [r.text for r in run(two())] == ["done", "done"]
    assert [r.text for r in run(two())] == ["done", "done"]
