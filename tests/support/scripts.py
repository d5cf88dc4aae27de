"""Import a repository script (a benchmark, a tool) that is not a package module, by its path."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[2]


def load_script(relative: str, name: str) -> ModuleType:
    """``ROOT/relative`` executed as module ``name`` (not added to ``sys.modules``)."""
    spec = importlib.util.spec_from_file_location(name, ROOT / relative)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
