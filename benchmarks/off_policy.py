"""Off-policy vs sync training speed (issue 26): trained tokens/s and steps/hour with slow search tools.

Every run is a ``megatron-arpo train`` subprocess of configs/demo.yaml on the same separate resources
(``trainer.placement: separate``: one Megatron actor rank on gloo, one vLLM CPU engine, a local Ray), from
the demo's SFT model, which calls tools. The SFT model comes from the demo's own ``data,sft`` stages
(megatron_arpo/demo.py), built once under ``<work-dir>/demo`` and reused by later invocations.

The search tool is slow on purpose: the benchmark serves the demo corpus itself, with the project's BM25
(``LocalBM25Backend``), from a threaded HTTP retriever on 127.0.0.1 that sleeps a fixed latency before
each answer (the FlashRAG ``POST /retrieve`` format that ``HttpRetrieverBackend`` speaks); the tool cache
is off, so every call pays it. The python tool runs as usual (no injected latency).

Modes: ``sync`` (``trainer.mode: sync``), ``k1``/``k2`` (``off_policy`` with ``rollout.max_staleness`` 1/2),
``k1-inflight``/``k2-inflight`` (the same with ``rollout.in_flight_updates``: batch calls side by side and
through the weight syncs), alternated within each repeat. ``--search-concurrency`` sets
``tools.search.max_concurrency`` in every mode alike (the retriever is a remote service; the demo's
client-side limit of 4 makes the tool pool, not the engine, the bottleneck of every mode). Per run, from its metrics.jsonl: tokens/s = sum of ``actor/tokens`` over the
sum of ``time/step_s`` (first step's start to last step's end; start-up, the final checkpoint excluded);
engine and actor idle shares from ``offpolicy/*``, or in sync mode from the phase timers (engines idle
outside ``time/rollout_s``, the actor idle inside it).

    python benchmarks/off_policy.py [--steps 10 --latencies 1,3 --modes sync,k1,k1-inflight --repeats 3
                                     --search-concurrency 16 --json out.json --work-dir runs/bench-off-policy]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Iterable, Mapping, Sequence

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from megatron_arpo.data.demo_tasks import DEFAULT_SFT_TOOL_FRACTION  # noqa: E402
from megatron_arpo.demo import Demo  # noqa: E402
from megatron_arpo.tools.search import LocalBM25Backend  # noqa: E402

CONFIG = "configs/demo.yaml"
MODES = {"sync": ["trainer.mode=sync"],
         "k1": ["trainer.mode=off_policy", "rollout.max_staleness=1"],
         "k2": ["trainer.mode=off_policy", "rollout.max_staleness=2"],
         "k1-inflight": ["trainer.mode=off_policy", "rollout.max_staleness=1", "rollout.in_flight_updates=true"],
         "k2-inflight": ["trainer.mode=off_policy", "rollout.max_staleness=2", "rollout.in_flight_updates=true"]}
# Equal in every mode: separate pools, nothing outside the N steps (validation, HF export), no tool cache.
COMMON_SETS = ("trainer.placement=separate", "trainer.actor_devices=1", "trainer.rollout_devices=1",
               "launcher.num_cpus=2", "trainer.val_every=0", "trainer.val_before_train=false",
               "trainer.save_every=0", "trainer.export_hf_at_end=false", "tools.cache=null",
               "tools.search.backend=http", "logging.wandb.mode=disabled")
STATS = ("tokens_per_s", "steps_per_hour", "engine_idle", "actor_idle")


class LatencyRetriever:
    """A FlashRAG-style retrieval server over a JSONL corpus (BM25) that answers after ``latency_s``."""

    def __init__(self, corpus: str | Path, latency_s: float):
        self.backend = LocalBM25Backend(str(corpus))
        self.backend.ensure_index()
        self.latency_s = float(latency_s)
        self.requests = 0
        self._count_lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="latency-retriever", daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/retrieve"

    def answer(self, request: Mapping) -> dict:
        """``{"queries": [...], "topk": k, "return_scores": b}`` -> ``{"result": [[hit, ...], ...]}``."""
        topk = int(request.get("topk", 3))
        scores = bool(request.get("return_scores", False))
        result = []
        for query in request["queries"]:
            hits = []
            for p in self.backend.search_sync(str(query), topk):
                doc = {"id": p.doc_id, "contents": f'"{p.title}"\n{p.text}'}
                hits.append({"document": doc, "score": p.score} if scores else doc)
            result.append(hits)
        return {"result": result}

    def _handler(self):
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):  # noqa: N802 (http.server's name)
                if self.path != "/retrieve":
                    self.send_error(404)
                    return
                body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
                with owner._count_lock:
                    owner.requests += 1
                time.sleep(owner.latency_s)
                try:
                    data = json.dumps(owner.answer(json.loads(body))).encode()
                except (ValueError, KeyError, TypeError) as exc:
                    self.send_error(400, str(exc))
                    return
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args):  # one line per request would flood the benchmark's output
                pass

        return Handler

    def __enter__(self) -> "LatencyRetriever":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()


def demo_env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)  # each run starts and stops its own local Ray
    env.update({"VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"),
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "RAY_USAGE_STATS_ENABLED": "0", "RAY_AUTH_MODE": "disabled",
                "GLOO_SOCKET_IFNAME": "lo", "TOKENIZERS_PARALLELISM": "false", "WANDB_MODE": "disabled"})
    return env


def ensure_sft_model(work_dir: Path) -> Demo:
    """The demo's data and SFT stages into ``work_dir/demo`` (skipped when already done there)."""
    demo = Demo(CONFIG, [], work_dir / "demo", None, DEFAULT_SFT_TOOL_FRACTION)
    if not (demo.done("data") and demo.done("sft")):
        print(f"building the SFT model in {demo.run_dir} (demo stages data,sft)", flush=True)
        cmd = [sys.executable, "-m", "megatron_arpo", "demo", "--config", CONFIG, "--stages", "data,sft",
               "--run-dir", str(demo.run_dir)]
        subprocess.run(cmd, cwd=REPO, env=demo_env(), check=True)
    return demo


def read_rows(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []
    return [r for r in rows if "time/step_s" in r]


def run_record(rows: Sequence[Mapping], mode: str) -> dict:
    """One run's figures from its per-step metrics rows (pure: the unit test feeds it rows)."""
    wall = sum(r["time/step_s"] for r in rows)
    rollout = sum(r.get("time/rollout_s", 0.0) for r in rows)
    update = sum(r.get("time/update_s", 0.0) for r in rows)
    if mode == "sync":
        engine_idle, actor_idle = (wall - rollout) / wall, rollout / wall
    else:
        engine_idle = sum(r["offpolicy/engine_idle_s"] for r in rows) / wall
        actor_idle = sum(r["offpolicy/actor_idle_s"] for r in rows) / wall
    tools = sorted({k.split("/")[1] for r in rows for k in r if k.startswith("tools/") and k.endswith("/calls_per_traj")
                    and k.count("/") == 2})
    return {"mode": mode, "steps": len(rows), "wall_s": wall, "tokens": sum(r["actor/tokens"] for r in rows),
            "loss_tokens": sum(r.get("actor/loss_tokens", 0) for r in rows),
            "tokens_per_s": sum(r["actor/tokens"] for r in rows) / wall, "steps_per_hour": 3600.0 * len(rows) / wall,
            "engine_idle": engine_idle, "actor_idle": actor_idle, "rollout_s_per_step": rollout / len(rows),
            "update_s_per_step": update / len(rows), "step_s": wall / len(rows),
            "calls_per_traj": {t: statistics.fmean(r[f"tools/{t}/calls_per_traj"] for r in rows) for t in tools},
            "dropped_stale": int(sum(r.get("offpolicy/dropped_stale", 0) for r in rows))}


def summarize(records: Iterable[Mapping]) -> dict:
    """Per latency and mode: min/median/max of each figure over repeats, and median ratios against sync."""
    groups: dict[tuple[float, str], list[Mapping]] = {}
    for rec in records:
        groups.setdefault((rec["latency_s"], rec["mode"]), []).append(rec)
    out: dict = {}
    order = list(MODES)
    for (latency, mode), recs in sorted(groups.items(), key=lambda kv: (kv[0][0], order.index(kv[0][1]))):
        entry = {k: {"min": min(r[k] for r in recs), "median": statistics.median(r[k] for r in recs),
                     "max": max(r[k] for r in recs)} for k in STATS}
        entry["repeats"] = len(recs)
        out.setdefault(latency, {})[mode] = entry
    for modes in out.values():
        base = modes.get("sync")
        for entry in modes.values():
            entry["ratio_vs_sync"] = (entry["tokens_per_s"]["median"] / base["tokens_per_s"]["median"]
                                      if base else None)
    return out


def format_table(summary: Mapping, records: Sequence[Mapping]) -> str:
    lines = ["| tool latency | mode | runs | trained tokens/s min / median / max | steps/hour (median) | "
             "tokens/s vs sync | engine idle (median) | actor idle (median) |", "|---|---|---|---|---|---|---|---|"]
    for latency, modes in summary.items():
        for mode, e in modes.items():
            t, ratio = e["tokens_per_s"], e["ratio_vs_sync"]
            lines.append(f"| {latency:g} s | {mode} | {e['repeats']} | {t['min']:.1f} / {t['median']:.1f} / "
                         f"{t['max']:.1f} | {e['steps_per_hour']['median']:.0f} | "
                         f"{'-' if ratio is None else f'{ratio:.2f}x'} | {e['engine_idle']['median']:.0%} | "
                         f"{e['actor_idle']['median']:.0%} |")
    lines += ["", "| tool latency | mode | repeat | s/step | rollout s/step | update s/step | search requests/step "
              "| search, python calls/traj | tokens/step | dropped stale |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        calls = ", ".join(f"{r['calls_per_traj'].get(t, 0):.2f}" for t in ("search", "python"))
        lines.append(f"| {r['latency_s']:g} s | {r['mode']} | {r['repeat']} | {r['step_s']:.1f} | "
                     f"{r['rollout_s_per_step']:.1f} | {r['update_s_per_step']:.1f} | "
                     f"{r['search_requests'] / r['steps']:.1f} | {calls} | {r['tokens'] / r['steps']:.0f} | "
                     f"{r['dropped_stale']} |")
    return "\n".join(lines)


def train_once(demo: Demo, work_dir: Path, mode: str, latency: float, repeat: int, steps: int,
               search_concurrency: int | None = None) -> dict:
    run_dir = work_dir / f"lat{latency:g}-{mode}-r{repeat}"
    if run_dir.exists():
        subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    with LatencyRetriever(demo.data_dir / "demo_corpus.jsonl", latency) as server:
        sets = [*demo.path_overrides(), *COMMON_SETS, f"tools.search.url={server.url}", f"trainer.run_dir={run_dir}",
                f"trainer.total_steps={steps}", *MODES[mode],
                *([f"tools.search.max_concurrency={search_concurrency}"] if search_concurrency else [])]
        cmd = [sys.executable, "-m", "megatron_arpo", "train", "--config", CONFIG, "--resume", "none"]
        for item in sets:
            cmd += ["--set", item]
        log = work_dir / f"{run_dir.name}.log"
        start = time.perf_counter()
        with open(log, "w") as out:
            proc = subprocess.run(cmd, cwd=REPO, env=demo_env(), stdout=out, stderr=subprocess.STDOUT)
        seconds = time.perf_counter() - start
        requests = server.requests
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} at {latency:g} s: train exited {proc.returncode}; see {log}:\n"
                           + log.read_text(errors="replace")[-3000:])
    rows = read_rows(run_dir)
    if len(rows) != steps:
        raise RuntimeError(f"{run_dir}: {len(rows)} metrics rows, expected {steps}")
    return {**run_record(rows, mode), "latency_s": latency, "repeat": repeat, "search_requests": requests,
            "process_s": seconds}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--latencies", default="1,3", help="seconds per search call, comma-separated")
    parser.add_argument("--modes", default="sync,k1,k2", help=f"comma-separated subset of {','.join(MODES)}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--search-concurrency", type=int, default=None,
                        help="tools.search.max_concurrency in every mode (default: the demo config's)")
    parser.add_argument("--json", type=Path, help="write the records and the summary here")
    parser.add_argument("--work-dir", type=Path, default=REPO / "runs" / "bench-off-policy")
    args = parser.parse_args(argv)
    modes = [m.strip() for m in args.modes.split(",") if m.strip()]
    bad = [m for m in modes if m not in MODES]
    if bad or not modes:
        parser.error(f"--modes: unknown {bad}; choose from {','.join(MODES)}")
    latencies = [float(x) for x in args.latencies.split(",") if x.strip()]
    args.work_dir.mkdir(parents=True, exist_ok=True)
    demo = ensure_sft_model(args.work_dir.resolve())
    records = []
    for latency in latencies:
        for repeat in range(1, args.repeats + 1):
            for mode in modes:  # alternated: sync, k1, k2, sync, k1, k2, ...
                rec = train_once(demo, args.work_dir.resolve(), mode, latency, repeat, args.steps,
                                 args.search_concurrency)
                records.append(rec)
                print(f"{latency:g} s {mode} repeat {repeat}: {rec['tokens_per_s']:.1f} tokens/s, "
                      f"{rec['step_s']:.1f} s/step (process {rec['process_s']:.0f} s)", flush=True)
    summary = summarize(records)
    print(f"\n## Off-policy vs sync: {args.steps} steps, configs/demo.yaml, separate pools "
          f"(1 actor rank + 1 vLLM CPU engine), search latency injected\n")
    print(format_table(summary, records))
    for latency, by_mode in summary.items():
        sync = [r for r in records if r["latency_s"] == latency and r["mode"] == "sync"]
        if sync:
            r_s = statistics.median(r["rollout_s_per_step"] for r in sync)
            rest = statistics.median(r["step_s"] - r["rollout_s_per_step"] for r in sync)
            print(f"\n{latency:g} s: sync rollout {r_s:.1f} s/step, the rest (reward, log-probs, update, sync) "
                  f"{rest:.1f} s/step: overlap ceiling (R+U)/max(R,U) = {(r_s + rest) / max(r_s, rest):.2f}x")
    if args.json:
        args.json.write_text(json.dumps({"records": records, "summary": summary}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
