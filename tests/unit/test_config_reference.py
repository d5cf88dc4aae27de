"""docs/configuration.md embeds `megatron-arpo config reference`: the table of every config key equals the code."""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_config_reference_page_is_current():
    sys.path.insert(0, str(ROOT / "tools"))
    try:
        import update_docs
    finally:
        sys.path.pop(0)
    text = update_docs.PAGE.read_text()
    for name, body in update_docs.generated_sections().items():
        assert update_docs.embedded(text, name) == body, (
            f"{update_docs.PAGE.relative_to(ROOT)} section {name!r} is stale: run `.venv/bin/python tools/update_docs.py`")
    assert "| `model.config` |" in body and "| `tools.python.sandbox` |" in body  # the table holds every section
