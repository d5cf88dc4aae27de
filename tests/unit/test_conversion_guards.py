"""The CLI with a user's only copy: refused paths, --overwrite, corrupt inputs, killed runs (subprocesses)."""

import json
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conversion.verify import compare_hf_dirs
from support.real_shaped import build_real_shaped_checkpoint
from megatron_arpo.tiny.checkpoint import tiny_checkpoint
from test_conversion_cli import run_cli


@pytest.fixture(scope="module")
def converted(tmp_path_factory):
    """A tiny HF checkpoint (copy) and its Megatron conversion."""
    root = tmp_path_factory.mktemp("guards")
    hf = root / "hf"
    shutil.copytree(tiny_checkpoint("tiny-qwen3-untied"), hf)
    run_cli("hf-to-megatron", "--hf", hf, "--out", root / "mg")
    return hf, root / "mg"


def _assert_clean_error(proc, *fragments):
    assert proc.returncode == 2, (proc.returncode, proc.stderr[-2000:])
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    error = [line for line in proc.stderr.splitlines() if line.startswith("megatron-arpo convert ") and ": error: " in line]
    assert error, proc.stderr[-2000:]
    for fragment in fragments:
        assert fragment in proc.stderr, (fragment, proc.stderr[-2000:])


def _tree(path: Path) -> dict:
    return {str(p.relative_to(path)): p.read_bytes() for p in sorted(path.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------- paths

def test_out_equal_to_inside_or_containing_the_source_is_refused(converted, tmp_path):
    hf, mg = converted
    before_hf, before_mg = _tree(hf), _tree(mg)
    cases = [
        ("hf-to-megatron", "--hf", hf, hf, "is the same directory as --hf"),
        ("hf-to-megatron", "--hf", hf, hf / "mg", "is inside --hf"),
        ("hf-to-megatron", "--hf", hf, hf.parent, "contains --hf"),
        ("megatron-to-hf", "--megatron", mg, mg, "is the same directory as --megatron"),
        ("megatron-to-hf", "--megatron", mg, mg / "hf", "is inside --megatron"),
        ("megatron-to-hf", "--megatron", mg, mg.parent, "contains --megatron"),
    ]
    for command, option, source, out, message in cases:
        proc = run_cli(command, option, source, "--out", out, "--overwrite", check=False)
        _assert_clean_error(proc, message, str(source))
    proc = run_cli("megatron-to-hf", "--megatron", mg, "--out", hf, "--tokenizer", hf, "--overwrite", check=False)
    _assert_clean_error(proc, "is the same directory as --tokenizer")
    assert _tree(hf) == before_hf and _tree(mg) == before_mg  # nothing touched


def test_overwrite_replaces_our_output_but_never_other_content(converted, tmp_path):
    hf, mg = converted
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("years of work")
    proc = run_cli("megatron-to-hf", "--megatron", mg, "--out", foreign, "--overwrite", check=False)
    _assert_clean_error(proc, "holds files not written by python -m conversion (thesis.tex)")
    assert _tree(foreign) == {"thesis.tex": b"years of work"}
    # another HF checkpoint (not ours) is content too
    proc = run_cli("hf-to-megatron", "--hf", hf, "--out", tiny_checkpoint("tiny-qwen3"), "--overwrite", check=False)
    _assert_clean_error(proc, "no conversion.json marker")
    # our own output is replaced
    run_cli("megatron-to-hf", "--megatron", mg, "--out", tmp_path / "out")
    (tmp_path / "out" / "model.safetensors").write_bytes(b"stale")
    run_cli("megatron-to-hf", "--megatron", mg, "--out", tmp_path / "out", "--overwrite")
    assert compare_hf_dirs(hf, tmp_path / "out") == []
    assert sorted(p.name for p in tmp_path.iterdir()) == ["foreign", "out"]


# ---------------------------------------------------------------------------------------------- corrupt input

def test_corrupt_config_json_is_named(converted, tmp_path):
    hf, _ = converted
    bad = tmp_path / "hf"
    shutil.copytree(hf, bad)
    (bad / "config.json").write_text('{"model_type": "qwen3", "hidden_size": 25')
    proc = run_cli("hf-to-megatron", "--hf", bad, "--out", tmp_path / "mg", check=False)
    _assert_clean_error(proc, f"{bad / 'config.json'}: not valid JSON")
    assert not (tmp_path / "mg").exists()


def test_corrupt_index_json_is_named(converted, tmp_path):
    hf, mg = converted
    sharded = tmp_path / "sharded"
    run_cli("megatron-to-hf", "--megatron", mg, "--out", sharded, "--max-shard-size", "1MB")
    index = sharded / "model.safetensors.index.json"
    index.write_text(index.read_text()[:100])
    proc = run_cli("hf-to-megatron", "--hf", sharded, "--out", tmp_path / "mg", check=False)
    _assert_clean_error(proc, f"{index}: not valid JSON")
    index.write_text(json.dumps({"metadata": {}}))
    proc = run_cli("hf-to-megatron", "--hf", sharded, "--out", tmp_path / "mg", check=False)
    _assert_clean_error(proc, f"{index}: no \"weight_map\"")


def test_truncated_or_corrupt_megatron_files_are_named(converted, tmp_path):
    _, mg = converted
    bad = tmp_path / "mg"
    shutil.copytree(mg, bad)
    shard = next(bad.glob("*.distcp"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 3])
    proc = run_cli("megatron-to-hf", "--megatron", bad, "--out", tmp_path / "hf", check=False)
    _assert_clean_error(proc, f"{shard}: truncated .distcp shard", "copy it again")
    shard.write_bytes(data[:100] + b"\xff" * (len(data) - 100))  # right size, garbage bytes
    proc = run_cli("megatron-to-hf", "--megatron", bad, "--out", tmp_path / "hf", check=False)
    _assert_clean_error(proc, f"{shard}: ", "not a readable torch.save record", "the shard is corrupt")
    shard.write_bytes(data)
    (bad / ".metadata").write_bytes((bad / ".metadata").read_bytes()[:50])
    proc = run_cli("megatron-to-hf", "--megatron", bad, "--out", tmp_path / "hf", check=False)
    _assert_clean_error(proc, f"{bad / '.metadata'}: cannot be read")
    (bad / "metadata.json").write_text("{")
    proc = run_cli("megatron-to-hf", "--megatron", bad, "--out", tmp_path / "hf", check=False)
    _assert_clean_error(proc, f"{bad / 'metadata.json'}: not readable JSON")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mg"]  # no output, no temp dirs


# ---------------------------------------------------------------------------------------------- killed runs

@pytest.fixture(scope="module")
def big_hf(tmp_path_factory):
    """Large enough (0.4 GB, bf16) that a conversion is still writing when the test kills it."""
    return build_real_shaped_checkpoint("qwq-32b", tmp_path_factory.mktemp("big") / "hf", num_layers=2,
                                        width_divisor=8)


def _kill_mid_write(args, out: Path, sig: int, data_glob: str):
    proc = subprocess.Popen([sys.executable, "-m", "conversion", *map(str, args)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    tmp = None
    while time.monotonic() < deadline and proc.poll() is None:
        temps = list(out.parent.glob(f".{out.name}.tmp-*"))
        if temps and any(f.stat().st_size > 0 for f in temps[0].glob(data_glob)):
            tmp = temps[0]
            proc.send_signal(sig)
            break
        time.sleep(0.005)
    _, err = proc.communicate(timeout=120)
    assert tmp is not None, f"never saw the temp dir being written (exit {proc.returncode}): {err[-2000:]}"
    return proc.returncode, err, tmp


def test_sigkill_leaves_a_temp_dir_that_the_next_run_removes(big_hf, tmp_path):
    out = tmp_path / "mg"
    args = ["hf-to-megatron", "--hf", big_hf, "--out", out, "--tp", 2]
    code, _, tmp = _kill_mid_write(args, out, signal.SIGKILL, "*.distcp")
    assert code == -signal.SIGKILL and tmp.exists() and not out.exists()
    proc = run_cli(*args)
    assert f"removed {tmp}" in proc.stderr  # a log line names it
    assert not tmp.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["mg"]
    run_cli("megatron-to-hf", "--megatron", out, "--out", tmp_path / "back")
    assert compare_hf_dirs(big_hf, tmp_path / "back") == []


def test_sigterm_removes_the_temp_dir_at_once(big_hf, tmp_path):
    run_cli("hf-to-megatron", "--hf", big_hf, "--out", tmp_path / "mg")
    out = tmp_path / "hf"
    code, err, tmp = _kill_mid_write(["megatron-to-hf", "--megatron", tmp_path / "mg", "--out", out], out,
                                     signal.SIGTERM, "*.safetensors")
    assert code == 128 + signal.SIGTERM and "Traceback" not in err, err[-2000:]
    assert not tmp.exists() and not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mg"]


def test_outputs_get_the_mode_the_umask_gives(converted, tmp_path):
    hf, mg = converted
    for umask, mode in ((0o002, 0o775), (0o022, 0o755)):
        for command, option, source in (("hf-to-megatron", "--hf", hf), ("megatron-to-hf", "--megatron", mg)):
            out = tmp_path / f"{command}-{umask:o}"
            subprocess.run([sys.executable, "-m", "conversion", command, option, str(source), "--out", str(out)],
                           check=True, capture_output=True, umask=umask, timeout=300)
            for path in (out, *out.rglob("*")):
                want = mode if path.is_dir() else mode & 0o666
                assert path.stat().st_mode & 0o777 == want, (oct(path.stat().st_mode), path)
