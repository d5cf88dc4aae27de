"""The README's promises: the two commands first, CI calls them, a page a new user reads top to bottom (at most
15 KB), every docs page reachable from it, and nothing copied between it and a docs page."""

import configparser
import fnmatch
import re
from pathlib import Path

from test_docs_links import links, markdown_pages, without_code

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
MAX_BYTES = 15_000
MIN_SENTENCE = 60  # characters: shorter sentences ("Both are refused.") may recur by chance


def test_readme_opens_with_the_two_commands():
    text = README.read_text()
    first_block = re.search(r"```bash\n(.*?)```", text, re.S).group(1)
    commands = [line.split("#")[0].strip() for line in first_block.splitlines() if line.strip()]
    assert commands == ["make demo", "make test"]
    assert text.index("make demo") < text.index("## ")


def test_ci_runs_make_test():
    script = (ROOT / ".ci" / "run").read_text()
    assert re.search(r"^make test\s*$", script, re.M)


def test_make_test_collects_every_test_directory():
    """pytest skips directories matching ``norecursedirs`` (its default list holds ``dist``): none of ours may."""
    ini = configparser.ConfigParser()
    ini.read(ROOT / "pytest.ini")
    patterns = ini["pytest"].get("norecursedirs", "").split()
    assert patterns, "pytest.ini must set norecursedirs: pytest's default list skips tests/dist"
    dirs = {path.parent for path in (ROOT / "tests").rglob("test_*.py")}
    assert ROOT / "tests" / "dist" in dirs
    skipped = [str(d.relative_to(ROOT)) for d in dirs for part in d.relative_to(ROOT).parts
               if any(fnmatch.fnmatch(part, pattern) for pattern in patterns)]
    assert not skipped, f"make test would not collect {skipped}; change norecursedirs in pytest.ini"


def test_make_test_runs_the_unit_tier_and_every_other_tier():
    """The test target's two pytest runs together cover tests/: the unit tier, and everything but it."""
    recipe = re.search(r"^test:.*?\n((?:\t.*\n)+)", (ROOT / "Makefile").read_text(), re.M).group(1)
    runs = re.findall(r"-m pytest (.*?) \$\(PYTEST_ARGS\)", recipe)
    assert sorted(runs) == ["-n $(HEAVY_WORKERS) --dist loadgroup tests --ignore=tests/unit", "-n 2 tests/unit"], runs


def test_readme_is_at_most_15_kb():
    size = len(README.read_bytes())
    assert size <= MAX_BYTES, f"README.md is {size} bytes (at most {MAX_BYTES}): move a section into a page under docs/"


def test_readme_says_what_has_run_on_a_gpu_before_the_demo():
    text = README.read_text()
    status = text.index("## Status")
    assert status < text.index("## The CPU demo") < text.index("## The 32B run")
    box = text[status:text.index("## The CPU demo")]
    assert "docs/gpu_smoke.md" in box
    # Every GPU run the box cites is a recorded section of benchmarks/RESULTS.md (the report and its command).
    results = (README.parent / "benchmarks/RESULTS.md").read_text()
    anchors = {re.sub(r"[^a-z0-9 -]", "", h.lower()).replace(" ", "-") for h in re.findall(r"^## (.+)$", results, re.M)}
    cited = re.findall(r"benchmarks/RESULTS\.md#([a-z0-9-]+)", box)
    assert cited and set(cited) <= anchors, (cited, sorted(a for a in anchors if "gpu" in a))


def test_the_32b_run_is_ten_numbered_steps():
    text = README.read_text()
    section = text.split("## The 32B run, step by step", 1)[1].split("\n## ", 1)[0]
    steps = re.findall(r"^(\d+)\. \*\*(\w+)", section, re.M)
    assert steps == [(str(i), name) for i, name in enumerate(
        ["Install", "Doctor", "Checkpoint", "Data", "Retriever", "Validate", "Launch", "Watch", "Evaluate", "Export"], 1)]


def _linked_pages(page: Path) -> set[Path]:
    out = set()
    for _line, target in links(page.read_text(encoding="utf-8")):
        path = target.split("#", 1)[0]
        if path and "://" not in path:
            dest = (page.parent / path).resolve()
            if dest.suffix == ".md" and dest.is_file():
                out.add(dest)
    return out


def reachable_from_readme() -> tuple[set[Path], set[Path]]:
    """(pages the README links directly, pages reachable from it through links)."""
    direct = _linked_pages(README)
    seen, todo = set(direct), list(direct)
    while todo:
        for dest in _linked_pages(todo.pop()) - seen:
            seen.add(dest)
            todo.append(dest)
    return direct, seen


def test_every_docs_page_is_linked_from_the_readme():
    # docs/*.md directly; docs/design/ (and any deeper page) through its index page.
    direct, reachable = reachable_from_readme()
    pages = [p.resolve() for p in markdown_pages() if p != README]
    unlinked = [p.relative_to(ROOT).as_posix() for p in pages if p.parent == ROOT / "docs" and p not in direct]
    unreached = [p.relative_to(ROOT).as_posix() for p in pages if p not in reachable]
    assert not unlinked, f"link these pages from README.md's Documentation table: {unlinked}"
    assert not unreached, f"no chain of links from README.md reaches {unreached}"


def prose_sentences(text: str) -> list[str]:
    """The sentences of a page's prose (not code, tables or headings), whitespace folded."""
    paragraphs, current = [], []
    for line in without_code(text).splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith(("#", "|", "<!--")):
            paragraphs.append(" ".join(current))
            current = []
            continue
        current.append(re.sub(r"^(?:[-*>]|\d+\.)\s+", "", stripped))
    paragraphs.append(" ".join(current))
    return [s for p in paragraphs for s in re.split(r"(?<=[.!?;])\s+", p) if len(s) >= MIN_SENTENCE]


def copied_sentences(readme: str, pages: dict[str, str]) -> list[str]:
    folded = {name: " ".join(without_code(text).split()) for name, text in pages.items()}
    return [f"{name}: {sentence!r}" for sentence in prose_sentences(readme)
            for name, page in folded.items() if sentence in page]


def test_nothing_is_copied_between_the_readme_and_a_page():
    pages = {p.relative_to(ROOT).as_posix(): p.read_text(encoding="utf-8") for p in markdown_pages() if p != README}
    copies = copied_sentences(README.read_text(), pages)
    assert not copies, "say it in one place and link it:\n" + "\n".join(copies)


def test_the_copy_check_can_fail():
    readme = ("# R\n\nThe launcher writes the resolved config and the sbatch script into the run directory,\n"
              "then submits it. Short one.\n\n```bash\nthe same sentence in code does not count, however long it is.\n```\n")
    page = "# P\n\nIt says: the launcher writes the resolved config and the sbatch script into the run\ndirectory, then."
    assert copied_sentences(readme, {"p.md": page}) == []  # case and punctuation differ: not a copy
    page = "- The launcher writes the resolved config and the sbatch script into the run directory,\n  then submits it."
    assert copied_sentences(readme, {"p.md": page}) == [
        "p.md: 'The launcher writes the resolved config and the sbatch script into the run directory, then submits it.'"]
