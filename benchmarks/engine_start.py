"""Engine start with vLLM's default multiprocessing (EngineCore in a subprocess) vs the in-process core.

The tests and the demo run vLLM's default, as a GPU job does; the in-process core
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``) is the baseline it replaced. Each mode runs in a fresh Python
process: import, start a `VllmEngine` (tiny-qwen3, gloo weight transfer), one 16-token greedy request,
the resident memory of the process and its children, shutdown. Prints one row per mode and the ratios.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

MODES = {"in-process core (baseline)": {"VLLM_ENABLE_V1_MULTIPROCESSING": "0"}, "multiprocessing (default)": {}}


def measure() -> dict:
    import psutil

    start = time.monotonic()
    from megatron_arpo.rollout.engine import EngineConfig, SegmentRequest, VllmEngine
    from megatron_arpo.tiny.checkpoint import tiny_checkpoint

    imported = time.monotonic()
    engine = VllmEngine(EngineConfig(model=str(tiny_checkpoint("tiny-qwen3")), dtype="float32", max_model_len=1024,
                                     block_size=32, enforce_eager=True, weight_transfer="gloo"))
    ready = time.monotonic()
    me = psutil.Process()
    rss = me.memory_info().rss + sum(c.memory_info().rss for c in me.children(recursive=True))
    out = asyncio.run(engine.generate(SegmentRequest("r", list(range(1, 33)), max_tokens=16, temperature=0.0)))
    generated = time.monotonic()
    asyncio.run(engine.shutdown())
    return {"import_s": imported - start, "start_s": ready - imported, "request_s": generated - ready,
            "shutdown_s": time.monotonic() - generated, "rss_gib": rss / 2**30, "tokens": len(out.token_ids)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure()))
        return
    rows = {}
    for name, extra in MODES.items():
        env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind", **extra}
        proc = subprocess.run([sys.executable, __file__, "--child"], env=env, capture_output=True, text=True,
                              timeout=900)
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        if line is None:
            raise SystemExit(f"{name}: failed\n{proc.stderr[-3000:]}")
        rows[name] = json.loads(line[len("RESULT "):])
    print("| mode | import s | engine start s | 16-token request s | shutdown s | RSS GiB (process + children) |")
    print("|---|---|---|---|---|---|")
    for name, r in rows.items():
        print(f"| {name} | {r['import_s']:.1f} | {r['start_s']:.1f} | {r['request_s']:.2f} | {r['shutdown_s']:.1f} "
              f"| {r['rss_gib']:.2f} |")
    base, mp = rows.values()
    print(f"- multiprocessing / in-process: engine start {mp['start_s'] / base['start_s']:.2f}, request "
          f"{mp['request_s'] / base['request_s']:.2f}, RSS {mp['rss_gib'] / base['rss_gib']:.2f}")


if __name__ == "__main__":
    main()
