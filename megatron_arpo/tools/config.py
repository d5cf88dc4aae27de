"""The ``tools`` section of an experiment config: the typed options of the tool executor and of each tool.

These dataclasses are the only definition of the tools' settings and their defaults: the experiment config
(:mod:`megatron_arpo.config_schema`) composes :class:`ToolsSection`, and
:func:`megatron_arpo.tools.registry.build_tools` builds the executor from it (or from the same keys in a
plain mapping, checked against these fields). The config reference in docs/configuration.md lists every key.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional

from megatron_arpo.config_field import setting

MAX_CAPTURE_BYTES = 64 << 20  # held in the trainer's memory per concurrent call


@dataclass(frozen=True)
class PythonToolSection:
    enabled: bool = setting(True)
    tag: str = setting("python", help="the <tag>...</tag> the model writes")
    max_concurrency: Optional[int] = setting(None, ge=1, help="calls of this tool running at once; null = tools.max_concurrency")
    sandbox: Literal["required", "best_effort"] = setting(
        "required", help="required: refuse to start unless every run gets the bubblewrap sandbox; best_effort: "
        "run code without isolation when it is unavailable (warns at every start)")
    timeout_s: float = setting(10.0, gt=0, help="wall clock per run (keep below tools.timeout_s)")
    cpu_s: Optional[int] = setting(None, ge=1, help="CPU seconds of the whole run and of each process; null = ceil(timeout_s)")
    memory_mb: int = setting(2048, ge=16, help="memory of the whole run (cgroup, else a meter) and of each process")
    file_size_mb: int = setting(32, ge=1, help="largest file the code may write (RLIMIT_FSIZE)")
    disk_mb: int = setting(64, ge=1, help="size of the run's private scratch tmpfs (/tmp, also HOME)")
    nproc: int = setting(32, ge=1, help="processes/threads the whole run may add (RLIMIT_NPROC in its user namespace)")
    max_output_chars: int = setting(4000, ge=1, help="output shown to the model is truncated beyond this")
    max_capture_bytes: int = setting(1048576, ge=1, le=MAX_CAPTURE_BYTES, help="output read before the run is stopped")
    user: str = setting("nobody", help="account the code runs as when the trainer runs as root")
    python_executable: Optional[str] = setting(None, help="null = the trainer's base interpreter (stdlib only); a venv "
                                          "made for the model's code exposes its packages read-only")
    isolate_network: bool = setting(True, help="false shares the host network with the code")
    cgroup: Literal["auto", "required", "off"] = setting("auto", help="a memory cgroup per run: auto = when one can be had")
    cgroup_parent: Optional[str] = setting(None, help="delegated cgroup v2 dir (memory in its subtree_control) for the runs")
    auto_print: bool = setting(True, help="print the value of a trailing expression, notebook-style")


@dataclass(frozen=True)
class SearchToolSection:
    enabled: bool = setting(True)
    tag: str = setting("search")
    max_concurrency: Optional[int] = setting(None, ge=1, help="calls of this tool running at once; null = tools.max_concurrency")
    backend: Literal["local", "http", "web"] = setting("local")
    topk: int = setting(3, ge=1, help="passages returned per query")
    result_chars: int = setting(1000, ge=1, help="per-passage truncation")
    corpus: Optional[str] = setting(None, help="local: JSONL corpus for BM25")
    url: Optional[str] = setting(None, help="http: retriever endpoint")
    index_version: Optional[str] = setting(None, help="http: a name for the index behind url; part of the tool-cache "
                                      "key, change it when the index changes")
    timeout_s: float = setting(30.0, gt=0, help="http/web request timeout")  # one default (web used 60 s before)
    max_response_bytes: int = setting(16 << 20, ge=1024, le=1 << 30, help="http/web: largest answer body read; a "
                                      "larger one is a tool error")
    api_key_env: str = setting("BRIGHT_DATA_API_KEY", help="web: NAME of the env var holding the key")
    zone: Optional[str] = setting(None, help="web: Bright Data zone")
    location: str = setting("us", help="web: country code of the search market")


@dataclass(frozen=True)
class ToolCacheSection:
    path: Optional[str] = setting(None, help="SQLite file; null = <run_dir>/tool_cache/tool_cache.sqlite, snapshotted into each checkpoint")
    busy_timeout_s: float = setting(30.0, gt=0)


@dataclass(frozen=True)
class ToolsSection:
    max_concurrency: int = setting(8, ge=1, help="calls of one tool running at once per rollout process (each tool has its own limit: tools.<tool>.max_concurrency, default this)")
    timeout_s: float = setting(30.0, gt=0, help="enforced limit on one call, retries included")
    retries: int = setting(2, ge=0, help="extra attempts after a transport error only (empty output is valid)")
    backoff_s: float = setting(0.5, ge=0, help="first retry delay; doubles each retry")
    backoff_max_s: float = setting(8.0, ge=0)
    python: PythonToolSection = setting(factory=PythonToolSection)
    search: SearchToolSection = setting(factory=SearchToolSection)
    cache: Optional[ToolCacheSection] = setting(factory=ToolCacheSection, help="null disables the cache")

    @property
    def enabled_tags(self) -> list[str]:
        return [t.tag for t in (self.python, self.search) if t.enabled]
