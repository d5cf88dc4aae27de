"""Python-tool latency: the bubblewrap sandbox (issue 14) against the previous launcher, side by side.

The baseline is the implementation this issue replaced (`_sandbox_launcher.py` + its
`python_sandbox.py`), loaded from git history into a temporary directory and run in the same process,
interleaved with the current tool, so both see the same machine load. Measured:
1. latency of one call of a trivial snippet (`1+1`), sequential, median and p90 over `--calls`;
2. executions per second with 8 calls in flight at once, `--rounds` rounds of `--calls` calls.
The current tool is measured with its default cgroup setting (`auto`) and with `cgroup: off`.
`--tools-ref REF` adds the bubblewrap tool as it was at REF (its `megatron_arpo/tools` modules loaded
from git under another package name), interleaved with the others; ratios to it are printed too.

    python benchmarks/sandbox.py [--calls 40] [--rounds 3] [--baseline-ref REF] [--tools-ref REF]
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
LAUNCHER = "megatron_arpo/tools/_sandbox_launcher.py"


def baseline_ref() -> str:
    """The last commit that still had the old launcher (the parent of the commit that removed it)."""
    removed = subprocess.run(["git", "log", "-n1", "--diff-filter=D", "--format=%H", "--", LAUNCHER], cwd=REPO,
                             capture_output=True, text=True, check=True).stdout.strip()
    if not removed:
        raise SystemExit(f"{LAUNCHER} was never removed in this history; pass --baseline-ref")
    return removed + "^"


def load_baseline(ref: str, directory: str):
    for path, name in ((LAUNCHER, "_sandbox_launcher.py"),
                       ("megatron_arpo/tools/python_sandbox.py", "baseline_python_sandbox.py")):
        text = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=REPO, capture_output=True, text=True,
                              check=True).stdout
        Path(directory, name).write_text(text)
    spec = importlib.util.spec_from_file_location("baseline_python_sandbox",
                                                  os.path.join(directory, "baseline_python_sandbox.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def load_tools_at(ref: str, directory: str):
    """`PythonSandboxTool` of `megatron_arpo/tools` at `ref`, as package `tools_at_ref` (other imports are
    taken from this checkout)."""
    package = Path(directory, "tools_at_ref")
    package.mkdir()
    names = subprocess.run(["git", "ls-tree", "--name-only", ref, "megatron_arpo/tools/"], cwd=REPO,
                           capture_output=True, text=True, check=True).stdout.split()
    for path in names:
        if path.endswith(".py"):
            text = subprocess.run(["git", "show", f"{ref}:{path}"], cwd=REPO, capture_output=True, text=True,
                                  check=True).stdout
            Path(package, Path(path).name).write_text(text.replace("megatron_arpo.tools.", "tools_at_ref."))
    sys.path.insert(0, directory)
    return importlib.import_module("tools_at_ref.python_sandbox")


async def one_call(tool) -> float:
    start = time.perf_counter()
    result = await tool.execute("1+1")
    if result.text != "2":
        raise RuntimeError(f"{type(tool).__module__}: unexpected result {result}")
    return time.perf_counter() - start


async def latencies(tools: dict, calls: int) -> dict[str, list[float]]:
    out = {name: [] for name in tools}
    for _ in range(calls):
        for name, tool in tools.items():  # interleaved: every tool sees the same load
            out[name].append(await one_call(tool))
    return out


async def throughput(tool, calls: int, concurrency: int = 8) -> float:
    semaphore = asyncio.Semaphore(concurrency)

    async def bounded():
        async with semaphore:
            await one_call(tool)

    start = time.perf_counter()
    await asyncio.gather(*(bounded() for _ in range(calls)))
    return calls / (time.perf_counter() - start)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--calls", type=int, default=40)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--baseline-ref", default=None)
    parser.add_argument("--tools-ref", default=None, help="also measure the bubblewrap tool as it was at this commit")
    args = parser.parse_args()

    from megatron_arpo.tools.python_sandbox import PythonSandboxTool

    ref = args.baseline_ref or baseline_ref()
    with tempfile.TemporaryDirectory(prefix="arpo_bench_baseline_") as directory:
        baseline = load_baseline(ref, directory)
        tools = {
            "previous launcher": baseline.PythonSandboxTool(timeout_s=10),
            "bubblewrap": PythonSandboxTool(timeout_s=10),
            "bubblewrap, cgroup off": PythonSandboxTool(timeout_s=10, cgroup="off"),
        }
        if args.tools_ref:
            at_ref = load_tools_at(args.tools_ref, directory)
            tools[f"bubblewrap at {args.tools_ref}"] = at_ref.PythonSandboxTool(timeout_s=10)
            tools[f"bubblewrap at {args.tools_ref}, cgroup off"] = at_ref.PythonSandboxTool(timeout_s=10, cgroup="off")
        print(f"baseline: {ref} ({subprocess.run(['git', 'rev-parse', '--short', ref], cwd=REPO, capture_output=True, text=True).stdout.strip()})")
        print(f"sandbox: {tools['bubblewrap'].isolation['description']}; memory: {tools['bubblewrap'].isolation['memory']}")
        print(f"load average before: {os.getloadavg()[0]:.1f}")

        async def run_all():
            await latencies(tools, 3)  # warm-up
            lat = await latencies(tools, args.calls)
            rates = {name: [] for name in tools}
            for _ in range(args.rounds):
                for name, tool in tools.items():
                    rates[name].append(await throughput(tool, args.calls))
            return lat, rates

        lat, rates = asyncio.run(run_all())
    print(f"load average after: {os.getloadavg()[0]:.1f}")
    base_median = statistics.median(lat["previous launcher"])
    base_rate = statistics.median(rates["previous launcher"])
    print("\n| implementation | latency median ms | p90 ms | x previous | executions/s at 8 concurrent | x previous |")
    print("|---|---|---|---|---|---|")
    for name in tools:
        values = sorted(lat[name])
        median = statistics.median(values)
        p90 = values[int(0.9 * (len(values) - 1))]
        rate = statistics.median(rates[name])
        print(f"| {name} | {median * 1e3:.1f} | {p90 * 1e3:.1f} | {median / base_median:.2f} | {rate:.1f} | "
              f"{rate / base_rate:.2f} |")
    if args.tools_ref:
        for suffix in ("", ", cgroup off"):
            then, now = f"bubblewrap at {args.tools_ref}{suffix}", f"bubblewrap{suffix}"
            print(f"{now} / {then}: latency {statistics.median(lat[now]) / statistics.median(lat[then]):.2f}, "
                  f"executions/s {statistics.median(rates[now]) / statistics.median(rates[then]):.2f}")
    ratio = statistics.median(lat["bubblewrap"]) / base_median
    print(f"\nbubblewrap / previous launcher latency: {ratio:.2f} (target <= 2: {'met' if ratio <= 2 else 'NOT met'})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
