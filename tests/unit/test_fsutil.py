"""megatron_arpo.fsutil.WriteBehind: what it writes back when, that the bytes are intact, that the output
leaves the page cache, and that files without sync_file_range fall back to the final fsync."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

from megatron_arpo.fsutil import WriteBehind

MB = 2**20


def _filesystem(path: Path) -> str:
    best, kind = "", ""
    with open("/proc/self/mounts") as fh:
        for line in fh:
            _, mount, fstype, *_ = line.split()
            if str(path).startswith(mount) and len(mount) > len(best):
                best, kind = mount, fstype
    return kind


def _resident_bytes(path: Path) -> int:
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--raw", "--output", "RES", str(path)],
                         check=True, capture_output=True, text=True).stdout
    return int(out.split()[0])


def test_windows_are_written_back_once_the_frontier_passes_them_in_any_write_order(tmp_path):
    path = tmp_path / "out.bin"
    data = os.urandom(6 * MB + 12345)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        behind = WriteBehind(fd, window=MB, lag=1)
        pieces = [(0, 1 * MB), (3 * MB, 1 * MB), (2 * MB, 1 * MB), (1 * MB, MB // 2), (5 * MB, len(data) - 5 * MB),
                  (MB + MB // 2, MB // 2), (4 * MB, MB)]
        flushed = []
        for offset, n in pieces:
            os.pwrite(fd, data[offset:offset + n], offset)
            behind.wrote(offset, n)
            flushed.append((behind.frontier, behind.flushed))
        behind.finish()
    finally:
        os.close(fd)
    assert path.read_bytes() == data
    # the frontier stops at the first hole; windows behind it are handed to the disk, whole windows only
    assert flushed == [(MB, MB), (MB, MB), (MB, MB), (MB + MB // 2, MB), (MB + MB // 2, MB),
                       (4 * MB, 4 * MB), (len(data), 6 * MB)]


def test_appended_output_leaves_the_page_cache_where_a_plain_write_stays(tmp_path):
    if shutil.which("fincore") is None or _filesystem(tmp_path) in ("tmpfs", "ramfs", "overlay"):
        pytest.skip(f"needs util-linux fincore and a disk filesystem (tmp_path is on {_filesystem(tmp_path)})")
    block = os.urandom(MB)
    sizes = {}
    for name, use in (("plain.bin", False), ("behind.bin", True)):
        path = tmp_path / name
        fd = os.open(path, os.O_WRONLY | os.O_CREAT)
        behind = WriteBehind(fd, window=2 * MB, lag=1)
        for _ in range(16):
            written = os.write(fd, block)
            if use:
                behind.appended(written)
        if use:
            behind.finish()
        else:
            os.fsync(fd)
        os.close(fd)
        sizes[name] = _resident_bytes(path)
        assert path.read_bytes() == block * 16
    assert sizes["plain.bin"] >= 15 * MB, sizes
    assert sizes["behind.bin"] == 0, sizes


def test_a_file_without_sync_file_range_falls_back_to_nothing_until_finish():
    read, write = os.pipe()
    try:
        behind = WriteBehind(write, window=4096, lag=1)
        os.write(write, b"x" * 8192)
        behind.appended(8192)  # sync_file_range on a pipe: ESPIPE, so write-behind turns itself off
        assert behind.flushed == 4096 and not behind._func
        behind.appended(8192)
        assert behind.flushed == 4096 and behind.frontier == 16384
        assert os.read(read, 8192) == b"x" * 8192
    finally:
        os.close(read)
        os.close(write)
