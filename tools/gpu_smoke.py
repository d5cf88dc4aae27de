"""`make gpu-smoke`: one prepared run that proves the actor on a real GPU and writes a verdict.

``python tools/gpu_smoke.py --out DIR [--scenarios a,b] [--wheels DIR]`` on a machine with one CUDA GPU:
installs the pinned megatron-core and packaging wheels from ``--wheels`` (``make wheels`` fills it; no
network) into ``--site``, builds its checkpoints in ``--work``, runs each scenario of
``tools/gpu_smoke_scenarios.py`` in its own process under its own time limit (a hang or a crash is
reported and the next scenario runs), and writes ``DIR/gpu_smoke.json`` and ``DIR/gpu_smoke.md``.
Exit 0 when every scenario passed or was skipped, 1 otherwise, 2 on bad input (no GPU, no wheels).

``--dry-run`` runs the same scenarios without a GPU: on the CPU with gloo at reduced width, and on fake
CUDA (``megatron_arpo.fake_cuda.harness``) at the GPU's shapes where a scenario needs the device; what
cannot be measured there (allocator peaks, timings, CUDA IPC) is reported with the reason.
See docs/gpu_smoke.md.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import traceback
import zipfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TOOLS = Path(__file__).resolve().parent
DEFAULT_WHEELS = REPO / ".cache" / "gpu-wheels"
DEFAULT_SITE = REPO / ".cache" / "gpu-site"
# megatron-core and its one hard dependency; psutil: Megatron's checkpoint writer process needs it (without it
# the save hangs), and the GPU machine need not have it.
PINNED = ("megatron_core-0.16.1", "packaging-", "psutil-")
# Seconds per scenario (GPU, dry run); the run's --budget-s caps them as it is spent.
LIMITS = {"numerics": (180, 150), "packed": (90, 90), "update": (75, 75), "resume": (120, 120),
          "conversion": (90, 90), "offload": (75, 75), "ipc": (90, 90), "memory": (300, 240),
          "throughput": (120, 150)}
INJECTED = ("_fail", "_raise", "_hang", "_crash")  # tests only: a failing check, an exception, a crash, a hang
INJECTED_LIMIT = 20
DRY_DEVICE = {"memory": "fake", "throughput": "fake"}  # the rest run on the CPU (gloo) in the dry run
MIN_SCENARIO_S = 20


# ------------------------------------------------------------------------------------------- setup
def _fail(message: str) -> None:
    print(f"error: {message}", file=sys.stderr)
    sys.exit(2)


def _importable(module: str, site: Path | None) -> bool:
    path = os.pathsep.join(p for p in (str(site) if site else "", str(REPO)) if p)
    probe = subprocess.run([sys.executable, "-c", f"import {module}"], capture_output=True,
                           env={**os.environ, "PYTHONPATH": path})
    return probe.returncode == 0


def install_wheels(wheels: Path, site: Path) -> str:
    """The ``PINNED`` wheels from ``wheels`` into ``site`` (no index, no dependencies)."""
    found = sorted(p for p in wheels.glob("*.whl")) if wheels.is_dir() else []
    missing = [name for name in PINNED if not any(p.name.startswith(name) for p in found)]
    if missing:
        _fail(f"{wheels} lacks the wheels {missing}: run `make wheels` on a machine with network and carry "
              f"{wheels.relative_to(REPO) if wheels.is_relative_to(REPO) else wheels} to the GPU machine")
    site.mkdir(parents=True, exist_ok=True)
    pip = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-index", "--no-deps", "--upgrade",
                          "--target", str(site), *map(str, found)], capture_output=True, text=True)
    if pip.returncode == 0:
        return f"pip installed {[p.name for p in found]} into {site}"
    for wheel in found:  # no pip: a wheel is a zip of the files to install
        with zipfile.ZipFile(wheel) as archive:
            archive.extractall(site)
    return f"unpacked {[p.name for p in found]} into {site} (pip failed: {pip.stderr.strip()[-200:]})"


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, cwd=REPO, timeout=10)
        return out.stdout.strip() if out.returncode == 0 else "unknown"
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"


def environment(env: dict) -> dict:
    code = ("import json, torch\n"
            "info = {'torch': torch.__version__, 'cuda': torch.version.cuda, 'gpu': None}\n"
            "if torch.cuda.is_available():\n"
            "    p = torch.cuda.get_device_properties(0)\n"
            "    info.update(gpu=p.name, gpu_memory_bytes=p.total_memory, gpu_count=torch.cuda.device_count())\n"
            "from importlib import metadata\n"
            "for dist in ('megatron-core', 'transformers'):\n"
            "    try:\n"
            "        info[dist.replace('-', '_')] = metadata.version(dist)\n"
            "    except metadata.PackageNotFoundError:\n"
            "        info[dist.replace('-', '_')] = None\n"
            "print(json.dumps(info))\n")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    info = json.loads(proc.stdout.strip().splitlines()[-1]) if proc.returncode == 0 else {"error": proc.stderr[-500:]}
    status = _git("status", "--porcelain", "--untracked-files=no")
    return {**info, "python": platform.python_version(), "host": platform.node(),
            "commit": _git("rev-parse", "HEAD"), "dirty": None if status == "unknown" else bool(status)}


# --------------------------------------------------------------------------------------- scenarios
def run_scenario(name: str, ctx: dict, out: Path, limit: float, env: dict) -> dict:
    """``name`` in a fresh process (its own session: a timeout kills what it started too)."""
    result_file = out / "results" / f"{name}.json"
    log_file = out / "logs" / f"{name}.log"
    result_file.parent.mkdir(parents=True, exist_ok=True)
    log_file.parent.mkdir(parents=True, exist_ok=True)
    child_env = dict(env)
    if ctx["device"] == "fake":  # Megatron's torch.compile'd fused kernels run eagerly on fake tensors
        child_env["TORCHDYNAMO_DISABLE"] = "1"
    start = time.monotonic()
    with open(log_file, "w") as log:
        proc = subprocess.Popen([sys.executable, str(Path(__file__)), "--child", name, "--ctx", json.dumps(ctx),
                                 "--result", str(result_file)], stdout=log, stderr=subprocess.STDOUT, env=child_env,
                                cwd=REPO, start_new_session=True)
        try:
            code = proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            code = None
    seconds = round(time.monotonic() - start, 1)
    base = {"name": name, "device": ctx["device"], "seconds": seconds, "limit_s": limit,
            "log": str(log_file.relative_to(out))}
    if code is None:
        return {**base, "status": "timeout", "reason": f"did not finish within {limit:.0f} s (killed)",
                "checks": [], "numbers": {}, "notes": []}
    if not result_file.exists():
        tail = log_file.read_text(errors="replace").strip().splitlines()[-3:]
        return {**base, "status": "error", "reason": f"the process died with exit code {code}: " + " | ".join(tail),
                "checks": [], "numbers": {}, "notes": []}
    return {**base, **json.loads(result_file.read_text())}


def child_main(name: str, ctx_json: str, result_path: str) -> int:
    """Inside the scenario's process: run it and write its result (status, reason, checks, numbers)."""
    sys.path[:0] = [str(TOOLS), str(REPO)]
    import gpu_smoke_scenarios as sc

    ctx = sc.context_from(json.loads(ctx_json))
    ctx.work.mkdir(parents=True, exist_ok=True)
    result = sc.Result()
    fn = {**sc.SCENARIOS, **sc.INJECTED}[name]
    status, reason = None, ""
    try:
        fn(ctx, result)
    except sc.Skip as exc:
        status, reason = "skipped", str(exc)
    except BaseException as exc:
        status, reason = "error", f"{type(exc).__name__}: {exc}"
        result.note(traceback.format_exc())
    if status is None:
        verdicts = [c["ok"] for c in result.checks]
        if any(v is False for v in verdicts):
            status, reason = "failed", "; ".join(c["name"] for c in result.checks if c["ok"] is False)
        elif verdicts and all(v is None for v in verdicts):
            status, reason = "skipped", "; ".join(f"{c['name']}: {c['detail']}" for c in result.checks)
        elif not verdicts:
            status, reason = "error", "the scenario made no check"
        else:
            status = "passed"
            unmeasured = [c for c in result.checks if c["ok"] is None]
            reason = "; ".join(f"not measurable here: {c['name']} ({c['detail']})" for c in unmeasured)
    Path(result_path).write_text(json.dumps({"status": status, "reason": reason, "checks": result.checks,
                                             "numbers": result.numbers, "notes": result.notes}, default=str))
    return 0


# ----------------------------------------------------------------------------------------- reports
def markdown(report: dict) -> str:
    env = report["environment"]
    lines = [f"# GPU smoke report ({'dry run' if report['dry_run'] else 'GPU run'})", "",
             f"- date: {report['date']}", f"- card: {env.get('gpu') or 'none'}; torch {env.get('torch')} "
             f"(CUDA {env.get('cuda')}); megatron-core {env.get('megatron_core')}; transformers "
             f"{env.get('transformers')}; Python {env.get('python')}",
             f"- commit: {env.get('commit')}{' (uncommitted changes)' if env.get('dirty') else ''}",
             f"- setup: {report['setup']}", f"- wall time: {report['wall_s']} s; verdict: **{report['verdict']}**",
             "", "| scenario | status | device | seconds | reason |", "|---|---|---|---|---|"]
    for s in report["scenarios"]:
        reason = (s.get("reason") or "").replace("|", "/").replace("\n", " ")
        lines.append(f"| {s['name']} | {s['status']} | {s['device']} | {s['seconds']} | {reason[:300]} |")
    for s in report["scenarios"]:
        lines += ["", f"## {s['name']}: {s['status']}", ""]
        for c in s.get("checks", []):
            mark = {True: "pass", False: "FAIL", None: "n/a"}[c["ok"]]
            lines.append(f"- [{mark}] {c['name']}" + (f": {c['detail']}" if c["detail"] else ""))
        for key, value in s.get("numbers", {}).items():
            lines.append(f"- `{key}` = {json.dumps(value) if isinstance(value, (list, dict)) else value}")
        for note in s.get("notes", []):
            lines += ["", "```", note.strip()[-3000:], "```"] if "\n" in note else [f"- note: {note}"]
    return "\n".join(lines) + "\n"


def parse_args(argv):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true", help="no GPU: CPU and fake CUDA (make test runs this)")
    parser.add_argument("--out", type=Path, default=REPO / "outputs" / "gpu-smoke", help="report directory")
    parser.add_argument("--scenarios", default=",".join(LIMITS), help=f"comma list of {', '.join(LIMITS)}")
    parser.add_argument("--wheels", type=Path, default=DEFAULT_WHEELS, help="filled by `make wheels`")
    parser.add_argument("--site", type=Path, default=DEFAULT_SITE, help="where the wheels are installed")
    parser.add_argument("--work", type=Path, help="checkpoints and scratch (default: a temporary directory)")
    parser.add_argument("--budget-s", type=float, default=None, help="the whole run's seconds (default: 480 on a "
                        "GPU, unlimited in the dry run); each scenario's limit is capped by what is left")
    parser.add_argument("--limit-s", type=float, help="cap every scenario's time limit at this many seconds")
    parser.add_argument("--jobs", type=int, default=2, help="dry run only: scenarios run at once (a GPU runs one)")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    parser.add_argument("--ctx", help=argparse.SUPPRESS)
    parser.add_argument("--result", help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.child:
        return child_main(args.child, args.ctx, args.result)
    sys.path[:0] = [str(TOOLS), str(REPO)]
    names = list(dict.fromkeys(n.strip() for n in args.scenarios.split(",") if n.strip()))
    unknown = [n for n in names if n not in LIMITS and n not in INJECTED]
    if unknown or not names:
        _fail(f"unknown scenario(s) {unknown}; allowed: {', '.join(LIMITS)}")
    start = time.monotonic()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if args.dry_run:
        setup = "dry run: megatron-core from this environment (the wheels are for the GPU machine)"
        site = None
    else:
        import torch

        if not torch.cuda.is_available():
            print("error: no CUDA GPU is visible (torch.cuda.is_available() is False); run on the GPU machine, "
                  "or use --dry-run here", file=sys.stderr)
            return 2
        site = args.site
        setup = install_wheels(args.wheels, site) if not _importable("megatron.core, psutil", None) else \
            "megatron-core and psutil already importable; wheels not installed"
    paths = [str(site)] if site else []
    env["PYTHONPATH"] = os.pathsep.join([*paths, str(REPO), str(TOOLS), *filter(None, [os.environ.get("PYTHONPATH")])])
    args.out.mkdir(parents=True, exist_ok=True)
    work = args.work or Path(tempfile.mkdtemp(prefix="gpu-smoke-"))
    budget = args.budget_s if args.budget_s is not None else (None if args.dry_run else 480.0)
    report = {"format": "megatron-arpo-gpu-smoke", "version": 1, "dry_run": args.dry_run,
              "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "environment": environment(env), "setup": setup, "scenarios": []}

    def scenario(name: str) -> dict:
        limit = INJECTED_LIMIT if name.startswith("_") else LIMITS[name][1 if args.dry_run else 0]
        limit = min(limit, args.limit_s or limit)
        device = "cuda" if not args.dry_run else DRY_DEVICE.get(name, "cpu")
        if budget is not None:
            left = budget - (time.monotonic() - start)
            if left < MIN_SCENARIO_S:
                return {"name": name, "device": device, "status": "skipped", "seconds": 0,
                        "reason": f"the run's time budget ({budget:.0f} s, --budget-s) is spent",
                        "checks": [], "numbers": {}, "notes": []}
            limit = min(limit, left)
        ctx = {"device": device, "dry_run": args.dry_run, "work": str(work), "repo": str(REPO)}
        result = run_scenario(name, ctx, args.out, limit, env)
        print(f"{name}: {result['status']} ({result['seconds']} s) {result.get('reason', '')[:200]}", flush=True)
        return result

    # One device, one scenario at a time on a GPU; the dry run may overlap them (most of a CPU scenario's
    # time is single-threaded imports and setup).
    jobs = 1 if not args.dry_run else max(1, args.jobs)
    # Overlapped, the longest (fake CUDA, several processes) start first; the report keeps the given order.
    order = names if jobs == 1 else sorted(names, key=lambda n: DRY_DEVICE.get(n) != "fake")
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        done = dict(zip(order, pool.map(scenario, order)))
    report["scenarios"] = [done[n] for n in names]
    if args.work is None:  # checkpoints of several GB on a GPU run
        shutil.rmtree(work, ignore_errors=True)
    bad = [s["name"] for s in report["scenarios"] if s["status"] not in ("passed", "skipped")]
    report["verdict"] = "pass" if not bad else f"FAIL ({', '.join(bad)})"
    report["wall_s"] = round(time.monotonic() - start, 1)
    (args.out / "gpu_smoke.json").write_text(json.dumps(report, indent=1, default=str))
    (args.out / "gpu_smoke.md").write_text(markdown(report))
    print(f"verdict: {report['verdict']} in {report['wall_s']} s; report: {args.out / 'gpu_smoke.md'}")
    return 0 if not bad else 1


if __name__ == "__main__":
    sys.exit(main())
