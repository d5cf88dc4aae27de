"""The run-wide meter on a real process tree, and where per-run cgroups may be created."""

import os
import subprocess
import sys
import time

import pytest

from megatron_arpo.tools.run_limits import find_cgroup_parent, sample_usage

TREE = """
import os, sys, time
for i in range(2):
    if os.fork() == 0:
        block = b"x" * (40 << 20)
        end = time.process_time() + 0.3
        while time.process_time() < end:
            pass
        sys.stdout.write("ready\\n"); sys.stdout.flush()
        time.sleep(30)
        os._exit(0)
time.sleep(30)
"""


def test_meter_sums_cpu_and_memory_over_the_whole_tree():
    proc = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    try:
        assert [proc.stdout.readline() for _ in range(2)] == ["ready\n", "ready\n"]
        usage = sample_usage(proc.pid)
        assert usage.tasks == 3
        assert usage.cpu_s >= 0.55  # two children spent 0.3 s each
        assert usage.memory_bytes >= 80 << 20  # two children hold 40 MB each, counted once each
    finally:
        proc.kill()
        proc.wait()
    assert sample_usage(proc.pid).tasks == 0  # gone: nothing to count, no error


def _fake_v2_dir(path, controllers):
    os.makedirs(path, exist_ok=True)
    for name, text in (("cgroup.subtree_control", controllers), ("cgroup.procs", "")):
        with open(os.path.join(path, name), "w") as handle:
            handle.write(text)
    return str(path)


def test_cgroup_parent_must_delegate_memory(tmp_path):
    usable = _fake_v2_dir(tmp_path / "ok", "cpu memory pids\n")
    parent, why = find_cgroup_parent(usable)
    assert parent is not None and parent.version == 2 and parent.path == usable
    parent, why = find_cgroup_parent(_fake_v2_dir(tmp_path / "nomem", "cpu pids\n"))
    assert parent is None and "does not enable the memory controller" in why
    parent, why = find_cgroup_parent(str(tmp_path / "missing"))
    assert parent is None and "is not a cgroup v2 directory" in why


def test_auto_detection_explains_itself():
    parent, why = find_cgroup_parent(None)
    assert why  # either where runs go, or why no cgroup can be had here
    if parent is not None:
        cgroup = parent.create(64 << 20, 8)
        try:
            assert os.path.isdir(cgroup.path) and cgroup.oom_kills() == 0
        finally:
            cgroup.remove()
        deadline = time.monotonic() + 2
        while os.path.exists(cgroup.path) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not os.path.exists(cgroup.path)
    else:
        pytest.skip(f"no cgroup for runs on this machine: {why}")
