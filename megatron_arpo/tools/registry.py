"""Build the tool executor from the ``tools`` config section.

``build_tools(cfg)`` takes the typed :class:`megatron_arpo.tools.config.ToolsSection` (what the experiment
config holds) or a plain mapping with the same keys (``cfg.to_dict()["tools"]``, or a hand-written dict in
tests and scripts) and returns a ``ToolExecutor``. The keys and their defaults are those dataclasses' fields
and nothing else: an unknown key is an error listing the allowed ones, a missing key takes the section's
default. In a mapping, ``python``/``search`` omitted, ``null``, ``false`` or ``{enabled: false}`` disables
that tool; ``cache`` omitted or ``null`` means no cache (and a cache needs its ``path``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from megatron_arpo.tools.base import Tool, ToolExecutor
from megatron_arpo.tools.config import PythonToolSection, SearchToolSection, ToolCacheSection, ToolsSection

SEARCH_BACKENDS = ("local", "http", "web")


def _section(cls: type, data: Any, where: str) -> Any:
    """``data`` as a ``cls`` section: the instance itself, or a mapping whose keys are ``cls``'s fields."""
    if isinstance(data, cls):
        return data
    if not isinstance(data, Mapping):
        raise ValueError(f"{where} must be a mapping, got {type(data).__name__}: {data!r}")
    allowed = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - allowed)
    if unknown:
        raise ValueError(f"{where}: unknown keys {unknown}; allowed keys are {sorted(allowed)}")
    return cls(**data)


def _tool_section(cls: type, data: Any, where: str) -> Any:
    """A tool's section; a mapping that leaves the tool out (or gives null/false) disables it."""
    if data is None or data is False:
        return cls(enabled=False)
    return _section(cls, {} if data is True else data, where)


def tools_section(cfg: Any) -> ToolsSection:
    """The typed ``tools`` section from a ``ToolsSection``, a mapping of its keys, or None (no tools)."""
    if isinstance(cfg, ToolsSection):
        return cfg
    if cfg is None:
        cfg = {}
    if not isinstance(cfg, Mapping):
        raise ValueError(f"tools must be a mapping, got {type(cfg).__name__}: {cfg!r}")
    nested = {"python": _tool_section(PythonToolSection, cfg.get("python"), "tools.python"),
              "search": _tool_section(SearchToolSection, cfg.get("search"), "tools.search"),
              "cache": _section(ToolCacheSection, cfg["cache"], "tools.cache") if cfg.get("cache") else None}
    return _section(ToolsSection, {**cfg, **nested}, "tools")


def _kwargs(section: Any, *skip: str) -> dict[str, Any]:
    return {f.name: getattr(section, f.name) for f in dataclasses.fields(section) if f.name not in skip}


def build_python_tool(cfg: PythonToolSection | Mapping[str, Any]) -> Tool:
    # deferred: pulls in ctypes, which this module's importers need not load
    from megatron_arpo.tools.python_sandbox import PythonSandboxTool

    return PythonSandboxTool(**_kwargs(_section(PythonToolSection, cfg, "tools.python"), "enabled", "max_concurrency"))


def build_search_tool(cfg: SearchToolSection | Mapping[str, Any]) -> Tool:
    # deferred: pulls in urllib, which this module's importers need not load
    from megatron_arpo.tools import search

    cfg = _section(SearchToolSection, cfg, "tools.search")
    if cfg.backend == "local":
        if not cfg.corpus:
            raise ValueError("tools.search.corpus is required for backend 'local'; set it to a JSONL corpus path")
        backend = search.LocalBM25Backend(cfg.corpus)
    elif cfg.backend == "http":
        if not cfg.url:
            raise ValueError("tools.search.url is required for backend 'http' (e.g. http://127.0.0.1:8000/retrieve)")
        backend = search.HttpRetrieverBackend(cfg.url, timeout_s=cfg.timeout_s, index_version=cfg.index_version,
                                              max_response_bytes=cfg.max_response_bytes)
    elif cfg.backend == "web":
        backend = search.WebSearchBackend(api_key_env=cfg.api_key_env, zone=cfg.zone, location=cfg.location,
                                          timeout_s=cfg.timeout_s, max_response_bytes=cfg.max_response_bytes)
    else:
        raise ValueError(f"tools.search.backend={cfg.backend!r}; allowed values are {list(SEARCH_BACKENDS)}")
    return search.SearchTool(backend, topk=cfg.topk, result_chars=cfg.result_chars, tag=cfg.tag)


def build_tools(cfg: ToolsSection | Mapping[str, Any] | None) -> ToolExecutor:
    """The executor for the ``tools`` config section (see the module docstring)."""
    section = tools_section(cfg)
    tools: list[Tool] = []
    if section.python.enabled:
        tools.append(build_python_tool(section.python))
    if section.search.enabled:
        tools.append(build_search_tool(section.search))
    cache = None
    if section.cache is not None:
        # deferred: pulls in sqlite3, which this module's importers need not load
        from megatron_arpo.tools.cache import ToolCache

        if not section.cache.path:
            raise ValueError("tools.cache.path is required when tools.cache is set")
        cache = ToolCache(section.cache.path, busy_timeout_s=section.cache.busy_timeout_s)
    limits = {tool.tag: tool.max_concurrency for tool in (section.python, section.search)
              if tool.enabled and tool.max_concurrency is not None}
    return ToolExecutor(tools, cache=cache, tool_concurrency=limits, **_kwargs(section, "python", "search", "cache"))
