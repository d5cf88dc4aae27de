"""Tools the policy calls during rollouts and evaluation: a sandboxed Python interpreter and search.

Modules (each imports its own dependencies; importing this package imports nothing):

- `base`: `Tool`, `ToolResult`, `TransportError`/`ToolError`, and `ToolExecutor` (bounded concurrency,
  enforced timeouts, retries on transport errors only, empty-query results, per-tool stats).
- `python_sandbox`: `PythonSandboxTool`, one isolated, limited bubblewrap run per call;
  `containment` builds the sandbox (namespaces, read-only interpreter view, rlimits, best_effort fallback),
  `run_limits` bounds a run as a whole (memory cgroup, CPU/memory meter) and ends it (its init's pidfd),
  `seccomp` compiles the run's system-call filter.
- `search`: `SearchTool` with the `local` (bm25s), `http` (FlashRAG retriever) and `web` (Bing via
  Bright Data) backends, and the query normalisation used as cache key.
- `cache`: `ToolCache`, a SQLite cache shared across processes, with in-flight de-duplication and
  checkpoint export/import.
- `registry`: `build_tools(cfg)` builds a `ToolExecutor` from the `tools` config section.

Usage from the rollout scheduler: `result = await executor.execute("python", code)`.
"""
