"""Persistent tool-result cache shared by rollout workers (SQLite), with in-flight de-duplication.

Keyed by (tool tag, `Tool.cache_key(query)`); the tool puts into the key everything that changes its
answer (search: the normalised query plus a digest of topk, result_chars and the backend's identity,
i.e. the corpus content or the retriever URL). Only answers that are final are stored: errors,
timeouts, transport failures and answers the tool marks not cacheable (a search without results, which
may be a transient retriever failure) are never cached.

Concurrency across processes: the database runs in WAL mode with a busy timeout, and every write is
one short `INSERT OR REPLACE` transaction, so several rollout workers on one node can share a file.
(SQLite over NFS is not safe; give each node its own cache file and merge with `import_`.)

Damage does not stop a run: a cache file that is not a readable database when it is opened is moved
aside to `<path>.corrupt-<time>` with a warning naming both files, and a fresh cache starts; a snapshot
that cannot be read on resume is skipped with a warning naming it; a read or write that fails later is
a miss, with a warning.

The schema carries a version (`PRAGMA user_version`). Entries of version 1, whose keys did not include
the tool's settings, are dropped when such a file is opened: they could return stale answers.

Within one process, identical calls that are in flight at the same time (the siblings of a branch ask
the same query) share one execution: the first caller starts it as a task, later callers await that
task and count as hits. The task is shielded, so a cancelled first caller does not cancel the others.
The in-flight table belongs to the event loop that created the entries; use one loop per process.

Where the file may live (`prepare_cache_path`): not under /proc, /sys or /dev; its directory is created
with mode 0700 when missing, and an existing directory or file must belong to this user, be no
symlink, and not be writable by group or others; a directory on the way that every user may write
must have the sticky bit (/tmp). Anything else is refused with the fix: another user could otherwise
hand the trainer a poisoned cache, or a link to a database elsewhere. On a network filesystem the
cache uses SQLite's rollback journal instead of WAL (WAL needs shared memory the filesystem lacks).

`export(path)` writes a consistent snapshot (SQLite backup API) atomically: temporary file in the
target directory, fsync, rename. `import_(path)` merges such a snapshot into the live cache in one
transaction. Checkpoints call these.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sqlite3
import stat
import threading
import time
from typing import Awaitable, Callable

from megatron_arpo.tools.base import ToolResult

logger = logging.getLogger(__name__)

SCHEMA_VERSION = 2
_SCHEMA = """
CREATE TABLE IF NOT EXISTS tool_cache (
    tool TEXT NOT NULL,
    key TEXT NOT NULL,
    text TEXT NOT NULL,
    truncated INTEGER NOT NULL DEFAULT 0,
    created REAL NOT NULL,
    PRIMARY KEY (tool, key)
)
"""


_PSEUDO_FILESYSTEMS = ("/proc", "/sys", "/dev")
_NETWORK_FILESYSTEMS = ("nfs", "nfs4", "cifs", "smb3", "lustre", "gpfs", "ceph", "fuse.glusterfs", "beegfs",
                        "9p", "afs", "fuse.sshfs")


def _inside(path: str, parent: str) -> bool:
    return path == parent or path.startswith(parent.rstrip("/") + "/")


def _refuse(path: str, problem: str) -> ValueError:
    return ValueError(f"tool cache {path}: {problem}; remove it, or set tools.cache.path to a file in a "
                      "directory of your own (mode 0700)")


def _check_owned(path: str, st: os.stat_result, what: str) -> None:
    if stat.S_ISLNK(st.st_mode):
        raise _refuse(path, f"the {what} is a symbolic link (to {os.readlink(path)})")
    if st.st_uid != os.geteuid():
        raise _refuse(path, f"the {what} belongs to uid {st.st_uid}, not to this user (uid {os.geteuid()})")
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise _refuse(path, f"the {what} is writable by group or others (mode {stat.S_IMODE(st.st_mode):o})")


def _make_private_dir(directory: str) -> None:
    """Create `directory` and its missing parents (mode 0700); an existing one must pass `_check_owned`."""
    missing = []
    probe = directory
    while not os.path.lexists(probe):
        missing.append(probe)
        probe = os.path.dirname(probe)
    for path in reversed(missing):
        try:
            os.mkdir(path, 0o700)  # fails on anything already there: no race into someone else's directory
        except FileExistsError:
            pass  # made meanwhile (another worker of ours); checked below
    fd = -1
    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError as exc:
        st = os.lstat(directory) if os.path.lexists(directory) else None
        if st is not None and stat.S_ISLNK(st.st_mode):
            raise _refuse(directory, f"the directory is a symbolic link (to {os.readlink(directory)})") from exc
        raise _refuse(directory, f"the directory cannot be opened ({exc.strerror})") from exc
    try:
        st = os.fstat(fd)
    finally:
        os.close(fd)
    _check_owned(directory, st, "directory")
    # Above it, a directory every user may write lets them rename entries unless it is sticky (/tmp).
    for ancestor in _ancestors(os.path.dirname(directory)):
        st = os.stat(ancestor)
        if st.st_mode & stat.S_IWOTH and not st.st_mode & stat.S_ISVTX:
            raise _refuse(directory, f"{ancestor} is writable by every user and not sticky")


def _ancestors(path: str) -> list[str]:
    out = []
    while True:
        out.append(path)
        if path == os.path.dirname(path):
            return out
        path = os.path.dirname(path)


def prepare_cache_path(path: str) -> str:
    """Check and prepare where the cache file lives (see the module docstring); returns its absolute path."""
    path = os.path.abspath(os.fspath(path))
    for top in _PSEUDO_FILESYSTEMS:
        if _inside(path, top) or _inside(os.path.realpath(path), top):
            raise ValueError(f"tools.cache.path {path} is under {top}, a kernel pseudo-filesystem; set it to a "
                             "file on disk, or null for the default under the run directory")
    _make_private_dir(os.path.dirname(path))
    for name in (path, path + "-wal", path + "-shm", path + "-journal"):
        try:
            st = os.lstat(name)
        except FileNotFoundError:
            continue
        if not stat.S_ISLNK(st.st_mode) and not stat.S_ISREG(st.st_mode):
            raise _refuse(name, "it is not a regular file")
        _check_owned(name, st, "file")
    if not os.path.lexists(path):
        try:
            os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600))
        except FileExistsError:
            _check_owned(path, os.lstat(path), "file")
    return path


def filesystem_type(path: str) -> str:
    """The type of the filesystem holding `path` (its longest mount point in /proc/self/mountinfo)."""
    real, best, kind = os.path.realpath(path), "", ""
    try:
        with open("/proc/self/mountinfo") as handle:
            for line in handle:
                head, _, tail = line.partition(" - ")
                point = head.split()[4].replace("\\040", " ")
                if _inside(real, point) and len(point) >= len(best):
                    best, kind = point, tail.split()[0]
    except (OSError, IndexError):
        return ""
    return kind


class ToolCache:
    """SQLite-backed cache of final tool results. See the module docstring."""

    def __init__(self, path: str, *, busy_timeout_s: float = 30.0):
        self.path = prepare_cache_path(path)
        fstype = filesystem_type(self.path)
        self.journal_mode = "DELETE" if fstype in _NETWORK_FILESYSTEMS else "WAL"
        if self.journal_mode != "WAL":
            logger.info("tool cache %s is on %s: using a rollback journal instead of WAL", self.path, fstype)
        self.busy_timeout_s = busy_timeout_s
        self._lock = threading.Lock()
        try:
            self._conn = self._open(self.path)
        except sqlite3.DatabaseError as exc:
            self._set_aside(exc)
            self._conn = self._open(self.path)
        self._inflight: dict[tuple[str, str], asyncio.Task] = {}
        self._hits = 0
        self._inflight_hits = 0
        self._misses = 0
        self._puts = 0
        self._errors = 0

    def _open(self, path: str) -> sqlite3.Connection:
        conn = self._connect(path)  # raises DatabaseError for a file that is not a database
        try:
            check = conn.execute("PRAGMA quick_check").fetchone()[0]
            if check != "ok":
                raise sqlite3.DatabaseError(f"integrity check failed: {check}")
            version = conn.execute("PRAGMA user_version").fetchone()[0]
            conn.execute(_SCHEMA)
            if version < SCHEMA_VERSION:
                dropped = conn.execute("DELETE FROM tool_cache").rowcount
                if dropped:
                    logger.warning("tool cache %s: dropped %d entries of schema version %d, whose keys did not "
                                   "include the tool settings", path, dropped, version)
                conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
            elif version > SCHEMA_VERSION:
                raise ValueError(f"tool cache {path} has schema version {version}, newer than this code's "
                                 f"{SCHEMA_VERSION}; use a new tools.cache.path or upgrade megatron-arpo")
        except BaseException:
            conn.close()
            raise
        return conn

    def _set_aside(self, exc: Exception) -> None:
        """Move a damaged cache file (and its WAL/SHM companions) out of the way."""
        aside = f"{self.path}.corrupt-{time.strftime('%Y%m%d-%H%M%S')}-{os.getpid()}"
        for suffix in ("", "-wal", "-shm"):
            try:
                os.replace(self.path + suffix, aside + suffix)
            except FileNotFoundError:
                pass  # no such companion, or another worker moved it first
        logger.warning("tool cache %s is not a readable SQLite database (%s); moved it to %s and starting an "
                       "empty cache", self.path, exc, aside)

    def _connect(self, path: str) -> sqlite3.Connection:
        # isolation_level=None: autocommit; explicit BEGIN where a multi-statement transaction is needed.
        conn = sqlite3.connect(
            path, timeout=self.busy_timeout_s, isolation_level=None, check_same_thread=False
        )
        try:
            conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_s * 1000)}")
            mode = conn.execute(f"PRAGMA journal_mode={self.journal_mode}").fetchone()[0]
            if str(mode).lower() != self.journal_mode.lower():
                logger.warning("tool cache %s: journal_mode is %s, not %s; concurrent writers may block", path, mode,
                               self.journal_mode)
            conn.execute("PRAGMA synchronous=NORMAL")
        except BaseException:
            conn.close()
            raise
        return conn

    # ------------------------------------------------------------------ sync access
    def get(self, tool: str, key: str) -> ToolResult | None:
        """The stored result, or None (also when the database fails: a miss, with a warning)."""
        try:
            with self._lock:
                row = self._conn.execute(
                    "SELECT text, truncated FROM tool_cache WHERE tool=? AND key=?", (tool, key)
                ).fetchone()
        except sqlite3.Error as exc:
            self._failed("read", exc)
            return None
        if row is None:
            return None
        return ToolResult(text=row[0], truncated=bool(row[1]), cached=True)

    def put(self, tool: str, key: str, result: ToolResult) -> None:
        """Store a final result; errors and results marked not cacheable are skipped."""
        if result.error is not None or not result.cacheable:
            return
        try:
            with self._lock:
                self._conn.execute(
                    "INSERT OR REPLACE INTO tool_cache (tool, key, text, truncated, created) VALUES (?,?,?,?,?)",
                    (tool, key, result.text, int(result.truncated), time.time()),
                )
        except sqlite3.Error as exc:  # the result is still good; losing one cache entry is not fatal
            self._failed("write", exc)
            return
        self._puts += 1

    def _failed(self, what: str, exc: Exception) -> None:
        self._errors += 1
        if self._errors <= 3 or self._errors % 1000 == 0:
            logger.warning("tool cache %s: %s failed (%s); treated as a miss (%d failures so far)",
                           self.path, what, exc, self._errors)

    def __len__(self) -> int:
        with self._lock:
            return self._conn.execute("SELECT COUNT(*) FROM tool_cache").fetchone()[0]

    # ------------------------------------------------------------------ async access
    async def get_or_compute(
        self, tool: str, key: str, compute: Callable[[], Awaitable[ToolResult]]
    ) -> tuple[ToolResult, bool]:
        """Return (result, hit). A hit is a stored entry or a shared in-flight execution."""
        inflight = self._inflight.get((tool, key))
        if inflight is not None:
            self._inflight_hits += 1
            return await asyncio.shield(inflight), True
        # SQLite may wait on another process's lock (busy timeout); keep that off the event loop.
        stored = await asyncio.to_thread(self.get, tool, key)
        if stored is not None:
            self._hits += 1
            return stored, True
        inflight = self._inflight.get((tool, key))  # another caller may have started while we read
        if inflight is not None:
            self._inflight_hits += 1
            return await asyncio.shield(inflight), True
        self._misses += 1
        task = asyncio.ensure_future(self._compute_and_store(tool, key, compute))
        self._inflight[(tool, key)] = task
        task.add_done_callback(lambda done: self._forget(tool, key, done))
        return await asyncio.shield(task), False

    def _forget(self, tool: str, key: str, task: asyncio.Task) -> None:
        if self._inflight.get((tool, key)) is task:
            del self._inflight[(tool, key)]

    async def _compute_and_store(self, tool, key, compute) -> ToolResult:
        result = await compute()
        if result.error is None and result.cacheable:
            await asyncio.to_thread(self.put, tool, key, result)
        return result

    # ------------------------------------------------------------------ checkpoints
    def export(self, path: str) -> str:
        """Write a consistent snapshot of the cache to `path` atomically; returns the path."""
        path = os.fspath(path)
        directory = os.path.dirname(os.path.abspath(path))
        os.makedirs(directory, exist_ok=True)
        tmp = os.path.join(directory, f".{os.path.basename(path)}.tmp{os.getpid()}")
        if os.path.exists(tmp):
            os.remove(tmp)
        dest = sqlite3.connect(tmp)
        try:
            with self._lock:
                self._conn.backup(dest)
            dest.execute("PRAGMA journal_mode=DELETE")  # a single self-contained file
        finally:
            dest.close()
        with open(tmp, "rb") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, path)
        dir_fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
        return path

    def import_(self, path: str) -> int:
        """Merge the entries of an exported snapshot into this cache in one transaction.

        Entries of the snapshot replace live entries with the same key. Returns the number merged.
        """
        path = os.fspath(path)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"tool cache snapshot {path} does not exist; export one with ToolCache.export")
        try:
            with self._lock:
                return self._merge(path)
        except sqlite3.DatabaseError as exc:
            logger.warning("tool cache snapshot %s cannot be read (%s); resuming without its entries", path, exc)
            return 0

    def _merge(self, path: str) -> int:
        self._conn.execute("ATTACH DATABASE ? AS snapshot", (path,))
        try:
            version = self._conn.execute("PRAGMA snapshot.user_version").fetchone()[0]
            if version != SCHEMA_VERSION:
                logger.warning("tool cache snapshot %s has schema version %d, not %d (its keys differ); "
                               "skipping its entries", path, version, SCHEMA_VERSION)
                return 0
            self._conn.execute("BEGIN IMMEDIATE")
            try:
                count = self._conn.execute("SELECT COUNT(*) FROM snapshot.tool_cache").fetchone()[0]
                self._conn.execute(
                    "INSERT OR REPLACE INTO tool_cache (tool, key, text, truncated, created) "
                    "SELECT tool, key, text, truncated, created FROM snapshot.tool_cache"
                )
                self._conn.execute("COMMIT")
            except BaseException:
                self._conn.execute("ROLLBACK")
                raise
            return count
        finally:
            self._conn.execute("DETACH DATABASE snapshot")

    # ------------------------------------------------------------------ stats
    def stats(self) -> dict:
        lookups = self._hits + self._inflight_hits + self._misses
        return {
            "hits": self._hits,
            "inflight_hits": self._inflight_hits,
            "misses": self._misses,
            "puts": self._puts,
            "errors": self._errors,
            "hit_rate": (self._hits + self._inflight_hits) / lookups if lookups else 0.0,
        }

    def close(self) -> None:
        with self._lock:
            self._conn.close()

    def __getstate__(self):
        raise TypeError("ToolCache holds a SQLite connection; pass its path to other processes instead")
