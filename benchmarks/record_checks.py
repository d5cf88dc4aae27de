"""The cost of megatron-to-hf's record checks (CRC-32 of every entry, NaN/Inf scan): before vs after.

Builds one synthetic checkpoint (``benchmarks/conversion.py``'s reduced width by default, bf16), converts
it to Megatron once, then times ``python -m conversion megatron-to-hf`` of it with this checkout and with
``--baseline DIR`` (a checkout without the checks, e.g. ``git archive <commit> | tar -x -C DIR``),
alternating, each run from a warm page cache. Prints seconds, MB/s and the after/before ratio per run.
Usage: ``python benchmarks/record_checks.py --baseline DIR [--layers 2] [--repeats 3] [--workdir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from benchmarks.conversion import WIDTHS, build_synthetic  # noqa: E402


def time_conversion(checkout: Path, mg: Path, out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    for shard in mg.glob("*.distcp"):
        shard.read_bytes()  # warm: every run reads its input from the page cache
    subprocess.run(["sync"], check=True)
    start = time.perf_counter()
    subprocess.run([sys.executable, "-m", "conversion", "megatron-to-hf", "--megatron", str(mg), "--out", str(out)],
                   check=True, cwd=checkout, env={**os.environ, "PYTHONPATH": str(checkout)},
                   stdout=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", required=True, help="a checkout without the record checks")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--width", choices=sorted(WIDTHS), default="reduced")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="record-checks-", dir=args.workdir))
    try:
        build_synthetic(args.layers, work / "hf", WIDTHS[args.width])
        subprocess.run([sys.executable, "-m", "conversion", "hf-to-megatron", "--hf", str(work / "hf"), "--out",
                        str(work / "mg"), "--model-config", str(work / "hf.yaml")], check=True, cwd=REPO,
                       stdout=subprocess.DEVNULL)
        size = sum(p.stat().st_size for p in (work / "mg").glob("*.distcp"))
        print(f"| run | before s (MB/s) | after s (MB/s) | after/before |  ({size / 1e9:.2f} GB, {args.width} width, "
              f"{args.layers} layers)")
        for run in range(1, args.repeats + 1):
            before = time_conversion(Path(args.baseline), work / "mg", work / "before")
            after = time_conversion(REPO, work / "mg", work / "after")
            print(f"| {run} | {before:.2f} ({size / before / 1e6:.0f}) | {after:.2f} ({size / after / 1e6:.0f}) | "
                  f"{after / before:.2f} |", flush=True)
        print(f"load average at the end: {os.getloadavg()}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
