"""Output directories: path guards, --overwrite only over our own checkpoints, stale temp cleanup, modes."""

import json
import logging
import os
import socket
import subprocess
import sys

import pytest

from megatron_arpo.hf.outdir import (MARKER, MARKER_FORMAT, atomic_output_dir, check_distinct_paths, check_output_dir,
                               is_our_output, remove_stale_temps)


def _ours(path):
    path.mkdir(parents=True)
    (path / MARKER).write_text(json.dumps({"format": MARKER_FORMAT}))
    (path / "model.safetensors").write_text("old")
    return path


@pytest.mark.parametrize("out,relation", [("src", "is the same directory as"), ("src/sub/out", "is inside"),
                                          (".", "contains")])
def test_out_equal_inside_or_containing_a_source_is_refused(tmp_path, out, relation):
    (tmp_path / "src").mkdir()
    with pytest.raises(ValueError, match=f"{relation} --hf .*Choose an --out outside"):
        check_distinct_paths(tmp_path / out, {"--hf": tmp_path / "src"})
    check_distinct_paths(tmp_path / "elsewhere", {"--hf": tmp_path / "src", "--tokenizer": None})


def test_symlinks_are_resolved_before_comparing(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "alias").symlink_to(tmp_path / "src")
    with pytest.raises(ValueError, match="is the same directory as --megatron"):
        check_distinct_paths(tmp_path / "alias", {"--megatron": tmp_path / "src"})
    with pytest.raises(ValueError, match="is inside --megatron"):
        check_distinct_paths(tmp_path / "alias" / "hf", {"--megatron": tmp_path / "src"})


def test_overwrite_replaces_only_our_checkpoints(tmp_path):
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "notes.txt").write_text("precious")
    with pytest.raises(FileExistsError, match="--overwrite"):
        check_output_dir(foreign, overwrite=False)
    with pytest.raises(FileExistsError, match=r"holds files not written by python -m conversion \(notes.txt\)"):
        check_output_dir(foreign, overwrite=True)
    with pytest.raises(FileExistsError, match="not written by"):
        with atomic_output_dir(foreign, overwrite=True) as tmp:
            (tmp / "x").write_text("new")
    assert (foreign / "notes.txt").read_text() == "precious"
    # a marker with another format is not ours either
    (foreign / MARKER).write_text(json.dumps({"format": "something-else"}))
    assert not is_our_output(foreign)
    with pytest.raises(FileExistsError):
        check_output_dir(foreign, overwrite=True)
    (tmp_path / "file").write_text("x")
    with pytest.raises(FileExistsError, match="not a directory"):
        check_output_dir(tmp_path / "file", overwrite=True)
    (tmp_path / "empty").mkdir()
    check_output_dir(tmp_path / "empty", overwrite=True)  # nothing to lose
    check_output_dir(_ours(tmp_path / "ours"), overwrite=True)


def test_failed_write_leaves_the_old_output_and_no_temp_dirs(tmp_path):
    out = _ours(tmp_path / "out")
    with pytest.raises(RuntimeError):
        with atomic_output_dir(out, overwrite=True) as tmp:
            (tmp / "half").write_text("x")
            raise RuntimeError("crash mid-write")
    assert (out / "model.safetensors").read_text() == "old"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]
    with atomic_output_dir(out, overwrite=True) as tmp:
        (tmp / "new").write_text("y")
    assert sorted(p.name for p in out.iterdir()) == [MARKER, "new"]  # the marker is added when missing
    assert is_our_output(out)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def _dead_pid():
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_stale_temps_of_dead_writers_are_removed_and_live_ones_kept(tmp_path, caplog):
    out = tmp_path / "out"
    host = socket.gethostname()
    dead = tmp_path / f".out.tmp-0a0b0c0d-{_dead_pid()}-123@{host}"
    legacy = tmp_path / ".out.tmp-k2j3h4"  # tempfile.mkdtemp's name, from an older version
    live = tmp_path / f".out.tmp-01020304-{os.getpid()}-x@{host}"
    remote = tmp_path / f".out.tmp-01020304-{os.getpid()}-5@another-host"
    reused = tmp_path / f".out.tmp-01020304-{os.getpid()}-1@{host}"  # our pid, another start time
    other_out = tmp_path / f".other.tmp-0a0b0c0d-{_dead_pid()}-1@{host}"
    for path in (dead, legacy, live, remote, reused, other_out):
        path.mkdir()
        (path / "__0_0.distcp").write_bytes(b"\0" * 100)
    with caplog.at_level(logging.WARNING, logger="megatron_arpo.hf.outdir"):
        removed = remove_stale_temps(out)
    assert sorted(removed) == sorted([dead, legacy, reused])
    assert not dead.exists() and not legacy.exists() and not reused.exists()
    assert live.exists() and remote.exists() and other_out.exists()
    for path in (dead, legacy, reused):
        assert f"removed {path}" in caplog.text
    assert f"leaving {remote}" in caplog.text and "another-host" in caplog.text


def test_old_dir_of_an_interrupted_replace_is_kept_when_the_output_is_missing(tmp_path, caplog):
    out = tmp_path / "out"
    old = tmp_path / ".out.old-0a0b0c0d-1-1@h"
    (old / "out").mkdir(parents=True)
    with caplog.at_level(logging.WARNING, logger="megatron_arpo.hf.outdir"):
        assert remove_stale_temps(out) == []
    assert old.exists() and "move" in caplog.text
    out.mkdir()
    assert remove_stale_temps(out) == [old] and not old.exists()


@pytest.mark.parametrize("umask,mode", [(0o022, 0o755), (0o002, 0o775), (0o077, 0o700)])
def test_output_gets_the_mode_the_umask_gives(tmp_path, umask, mode):
    code = ("import sys; from megatron_arpo.hf.outdir import atomic_output_dir\n"
            "with atomic_output_dir(sys.argv[1]) as tmp: (tmp / 'sub').mkdir()\n")
    subprocess.run([sys.executable, "-c", code, str(tmp_path / "out")], check=True, umask=umask)
    assert (tmp_path / "out").stat().st_mode & 0o777 == mode
    assert (tmp_path / "out" / "sub").stat().st_mode & 0o777 == mode
    assert (tmp_path / "out" / MARKER).stat().st_mode & 0o777 == mode & 0o666
