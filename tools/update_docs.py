"""Regenerate the generated section of the docs: the config reference in docs/configuration.md."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PAGE = ROOT / "docs" / "configuration.md"


def config_reference() -> str:
    return subprocess.run([sys.executable, "-m", "megatron_arpo", "config", "reference"], cwd=ROOT,
                          capture_output=True, text=True, check=True).stdout


def generated_sections() -> dict[str, str]:
    return {"config-reference": config_reference()}


def embedded(text: str, name: str) -> str:
    return text.split(f"<!-- {name}:start -->\n", 1)[1].split(f"<!-- {name}:end -->", 1)[0]


def main() -> None:
    text = PAGE.read_text()
    for name, body in generated_sections().items():
        start, end = f"<!-- {name}:start -->\n", f"<!-- {name}:end -->"
        head, rest = text.split(start, 1)
        text = head + start + body + end + rest.split(end, 1)[1]
    PAGE.write_text(text)


if __name__ == "__main__":
    main()
