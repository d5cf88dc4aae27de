"""`make gpu-smoke` cannot rot between GPU runs: its dry run (tools/gpu_smoke.py --dry-run) runs every scenario.

The dry run drives the same scenario code a GPU run does, on the CPU (gloo, reduced width) and on fake CUDA
(the GPU's shapes); every scenario must pass, or skip with the reason it cannot be measured here. An
injected failing check, error, crash and hang are reported as such, and the scenarios after them still run.
Bad input: no GPU outside the dry run exits 2, a missing wheels folder names `make wheels`.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from support.scripts import load_script

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tools" / "gpu_smoke.py"


def _load_script():
    return load_script("tools/gpu_smoke.py", "gpu_smoke")


def _run(tmp: Path, *args: str, timeout: float = 900) -> tuple[subprocess.CompletedProcess, dict | None]:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--out", str(tmp / "out"), "--work", str(tmp / "work"), *args],
                          capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    report = tmp / "out" / "gpu_smoke.json"
    return proc, json.loads(report.read_text()) if report.exists() else None


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gpu-smoke")
    proc, report = _run(tmp, "--dry-run")
    assert report is not None, f"no report (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    return proc, report, tmp / "out"


def test_every_scenario_passes_or_skips_with_a_reason(dry_run):
    proc, report, out = dry_run
    script = _load_script()
    by_name = {s["name"]: s for s in report["scenarios"]}
    assert list(by_name) == list(script.LIMITS)
    problems = {n: (s["status"], s["reason"][:2000], s["notes"][-1:]) for n, s in by_name.items()
                if s["status"] not in ("passed", "skipped") or (s["status"] == "skipped" and not s["reason"])}
    assert not problems, problems
    assert proc.returncode == 0 and report["verdict"] == "pass", proc.stdout[-2000:]
    # What runs on the CPU really runs: its checks pass there, with numbers.
    for name in ("numerics", "packed", "update", "resume", "conversion", "offload", "ipc"):
        scenario = by_name[name]
        assert scenario["device"] == "cpu" and scenario["status"] == "passed", (name, scenario["reason"])
        assert any(c["ok"] is True for c in scenario["checks"]) and scenario["numbers"], name
        assert all(c["ok"] is not False for c in scenario["checks"]), name
    assert by_name["numerics"]["numbers"]["qwen3-32b.hf_bf16_mean_err"] > 0
    # The device-bound ones ran on fake CUDA at the GPU's shapes, and say what they could not measure.
    for name in ("memory", "throughput"):
        assert by_name[name]["device"] == "fake"
    memory = by_name["memory"]
    if "unavailable" not in memory["reason"]:
        shapes = [k for k in memory["numbers"] if k.endswith(".predicted_gib")]
        assert len(shapes) == 3, memory["numbers"]
        assert all(c["ok"] is None and "no allocator" in c["detail"] for c in memory["checks"])
        assert max(memory["numbers"][k] for k in shapes) > 0.5 * memory["numbers"]["card_bytes"] / 2**30


def test_report_structure(dry_run):
    _, report, out = dry_run
    assert report["format"] == "megatron-arpo-gpu-smoke" and report["dry_run"] is True
    for key in ("date", "environment", "setup", "wall_s", "verdict"):
        assert key in report, key
    assert report["environment"]["megatron_core"] == "0.16.1"
    for scenario in report["scenarios"]:
        assert {"name", "status", "reason", "device", "seconds", "limit_s", "checks", "numbers", "log"} <= set(scenario)
        assert (out / scenario["log"]).exists()
        for check in scenario["checks"]:
            assert set(check) == {"name", "ok", "detail"}
    markdown = (out / "gpu_smoke.md").read_text()
    assert "GPU smoke report (dry run)" in markdown
    for scenario in report["scenarios"]:
        assert f"| {scenario['name']} | {scenario['status']} |" in markdown


def test_failures_errors_crashes_and_hangs_are_reported(tmp_path):
    proc, report = _run(tmp_path, "--dry-run", "--scenarios", "_hang,_crash,_fail,_raise", "--limit-s", "45",
                        "--jobs", "1", timeout=300)
    assert proc.returncode == 1, proc.stderr[-2000:]
    statuses = {s["name"]: s["status"] for s in report["scenarios"]}
    assert statuses == {"_hang": "timeout", "_crash": "error", "_fail": "failed", "_raise": "error"}
    reasons = {s["name"]: s["reason"] for s in report["scenarios"]}
    assert "did not finish within" in reasons["_hang"] and "exit code" in reasons["_crash"]
    assert "injected failing check" in reasons["_fail"] and "RuntimeError" in reasons["_raise"]
    assert report["verdict"].startswith("FAIL")


def test_no_gpu_outside_the_dry_run_exits_2(tmp_path):
    proc, report = _run(tmp_path, "--scenarios", "numerics", timeout=120)
    assert proc.returncode == 2 and report is None
    assert "no CUDA GPU" in proc.stderr and "--dry-run" in proc.stderr


def test_missing_wheels_name_the_make_step(tmp_path, capsys):
    script = _load_script()
    with pytest.raises(SystemExit) as exc:
        script.install_wheels(tmp_path / "absent", tmp_path / "site")
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "make wheels" in err


def test_unknown_scenario_is_refused(tmp_path):
    proc, _ = _run(tmp_path, "--dry-run", "--scenarios", "numerics,bogus", timeout=120)
    assert proc.returncode == 2 and "bogus" in proc.stderr and "numerics" in proc.stderr
