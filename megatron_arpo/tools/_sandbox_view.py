"""Helper run once by a root trainer: a private mount namespace where given paths are reachable.

`python -I -S _sandbox_view.py '{"paths": [...], "uid": U, "gid": G}'`, started by `MountView` in
containment.py. The interpreter of a root trainer often lives under a directory that the sandbox user
cannot traverse (pyenv or conda under /root, mode 0700), and bubblewrap, running as that user, cannot
bind what it cannot reach. In a private mount namespace (nothing propagates to the host), this helper
covers each blocking ancestor directory with a small empty tmpfs and binds back exactly the requested
paths (read-only binds happen later, in bwrap). It prints `ready`, then waits for stdin to close: the
parent opens /proc/<pid>/ns/mnt meanwhile and keeps the namespace alive through that handle.

Standard library only; executed as a script, never imported.
"""

import ctypes
import json
import os
import stat
import sys

CLONE_NEWNS = 0x00020000
MS_NOSUID = 0x2
MS_NODEV = 0x4
MS_BIND = 0x1000
MS_REC = 0x4000
MS_PRIVATE = 1 << 18

_libc = ctypes.CDLL(None, use_errno=True)


def _check(ret, what):
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _mount(source, target, fstype, flags, data=None):
    enc = lambda s: None if s is None else s.encode()  # noqa: E731
    _check(_libc.mount(enc(source), enc(target), enc(fstype), ctypes.c_ulong(flags), enc(data)),
           f"mount {source} -> {target}")


def _searchable(path, uid, gid):
    st = os.stat(path)
    bit = stat.S_IXUSR if st.st_uid == uid else stat.S_IXGRP if st.st_gid == gid else stat.S_IXOTH
    return bool(st.st_mode & bit)


def _blocking_ancestor(path, uid, gid):
    parts = os.path.abspath(path).strip("/").split("/")
    for depth in range(1, len(parts)):
        ancestor = "/" + "/".join(parts[:depth])
        if not _searchable(ancestor, uid, gid):
            return ancestor
    return None


def main():
    spec = json.loads(sys.argv[1])
    uid, gid = spec["uid"], spec["gid"]
    groups = {}
    for path in spec["paths"]:
        ancestor = _blocking_ancestor(path, uid, gid)
        if ancestor is not None:
            groups.setdefault(ancestor, []).append(os.path.abspath(path))
    os.umask(0o022)  # the directories made below must be searchable by the sandbox user
    _check(_libc.unshare(ctypes.c_int(CLONE_NEWNS)), "unshare(CLONE_NEWNS)")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    for ancestor, paths in sorted(groups.items()):
        # Handles opened inside the new namespace (a bind source must belong to it), before covering.
        handles = {path: os.open(path, os.O_PATH) for path in paths}
        _mount("arpo-sandbox-view", ancestor, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755,size=1m")
        for path, fd in sorted(handles.items()):
            os.makedirs(os.path.dirname(path), mode=0o755, exist_ok=True)
            if stat.S_ISDIR(os.fstat(fd).st_mode):
                os.makedirs(path, mode=0o755, exist_ok=True)
            else:
                open(path, "a").close()
            _mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
            os.close(fd)
    sys.stdout.write("ready\n")
    sys.stdout.flush()
    sys.stdin.read()


if __name__ == "__main__":
    try:
        main()
    except OSError as exc:
        sys.stderr.write(f"sandbox view: {exc}\n")
        sys.exit(1)
