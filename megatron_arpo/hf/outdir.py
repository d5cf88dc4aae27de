"""Output directories of the converters: path guards, the ownership marker, stale temp cleanup, atomic rename.

A conversion may be run on a user's only copy of a checkpoint, so what is written where is guarded:

- :func:`check_distinct_paths`: ``--out`` may not be, contain, or lie inside a directory the command reads
  (``--hf``, the Megatron checkpoint directory, ``--tokenizer``). Symlinks are resolved first.
- :func:`check_output_dir`: an existing ``--out`` is refused; with ``overwrite`` it is replaced only when
  it is empty or holds a checkpoint of ours, recognised by :data:`MARKER` (``conversion.json`` whose
  ``format`` is :data:`MARKER_FORMAT`) — never arbitrary content.
- :func:`atomic_output_dir`: the output is built in a hidden sibling ``.OUT.tmp-RAND-PID-START@HOST`` (its
  writer: pid, the pid's start time, host; in the name because Megatron wants an empty directory) and
  renamed into place when complete (the marker is written last, if the caller did not write one). The
  temp dir is created with ``os.mkdir(path, 0o777)``, so it gets the mode the umask gives
  (``tempfile.mkdtemp`` would make it 0700 and the finished checkpoint unreadable to other users).
- :func:`remove_stale_temps`: a run killed with SIGKILL leaves its temp dir behind; the next run for the
  same ``--out`` finds the siblings whose writer is gone (same host, pid dead or reused) or whose name
  names no writer (older versions), removes them and logs their names. A temp dir of a live writer, or of a writer on
  another host, is left alone (with a log line saying so). ``.OUT.old-*`` (the previous output while it
  is being replaced) is removed only when ``OUT`` exists; otherwise it is the only copy of the previous
  output and the log line says how to restore it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import socket
from pathlib import Path
from typing import Iterator, Mapping

from megatron_arpo.fsutil import fsync_path, fsync_tree

logger = logging.getLogger(__name__)

MARKER = "conversion.json"
MARKER_FORMAT = "megatron-arpo-conversion"


def _real(path: str | os.PathLike) -> Path:
    return Path(os.path.realpath(path))


def check_distinct_paths(out: str | os.PathLike, sources: Mapping[str, str | os.PathLike | None]) -> None:
    """Refuse an ``out`` equal to, inside, or containing any of ``sources`` ({option: path})."""
    target = _real(out)
    for option, source in sources.items():
        if source is None:
            continue
        src = _real(source)
        if target == src:
            relation = "is the same directory as"
        elif src in target.parents:
            relation = "is inside"
        elif target in src.parents:
            relation = "contains"
        else:
            continue
        raise ValueError(f"--out {out} {relation} {option} {source}; writing there could destroy the source "
                         f"checkpoint. Choose an --out outside {source}")


def is_our_output(path: str | os.PathLike) -> bool:
    marker = Path(path) / MARKER
    try:
        data = json.loads(marker.read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == MARKER_FORMAT


def check_output_dir(out: str | os.PathLike, overwrite: bool) -> Path:
    """Raise unless ``out`` may be written: absent, or ``overwrite`` and empty or a checkpoint of ours."""
    out = Path(out)
    if not out.exists() and not out.is_symlink():
        return out
    if not overwrite:
        raise FileExistsError(f"output directory {out} already exists; pass --overwrite to replace it, or choose "
                              f"another --out")
    if not out.is_dir() or out.is_symlink():
        raise FileExistsError(f"--out {out} exists and is not a directory; --overwrite replaces only a directory "
                              f"written by python -m conversion. Remove it yourself or choose another --out")
    entries = sorted(p.name for p in out.iterdir())
    if entries and not is_our_output(out):
        shown = ", ".join(entries[:5]) + (f", ... ({len(entries) - 5} more)" if len(entries) > 5 else "")
        raise FileExistsError(
            f"--out {out} holds files not written by python -m conversion ({shown}) and no {MARKER} marker; "
            f"--overwrite replaces only a checkpoint of ours. Remove the directory yourself if it may go, or "
            f"choose another --out")
    return out


def _process_start(pid: int) -> str | None:
    """Start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat), None if unknown."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rsplit(")", 1)[1].split()[19]


def _writer_tag() -> str:
    """``PID-START@HOST``: who writes a temp dir, in its name (the dir itself must start empty)."""
    return f"{os.getpid()}-{_process_start(os.getpid()) or 'x'}@{socket.gethostname()}"


def _parse_writer(tmp_name: str) -> tuple[int, str, str] | None:
    """(pid, start, host) from ``.OUT.tmp-RAND-PID-START@HOST``; None for any other name."""
    tag = tmp_name.rsplit(".tmp-", 1)[-1]
    left, at, host = tag.partition("@")
    parts = left.split("-")
    if not at or len(parts) != 3 or not parts[1].isdigit():
        return None
    return int(parts[1]), parts[2], host


def _writer_alive(pid: int, start: str, host: str) -> bool | None:
    """True/False for a writer on this host, None when it ran elsewhere (cannot be checked from here)."""
    if host != socket.gethostname():
        return None
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # exists, another user's
    except (OverflowError, ValueError):
        return False
    now = _process_start(pid)
    return now is None or start == "x" or start == now  # a different start time: the pid was reused


def remove_stale_temps(out: str | os.PathLike) -> list[Path]:
    """Remove the temp siblings of ``out`` left by killed runs; returns the paths removed."""
    out = Path(out).absolute()
    removed: list[Path] = []
    if not out.parent.is_dir():
        return removed
    for path in sorted(out.parent.glob(f".{out.name}.tmp-*")):
        if not path.is_dir() or path.is_symlink():
            continue
        writer = _parse_writer(path.name)
        alive = _writer_alive(*writer) if writer else False  # unparsable: an older version's, abandoned
        if alive is None:
            logger.warning("leaving %s: a conversion on host %s (pid %s) is writing it or was killed there; "
                           "remove it by hand once that run is gone", path, writer[2], writer[0])
            continue
        if alive:
            logger.warning("leaving %s: pid %s on this host is still writing it", path, writer[0])
            continue
        shutil.rmtree(path, ignore_errors=True)
        logger.warning("removed %s: the unfinished output of a killed conversion run", path)
        removed.append(path)
    for path in sorted(out.parent.glob(f".{out.name}.old-*")):
        if out.exists():
            shutil.rmtree(path, ignore_errors=True)
            logger.warning("removed %s: the replaced output of an earlier --overwrite run", path)
            removed.append(path)
        else:
            logger.warning("%s holds the previous %s of an interrupted --overwrite run and %s is missing; move "
                           "%s back to %s, or delete it", path, out.name, out, path / out.name, out)
    return removed


def _make_sibling(out: Path, kind: str) -> Path:
    while True:
        path = out.parent / f".{out.name}.{kind}-{secrets.token_hex(4)}-{_writer_tag()}"
        try:
            os.mkdir(path, 0o777)  # mode from the umask, unlike tempfile.mkdtemp's 0700
            return path
        except FileExistsError:
            continue


def write_json(path: Path, data: Mapping) -> None:
    """Write ``data`` as sorted, indented JSON and fsync it (the caller renames the directory into place)."""
    with open(path, "w") as fh:
        json.dump(data, fh, indent=2, sort_keys=True)
        fh.write("\n")
        fh.flush()
        os.fsync(fh.fileno())


def write_marker(directory: Path, report: Mapping | None = None) -> None:
    write_json(directory / MARKER, {"format": MARKER_FORMAT, "version": 1, **(report or {})})


@contextlib.contextmanager
def atomic_output_dir(out: str | os.PathLike, overwrite: bool = False) -> Iterator[Path]:
    """Yield a temp dir beside ``out``; on success rename it to ``out``, on failure delete it."""
    out = check_output_dir(out, overwrite).absolute()
    out.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temps(out)
    tmp = _make_sibling(out, "tmp")
    try:
        yield tmp
        if not (tmp / MARKER).exists():
            write_marker(tmp)
        fsync_tree(tmp)
        check_output_dir(out, overwrite)  # again: something may have appeared while we were writing
        if out.exists():
            old = _make_sibling(out, "old")
            os.rename(out, old / out.name)
            os.rename(tmp, out)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, out)
        fsync_path(out.parent)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise

