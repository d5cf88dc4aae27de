"""Tool interface, results and the executor that every rollout tool call goes through.

A `Tool` turns one query (the text between `<tag>` and `</tag>`) into a `ToolResult`. The
`ToolExecutor` wraps a set of tools with the policy the reference lacks (docs/design/arpo_reference.md §2.6, Q5, Q9):

- bounded concurrency per tool: one `asyncio.Semaphore` per tool, so a fast tool (a BM25 search) never
  queues behind a slow one (a sandbox run);
- an enforced per-call timeout (`asyncio.wait_for`); a call that runs out of time returns a result with
  `error="timeout"` and a text the model can read, it never raises into the scheduler;
- retries with exponential backoff only when a backend raises `TransportError` (connection refused,
  HTTP 5xx, ...). Empty output is a valid result and is returned as is (the reference re-ran silent code
  up to three times and then injected "returned empty output");
- an empty or whitespace-only query returns an error result at once, so the trajectory continues with a
  message instead of ending silently (the reference's Q5);
- an optional persistent `ToolCache` (see cache.py) consulted per tool and normalised query; identical
  calls in flight at the same time share one execution;
- per-tool counters (`stats()`), flattened for logging by `metrics()`.

The timeout covers the whole call, retries and backoff included, so the scheduler has one bound per
call. Waiting for a concurrency slot is not counted against it.
"""

from __future__ import annotations

import abc
import asyncio
import dataclasses
import logging
import time
from typing import Iterable, Mapping, Optional

from megatron_arpo.redaction import redact_url

logger = logging.getLogger(__name__)


class TransportError(Exception):
    """A backend could not be reached or answered with a server error; the executor retries these."""


class ToolError(Exception):
    """A backend refused the request for a reason retrying will not fix (bad key, HTTP 4xx, ...)."""


@dataclasses.dataclass
class ToolResult:
    """What one tool call produced. `text` is what the model sees, also when `error` is set."""

    text: str
    error: Optional[str] = None
    latency_s: float = 0.0
    cached: bool = False
    truncated: bool = False
    # False for answers that may be transient though they are not errors (a search with no results):
    # the cache does not keep them.
    cacheable: bool = True

    @property
    def ok(self) -> bool:
        return self.error is None


class Tool(abc.ABC):
    """One tool, keyed by its trigger tag (`python`, `search`)."""

    tag: str = ""
    # Whether results may be served from the cache. Search results are; code execution is not by
    # default because programs may depend on randomness or time.
    cacheable: bool = False

    @abc.abstractmethod
    async def execute(self, query: str) -> ToolResult:
        """Run one call. Raise TransportError for retryable failures, ToolError for others."""

    def cache_key(self, query: str) -> str:
        """The cache key of a query: everything that changes the result must be in it (the normalised
        query, and the tool's settings and data). Tools override this (search: see SearchTool)."""
        return query

    async def close(self) -> None:
        """Release sessions/indices. The default has nothing to release."""


def format_tool_error(tag: str, message: str) -> str:
    """The text the model sees for a failed call; passwords in URLs are removed (it also reaches logs)."""
    return f"Error: {tag} tool: {redact_url(message)}"


def _empty_stats() -> dict:
    return {
        "calls": 0,
        "errors": 0,
        "timeouts": 0,
        "retries": 0,
        "transport_failures": 0,
        "empty_queries": 0,
        "cache_hits": 0,
        "total_latency_s": 0.0,
        "max_latency_s": 0.0,
    }


class ToolExecutor:
    """Runs tool calls with bounded concurrency, timeouts, transport-only retries, caching and stats.

    `tools`: the tools, keyed by their tag. `cache`: an optional `ToolCache`. `max_concurrency`: calls of
    one tool running at once, unless `tool_concurrency` names the tool's own limit. `timeout_s`: bound on one
    call including retries. `retries`: extra attempts after a TransportError (0 = one attempt only).
    `backoff_s` doubles after every failed attempt up to `backoff_max_s`.
    """

    def __init__(
        self,
        tools: Iterable[Tool],
        *,
        cache=None,
        max_concurrency: int = 8,
        tool_concurrency: Optional[Mapping[str, int]] = None,
        timeout_s: float = 30.0,
        retries: int = 2,
        backoff_s: float = 0.5,
        backoff_max_s: float = 8.0,
    ):
        self.tools: dict[str, Tool] = {}
        for tool in tools:
            if not tool.tag:
                raise ValueError(f"tool {type(tool).__name__} has an empty tag; set Tool.tag")
            if tool.tag in self.tools:
                raise ValueError(f"two tools share the tag {tool.tag!r}; tags must be unique")
            self.tools[tool.tag] = tool
        if max_concurrency < 1:
            raise ValueError(f"max_concurrency={max_concurrency} must be >= 1")
        limits = {tag: max_concurrency for tag in self.tools}
        for tag, limit in (tool_concurrency or {}).items():
            if tag not in self.tools:
                raise ValueError(f"tool_concurrency names {tag!r}, which is not a tool of this executor; "
                                 f"tools: {sorted(self.tools)}")
            if limit < 1:
                raise ValueError(f"tools.{tag}.max_concurrency={limit} must be >= 1")
            limits[tag] = limit
        if timeout_s <= 0:
            raise ValueError(f"timeout_s={timeout_s} must be > 0")
        if retries < 0:
            raise ValueError(f"retries={retries} must be >= 0")
        self.cache = cache
        self.max_concurrency = max_concurrency
        self.tool_concurrency = limits
        self.timeout_s = float(timeout_s)
        self.retries = int(retries)
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self._semaphores: dict[str, asyncio.Semaphore] = {}
        self._semaphore_loop = None
        self._stats: dict[str, dict] = {tag: _empty_stats() for tag in self.tools}

    @property
    def tags(self) -> list[str]:
        return list(self.tools)

    def _get_semaphore(self, tag: str) -> asyncio.Semaphore:
        # Created lazily, per event loop: the executor may be built outside the loop that uses it,
        # and a semaphore cannot move between loops (tests run one loop per asyncio.run).
        loop = asyncio.get_running_loop()
        if self._semaphore_loop is not loop:
            self._semaphores = {t: asyncio.Semaphore(n) for t, n in self.tool_concurrency.items()}
            self._semaphore_loop = loop
        return self._semaphores[tag]

    async def execute(self, tag: str, query: str) -> ToolResult:
        """Run `query` on the tool `tag`. Never raises for tool failures; returns an error result."""
        start = time.monotonic()
        tool = self.tools.get(tag)
        if tool is None:
            return ToolResult(
                text=format_tool_error(tag, f"unknown tool; available tools: {sorted(self.tools)}"),
                error="unknown tool",
            )
        stats = self._stats[tag]
        stats["calls"] += 1
        if not query or not query.strip():
            stats["empty_queries"] += 1
            stats["errors"] += 1
            return ToolResult(
                text=format_tool_error(
                    tag, f"empty query; write the {tag} input between <{tag}> and </{tag}>."
                ),
                error="empty query",
            )

        if self.cache is not None and tool.cacheable:
            result, hit = await self.cache.get_or_compute(
                tag, tool.cache_key(query), lambda: self._run(tool, query)
            )
            if hit:
                stats["cache_hits"] += 1
                result = dataclasses.replace(result, cached=True)
        else:
            result = await self._run(tool, query)

        latency = time.monotonic() - start
        result = dataclasses.replace(result, latency_s=latency)
        stats["total_latency_s"] += latency
        stats["max_latency_s"] = max(stats["max_latency_s"], latency)
        if result.error is not None:
            stats["errors"] += 1
            if result.error == "timeout":
                stats["timeouts"] += 1
        return result

    async def _run(self, tool: Tool, query: str) -> ToolResult:
        async with self._get_semaphore(tool.tag):
            try:
                return await asyncio.wait_for(self._attempts(tool, query), timeout=self.timeout_s)
            except asyncio.TimeoutError:
                logger.warning("tool %s timed out after %.1f s", tool.tag, self.timeout_s)
                return ToolResult(
                    text=format_tool_error(
                        tool.tag, f"execution timed out after {self.timeout_s:g} seconds."
                    ),
                    error="timeout",
                )

    async def _attempts(self, tool: Tool, query: str) -> ToolResult:
        stats = self._stats[tool.tag]
        delay = self.backoff_s
        for attempt in range(self.retries + 1):
            try:
                result = await tool.execute(query)
            except TransportError as exc:
                stats["transport_failures"] += 1
                reason = redact_url(str(exc))
                if attempt == self.retries:
                    logger.warning(
                        "tool %s: transport error after %d attempts: %s", tool.tag, attempt + 1, reason
                    )
                    return ToolResult(
                        text=format_tool_error(
                            tool.tag, f"backend unavailable after {attempt + 1} attempts ({reason})."
                        ),
                        error="transport",
                    )
                stats["retries"] += 1
                logger.info(
                    "tool %s: transport error (%s); retry %d/%d in %.2f s",
                    tool.tag, reason, attempt + 1, self.retries, delay,
                )
                await asyncio.sleep(delay)
                delay = min(delay * 2.0, self.backoff_max_s)
                continue
            except ToolError as exc:
                return ToolResult(text=format_tool_error(tool.tag, str(exc)), error="tool error")
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # a tool bug must not kill the rollout; the model sees a message
                logger.exception("tool %s raised on query %.80r", tool.tag, query)
                return ToolResult(
                    text=format_tool_error(tool.tag, f"{type(exc).__name__}: {exc}"),
                    error="exception",
                )
            if not isinstance(result, ToolResult):
                raise TypeError(
                    f"{type(tool).__name__}.execute returned {type(result).__name__}; "
                    "it must return a ToolResult"
                )
            return result
        raise AssertionError("unreachable")

    def stats(self) -> dict[str, dict]:
        """Per-tool counters (copies), plus the cache's own stats under the key `cache`."""
        out = {tag: dict(values) for tag, values in self._stats.items()}
        for values in out.values():
            values["avg_latency_s"] = values["total_latency_s"] / values["calls"] if values["calls"] else 0.0
        if self.cache is not None:
            out["cache"] = self.cache.stats()
        return out

    def metrics(self, prefix: str = "tools/") -> dict[str, float]:
        """The stats flattened to `tools/<tag>/<counter>` floats for the logger."""
        flat: dict[str, float] = {}
        for tag, values in self.stats().items():
            for name, value in values.items():
                flat[f"{prefix}{tag}/{name}"] = float(value)
        return flat

    async def close(self) -> None:
        for tool in self.tools.values():
            await tool.close()
        if self.cache is not None:
            self.cache.close()

