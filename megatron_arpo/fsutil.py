"""Durable file writes shared by checkpoints, conversion, records and reports.

``atomic_write`` writes into a temporary file in the target's directory, fsyncs it and renames it over
the target, so a reader (or a run killed mid-write) sees either the old file or the complete new one.
"""

from __future__ import annotations

import errno
import os
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Iterator


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or a directory (a directory fsync makes a rename in it durable)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    for dirpath, _, filenames in os.walk(root):
        for name in filenames:
            fsync_path(Path(dirpath) / name)
        fsync_path(dirpath)


@contextmanager
def atomic_write(path: str | os.PathLike, mode: str = "w", encoding: str | None = "utf-8") -> Iterator[IO]:
    """Open a temp file next to ``path``; on a clean exit fsync it and rename it over ``path``."""
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=out.name + ".", suffix=".tmp", dir=out.parent)
    try:
        with os.fdopen(fd, mode, encoding=None if "b" in mode else encoding) as fh:
            yield fh
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, out)
        fsync_path(out.parent)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


_WRITE = 2  # SYNC_FILE_RANGE_WRITE
_WAIT_ALL = 1 | 2 | 4  # SYNC_FILE_RANGE_WAIT_BEFORE | _WRITE | _WAIT_AFTER
_sync_file_range = None  # libc's sync_file_range once looked up, False where there is none


def _libc_sync_file_range():
    global _sync_file_range
    if _sync_file_range is None:
        # deferred: pulls in ctypes, which this module's importers need not load
        import ctypes

        try:
            func = ctypes.CDLL(None, use_errno=True).sync_file_range
        except (OSError, AttributeError):  # not Linux, or a libc without it
            func = False
        else:
            func.argtypes = [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
            func.restype = ctypes.c_int
        _sync_file_range = func
    return _sync_file_range


class WriteBehind:
    """Write-behind for a large output file: write back each ``window`` of bytes as soon as it is written,
    then drop those pages from the page cache.

    The file's bytes up to a frontier count as written; ranges written out of order wait until the frontier
    reaches them. Each full window behind the frontier is handed to the disk at once
    (``sync_file_range(WRITE)``); ``lag`` windows later the writer waits for it and drops its pages
    (``posix_fadvise(DONTNEED)``). Why: a plain copy fills the page cache with dirty output pages, and on a
    machine whose memory is full of cache every new page costs a reclaim. ``benchmarks/write_behind.py``
    (benchmarks/RESULTS.md): a 7 GB copy at a median 0.85 GB/s as ``cp`` does it, 2.4 GB/s with write-behind.
    The output is then not left in the page cache (as ``dd oflag=nocache`` leaves it).

    ``drop=False`` keeps the pages (only the early writeback): ``benchmarks/write_behind.py`` compares the two.
    Nothing here makes the data durable: :meth:`finish` fsyncs. Where ``sync_file_range`` does not exist or
    the file does not support it, the helper does nothing until :meth:`finish`.
    """

    def __init__(self, fd: int, window: int = 64 * 2**20, lag: int = 2, start: int = 0, drop: bool = True):
        self.fd, self.window, self.lag, self.drop = fd, window, lag, drop
        self.frontier = self.flushed = start
        self._early: dict[int, int] = {}  # start -> end of ranges written beyond the frontier
        self._in_flight: list[tuple[int, int]] = []
        self._func = _libc_sync_file_range()

    def wrote(self, offset: int, nbytes: int) -> None:
        """Bytes ``[offset, offset + nbytes)`` of the file are written."""
        end = offset + nbytes
        if offset > self.frontier:
            self._early[offset] = max(end, self._early.get(offset, end))
            return
        self.frontier = max(self.frontier, end)
        while self._early:
            later = [s for s in self._early if s <= self.frontier]
            if not later:
                break
            for s in later:
                self.frontier = max(self.frontier, self._early.pop(s))
        while self._func and self.frontier - self.flushed >= self.window:
            self._start(self.flushed, self.window)
            self.flushed += self.window

    def appended(self, nbytes: int) -> None:
        """``nbytes`` more were written at the frontier (a file written strictly in order)."""
        self.wrote(self.frontier, nbytes)

    def _call(self, offset: int, nbytes: int, flags: int) -> None:
        # deferred: pulls in ctypes, which this module's importers need not load
        import ctypes

        if self._func(self.fd, offset, nbytes, flags) != 0:
            err = ctypes.get_errno()
            if err in (errno.ENOSYS, errno.EINVAL, errno.ESPIPE, errno.EOPNOTSUPP):
                self._func, self._in_flight = False, []  # not for this file: fsync at finish does it all
                return
            raise OSError(err, f"writing back bytes {offset}-{offset + nbytes}: {os.strerror(err)}")

    def _start(self, offset: int, nbytes: int) -> None:
        self._call(offset, nbytes, _WRITE)
        self._in_flight.append((offset, nbytes))
        if len(self._in_flight) > self.lag:
            old, size = self._in_flight.pop(0)
            self._call(old, size, _WAIT_ALL)
            if self._func and self.drop:
                os.posix_fadvise(self.fd, old, size, os.POSIX_FADV_DONTNEED)

    def finish(self) -> None:
        """fsync the file, then drop its pages from the page cache."""
        os.fsync(self.fd)
        self._in_flight = []
        if self._func and self.drop:
            os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_DONTNEED)
