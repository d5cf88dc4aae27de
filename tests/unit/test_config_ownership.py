"""Each component owns its config once: no two dataclasses define the same settings with defaults.

A setting mirrored in a second dataclass (an options class copying a config section field by field) has
its default written twice, and the two drift apart (the web-search timeout was 60 s in the tool registry
and 30 s in the config). This test reads every dataclass of the project's packages from source (no
imports) and fails when two of them share ``MIN_SHARED`` or more field names that both give a default,
unless one class extends the other (``LauncherOptions(LauncherSection)`` adds only ``run_dir``). A default
that names another class's field (``ready_timeout: float = LauncherSection.ready_timeout``) is taken from
there, not defined again.

``KNOWN_MIRRORS`` lists the pairs not yet folded, each with the reason; the test also fails when one of
them is gone, so the list only shrinks.
"""

from __future__ import annotations

import ast
import itertools
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
PACKAGES = ("megatron_arpo", "conversion", "launchers", "evaluation")
MIN_SHARED = 5
KNOWN_MIRRORS: dict[tuple[str, str], str] = {  # (class, class) -> why it is not folded yet
    ("JudgeSection", "SearchToolSection"): "not a mirror: two unrelated HTTP clients (the eval judge, the web search "
                                           "tool) share generic names (enabled, url, api_key_env, timeout_s, "
                                           "max_concurrency: issue 30's per-tool limit)",
}


def _is_dataclass(node: ast.ClassDef) -> bool:
    for deco in node.decorator_list:
        target = deco.func if isinstance(deco, ast.Call) else deco
        name = target.attr if isinstance(target, ast.Attribute) else getattr(target, "id", "")
        if name == "dataclass":
            return True
    return False


def _dataclasses() -> dict[str, tuple[str, set[str], set[str]]]:
    """class name -> (file, base class names, names of the fields that have a default)."""
    out = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for node in ast.walk(tree):
                if not (isinstance(node, ast.ClassDef) and _is_dataclass(node)):
                    continue
                defaults = {stmt.target.id for stmt in node.body if isinstance(stmt, ast.AnnAssign)
                            and stmt.value is not None and isinstance(stmt.target, ast.Name)
                            and not isinstance(stmt.value, ast.Attribute)}
                bases = {getattr(b, "id", getattr(b, "attr", "")) for b in node.bases}
                out[node.name] = (str(path.relative_to(REPO)), bases, defaults)
    return out


def mirrored_pairs() -> dict[tuple[str, str], list[str]]:
    classes = _dataclasses()
    pairs = {}
    for (a, (_, bases_a, fields_a)), (b, (_, bases_b, fields_b)) in itertools.combinations(sorted(classes.items()), 2):
        if a in bases_b or b in bases_a:
            continue
        shared = sorted(fields_a & fields_b)
        if len(shared) >= MIN_SHARED:
            pairs[(a, b)] = shared
    return pairs


def test_the_scan_sees_the_config_sections():
    classes = _dataclasses()
    for name in ("RolloutSection", "ToolsSection", "LauncherSection", "AlgorithmSection", "ModelConfig"):
        assert name in classes, name
    assert "timeout_s" in classes["SearchToolSection"][2]


def test_no_setting_is_defined_in_two_dataclasses():
    pairs = mirrored_pairs()
    new = {pair: fields for pair, fields in pairs.items() if pair not in KNOWN_MIRRORS}
    assert not new, "settings defined (with defaults) in two dataclasses; let one component own them and the " \
                    f"other compose or extend it: {new}"
    gone = sorted(set(KNOWN_MIRRORS) - set(pairs))
    assert not gone, f"these mirrors are folded now: remove them from KNOWN_MIRRORS: {gone}"


def test_the_scan_catches_a_mirror(tmp_path, monkeypatch):
    """A copy of a section's fields in another dataclass is reported (the check can fail)."""
    pkg = tmp_path / "megatron_arpo"
    pkg.mkdir()
    (pkg / "a.py").write_text("from dataclasses import dataclass\n@dataclass\nclass Section:\n"
                              + "".join(f"    f{i}: int = {i}\n" for i in range(6)))
    (pkg / "b.py").write_text("import dataclasses\n@dataclasses.dataclass(frozen=True)\nclass Options:\n"
                              + "".join(f"    f{i}: int = {i + 1}\n" for i in range(6)))
    monkeypatch.setattr(__import__(__name__), "REPO", tmp_path)
    monkeypatch.setattr(__import__(__name__), "PACKAGES", ("megatron_arpo",))
    assert mirrored_pairs() == {("Options", "Section"): [f"f{i}" for i in range(6)]}
