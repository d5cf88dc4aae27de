"""Build the tool executor from the plain `tools` config section.

`build_tools(cfg)` takes a dict (the typed config dataclass converts to one) and returns a
`ToolExecutor`. Accepted keys, with defaults; any other key is an error:

```yaml
tools:
  max_concurrency: 8       # tool calls running at once in this process
  timeout_s: 30            # per call, retries included; the model gets an error result after it
  retries: 2               # extra attempts after a transport error only (0 = none)
  backoff_s: 0.5           # first retry delay; doubles each retry
  backoff_max_s: 8.0
  python:                  # omit, null or {enabled: false} to disable
    enabled: true
    tag: python
    sandbox: required      # required: refuse to start without the bubblewrap sandbox; best_effort: fall back, warn
    timeout_s: 10          # wall clock per run (keep below tools.timeout_s)
    cpu_s: null            # CPU seconds of the whole run (meter) and per process (RLIMIT_CPU); null = ceil(timeout_s)
    memory_mb: 2048        # memory of the whole run (cgroup or meter) and per process (RLIMIT_AS)
    file_size_mb: 32       # largest file (RLIMIT_FSIZE)
    disk_mb: 64            # size of the run's scratch tmpfs /tmp
    nproc: 32              # processes/threads the run may add (RLIMIT_NPROC in its own user namespace)
    max_output_chars: 4000 # text shown to the model
    max_capture_bytes: 1048576  # output read before the run is stopped
    user: nobody           # account the code runs as when the trainer runs as root
    python_executable: null     # null = the trainer's base interpreter (stdlib only)
    isolate_network: true
    cgroup: auto           # auto | required | off: a memory cgroup per run
    cgroup_parent: null    # a delegated cgroup v2 directory to create the runs' cgroups in
    auto_print: true
  search:                  # omit, null or {enabled: false} to disable
    enabled: true
    tag: search
    backend: local         # local | http | web
    topk: 3
    result_chars: 1000
    corpus: path/to/corpus.jsonl    # local
    url: http://host:8000/retrieve  # http
    index_version: null             # http: names the index behind the url; part of the cache key
    timeout_s: 30                   # http / web request timeout
    api_key_env: BRIGHT_DATA_API_KEY  # web; the key itself is never in the config
    zone: null                        # web
    location: us                      # web
  cache:                   # omit or null for no cache
    path: runs/x/tool_cache.sqlite
    busy_timeout_s: 30
```
"""

from __future__ import annotations

from typing import Any, Optional

from megatron_arpo.tools.base import Tool, ToolExecutor

_TOP_KEYS = {"max_concurrency", "timeout_s", "retries", "backoff_s", "backoff_max_s", "python", "search", "cache"}
_PYTHON_KEYS = {
    "enabled", "tag", "sandbox", "timeout_s", "cpu_s", "memory_mb", "file_size_mb", "disk_mb", "nproc",
    "max_output_chars", "max_capture_bytes", "user", "python_executable", "isolate_network", "cgroup",
    "cgroup_parent", "auto_print",
}
_SEARCH_KEYS = {
    "enabled", "tag", "backend", "topk", "result_chars", "corpus", "url", "index_version", "timeout_s",
    "api_key_env", "zone", "location",
}
_CACHE_KEYS = {"path", "busy_timeout_s"}
SEARCH_BACKENDS = ("local", "http", "web")


def _check_keys(section: str, cfg: dict, allowed: set) -> None:
    if not isinstance(cfg, dict):
        raise ValueError(f"{section} must be a mapping, got {type(cfg).__name__}: {cfg!r}")
    unknown = sorted(set(cfg) - allowed)
    if unknown:
        raise ValueError(f"{section}: unknown keys {unknown}; allowed keys are {sorted(allowed)}")


def _enabled(section: Any) -> bool:
    return section is not None and section is not False and (
        not isinstance(section, dict) or section.get("enabled", True)
    )


def build_python_tool(cfg: dict) -> Tool:
    from megatron_arpo.tools.python_sandbox import PythonSandboxTool

    _check_keys("tools.python", cfg, _PYTHON_KEYS)
    kwargs = {k: v for k, v in cfg.items() if k != "enabled"}
    return PythonSandboxTool(**kwargs)


def build_search_tool(cfg: dict) -> Tool:
    from megatron_arpo.tools import search

    _check_keys("tools.search", cfg, _SEARCH_KEYS)
    backend_name = cfg.get("backend", "local")
    if backend_name == "local":
        if not cfg.get("corpus"):
            raise ValueError("tools.search.corpus is required for backend 'local'; set it to a JSONL corpus path")
        backend = search.LocalBM25Backend(cfg["corpus"])
    elif backend_name == "http":
        if not cfg.get("url"):
            raise ValueError("tools.search.url is required for backend 'http' (e.g. http://127.0.0.1:8000/retrieve)")
        backend = search.HttpRetrieverBackend(cfg["url"], timeout_s=cfg.get("timeout_s", 30.0),
                                              index_version=cfg.get("index_version"))
    elif backend_name == "web":
        backend = search.WebSearchBackend(
            api_key_env=cfg.get("api_key_env", "BRIGHT_DATA_API_KEY"),
            zone=cfg.get("zone"),
            location=cfg.get("location", "us"),
            timeout_s=cfg.get("timeout_s", 60.0),
        )
    else:
        raise ValueError(f"tools.search.backend={backend_name!r}; allowed values are {list(SEARCH_BACKENDS)}")
    return search.SearchTool(
        backend,
        topk=cfg.get("topk", 3),
        result_chars=cfg.get("result_chars", 1000),
        tag=cfg.get("tag", "search"),
    )


def build_tools(cfg: Optional[dict]) -> ToolExecutor:
    """The executor for the `tools` config section (see the module docstring for the keys)."""
    cfg = dict(cfg or {})
    _check_keys("tools", cfg, _TOP_KEYS)
    tools: list[Tool] = []
    if _enabled(cfg.get("python")):
        tools.append(build_python_tool(cfg["python"] if isinstance(cfg["python"], dict) else {}))
    if _enabled(cfg.get("search")):
        tools.append(build_search_tool(cfg["search"] if isinstance(cfg["search"], dict) else {}))
    cache = None
    if cfg.get("cache"):
        from megatron_arpo.tools.cache import ToolCache

        _check_keys("tools.cache", cfg["cache"], _CACHE_KEYS)
        if not cfg["cache"].get("path"):
            raise ValueError("tools.cache.path is required when tools.cache is set")
        cache = ToolCache(cfg["cache"]["path"], busy_timeout_s=cfg["cache"].get("busy_timeout_s", 30.0))
    return ToolExecutor(
        tools,
        cache=cache,
        max_concurrency=cfg.get("max_concurrency", 8),
        timeout_s=cfg.get("timeout_s", 30.0),
        retries=cfg.get("retries", 2),
        backoff_s=cfg.get("backoff_s", 0.5),
        backoff_max_s=cfg.get("backoff_max_s", 8.0),
    )
