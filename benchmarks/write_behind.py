"""Why the converters use write-behind: one large file copied four ways, fsync'd, alternated.

- ``cp``: ``os.copy_file_range`` over the whole file, as ``cp`` does;
- ``pieces``: the same in 64 MB calls;
- ``writeback``: 64 MB calls, each handed to the disk as soon as copied (``WriteBehind(drop=False)``);
- ``write-behind``: that, and each piece dropped from the page cache once on disk
  (``megatron_arpo.fsutil.WriteBehind``, what both converters do).

Each copy starts after a ``sync`` with its input read once (in the page cache) and ends with ``fsync``.
The input is FILE, or a file of ``--size-gb`` GB written once in ``--workdir`` (deleted at the end).
Usage: ``python benchmarks/write_behind.py [FILE] [--size-gb 7] [--repeats 3] [--workdir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from megatron_arpo.fsutil import WriteBehind  # noqa: E402

PIECE = 64 * 2**20
WAYS = ("cp", "pieces", "writeback", "write-behind")


def _read_once(path: Path) -> None:
    with open(path, "rb", buffering=0) as fh:
        while fh.read(16 * 2**20):
            pass
    os.sync()


def copy(src: Path, dst: Path, way: str) -> float:
    _read_once(src)
    size = src.stat().st_size
    fd_in, fd_out = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    behind = WriteBehind(fd_out, window=PIECE, drop=way == "write-behind") if way in ("writeback", "write-behind") \
        else None
    offset = 0
    start = time.perf_counter()
    try:
        while offset < size:
            n = os.copy_file_range(fd_in, fd_out, size - offset if way == "cp" else min(PIECE, size - offset),
                                   offset, offset)
            if behind is not None:
                behind.wrote(offset, n)
            offset += n
        if behind is not None:
            behind.finish()
        else:
            os.fsync(fd_out)
        return time.perf_counter() - start
    finally:
        os.close(fd_in)
        os.close(fd_out)
        dst.unlink()
        os.sync()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path, nargs="?")
    parser.add_argument("--size-gb", type=float, default=7.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workdir", type=Path, default=None)
    args = parser.parse_args()
    made = None
    if args.file is None:
        fd, name = tempfile.mkstemp(prefix="write-behind-", dir=args.workdir)
        made = args.file = Path(name)
        block = os.urandom(PIECE)
        for _ in range(int(args.size_gb * 1e9) // PIECE):
            os.write(fd, block)
        os.close(fd)
    try:
        size = args.file.stat().st_size
        print(f"{args.file} ({size / 1e9:.2f} GB), MB/s per copy, fsync included")
        print("| repeat | " + " | ".join(WAYS) + " |")
        print("|---" * (len(WAYS) + 1) + "|")
        rates = {way: [] for way in WAYS}
        for repeat in range(1, args.repeats + 1):
            for way in WAYS:
                rates[way].append(size / 1e6 / copy(args.file, args.file.with_name(args.file.name + ".copy"), way))
            print(f"| {repeat} | " + " | ".join(f"{rates[w][-1]:.0f}" for w in WAYS) + " |", flush=True)
        print("| median | " + " | ".join(f"{statistics.median(rates[w]):.0f}" for w in WAYS) + " |")
    finally:
        if made is not None:
            made.unlink()


if __name__ == "__main__":
    main()
