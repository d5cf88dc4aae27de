"""Block size of hf-to-megatron's copy loop: read + zlib CRC + write of one file, against copy_file_range.

``conversion/torch_record.py`` streams each chunk through one buffer (read a block, checksum it, write it).
This times that loop over one existing file (page cache to page cache, no fsync) at several block sizes,
interleaved with ``os.copy_file_range`` (what ``cp`` does, without a CRC), ``--repeats`` times.
Usage: ``python benchmarks/copy_blocks.py FILE [--repeats 3] [--out-dir DIR]``.
"""

from __future__ import annotations

import argparse
import os
import time
import zlib
from pathlib import Path

BLOCKS = (64 << 10, 256 << 10, 1 << 20, 8 << 20)


def read_crc_write(src: Path, dst: Path, block: int) -> float:
    size = src.stat().st_size
    fd_in, fd_out = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    view, offset, crc = memoryview(bytearray(block)), 0, 0
    start = time.perf_counter()
    try:
        while offset < size:
            n = os.preadv(fd_in, [view[:min(block, size - offset)]], offset)
            crc = zlib.crc32(view[:n], crc)
            written = 0
            while written < n:
                written += os.write(fd_out, view[written:n])
            offset += n
        return time.perf_counter() - start
    finally:
        os.close(fd_in)
        os.close(fd_out)
        dst.unlink()


def copy_file_range(src: Path, dst: Path) -> float:
    size = src.stat().st_size
    fd_in, fd_out = os.open(src, os.O_RDONLY), os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    offset = 0
    start = time.perf_counter()
    try:
        while offset < size:
            offset += os.copy_file_range(fd_in, fd_out, size - offset, offset, offset)
        return time.perf_counter() - start
    finally:
        os.close(fd_in)
        os.close(fd_out)
        dst.unlink()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("file", type=Path)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out-dir", type=Path, default=None, help="where the copies go (default: beside FILE)")
    args = parser.parse_args()
    dst = (args.out_dir or args.file.parent) / f".copy_blocks.{os.getpid()}"
    gb = args.file.stat().st_size / 1e9
    print(f"{args.file} ({gb:.2f} GB); seconds per copy")
    print("| repeat | " + " | ".join(f"{b >> 10} KB blocks" for b in BLOCKS) + " | copy_file_range (no CRC) |")
    print("|---" * (len(BLOCKS) + 2) + "|")
    for repeat in range(1, args.repeats + 1):
        times = [read_crc_write(args.file, dst, block) for block in BLOCKS] + [copy_file_range(args.file, dst)]
        print(f"| {repeat} | " + " | ".join(f"{t:.2f}" for t in times) + " |")


if __name__ == "__main__":
    main()
