"""The repository stands alone: every page and section its code and docs cite is in the repository.

The tracked (and untracked, not ignored) .py and .md files are scanned for citations of markdown pages:
paths under a top-level folder of the repository (``benchmarks/RESULTS.md``), upper-case bare names
(``README.md``) and markdown links; and for numbered sections (``docs/design/arpo_reference.md §3.2``,
``§2.4-2.5``). A cited page must exist, at the repository root or beside the citing file. A cited section
must be a numbered heading (``## 3.2 Token loss``) of its page: the page named right before the ``§``, else
the design page (docs/design/) the file cites nearest before it, else the first one it cites after it; a
design page's bare ``§`` points at itself. Nothing may point at the team's notes outside the repository.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DESIGN = "docs/design/"
# A path-like token ending in .md, not the tail of a longer path, URL or ``<run_dir>/x.md`` placeholder.
PAGE = re.compile(r"(?<![\w/.<>:-])((?:[\w.-]+/)*[\w.-]+\.md)(?![\w/])")
LINK = re.compile(r"\]\(([^)\s#]+\.md)(?:#[^)]*)?\)")
UPPER_NAME = re.compile(r"[A-Z][A-Z0-9_]*\.md")
SECTION = re.compile(r"§\s*(\d+(?:\.\d+)*)(?:\s*[-–]\s*(\d+(?:\.\d+)*))?")
HEADING = re.compile(r"^#{1,6}[ \t]+(\d+(?:\.\d+)*)\.?[ \t]", re.M)
OUTSIDE = re.compile("shared" + r"/design")
SELF = Path(__file__).resolve().relative_to(ROOT).as_posix()  # its fixtures are broken on purpose


def _repository_files() -> list[str]:
    try:
        out = subprocess.run(["git", "ls-files", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                             capture_output=True, text=True, check=True).stdout
        names = out.splitlines()
    except (OSError, subprocess.CalledProcessError):  # not a git checkout: every file outside hidden/venv dirs
        names = [p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*")
                 if not any(part.startswith(".") or part in ("build", "runs") for part in p.relative_to(ROOT).parts)]
    return sorted({name for name in names if (ROOT / name).is_file()})


FILES = _repository_files()
FILE_SET = set(FILES)
TOP_DIRS = {name.split("/")[0] for name in FILES if "/" in name}


def _resolve(token: str, citing: str, relative_only: bool = False) -> str | None:
    """The repository file a cited name means, or None when there is none."""
    here = Path(citing).parent
    candidates = [here / token] if relative_only else [Path(token), here / token]
    for candidate in candidates:
        name = Path(*[p for p in candidate.parts if p != "."]).as_posix()
        parts: list[str] = []
        for part in name.split("/"):
            if part == ".." and parts:
                parts.pop()
            else:
                parts.append(part)
        name = "/".join(parts)
        if name in FILE_SET:
            return name
    return None


def _page_citations(text: str, citing: str) -> list[tuple[int, int, str, str | None]]:
    """(start, end, token, resolved path or None) of every page citation in the text."""
    found = []
    for match in PAGE.finditer(text):
        token = match.group(1)
        if "/" in token and token.split("/")[0] not in TOP_DIRS:
            continue  # an output path (runs/..., <run_dir>/...), not a page of this repository
        if "/" not in token and not UPPER_NAME.fullmatch(token):
            continue  # a lowercase bare name is a file a program writes (summary.md, results.md)
        found.append((match.start(), match.end(), token, _resolve(token, citing)))
    if citing.endswith(".md"):
        for match in LINK.finditer(text):
            token = match.group(1)
            if "://" not in token:
                found.append((match.start(1), match.end(1), token, _resolve(token, citing, relative_only=True)))
    return sorted(found)


def _sections_of(page: str) -> set[str]:
    return set(HEADING.findall((ROOT / page).read_text(encoding="utf-8")))


def _section_page(text: str, citing: str, pos: int, pages) -> str | None:
    """The page a ``§`` at ``pos`` refers to (see the module docstring); "" when that page is missing."""
    before = [p for p in pages if p[1] <= pos]
    if before and re.fullmatch(r"[\s,`*\"']*", text[before[-1][1]:pos]):
        return before[-1][3] or ""
    if citing.startswith(DESIGN):
        return citing
    design_before = [p for p in before if p[3] and p[3].startswith(DESIGN)]
    if design_before:
        return design_before[-1][3]
    design_after = [p for p in pages if p[0] >= pos and p[3] and p[3].startswith(DESIGN)]
    return design_after[0][3] if design_after else None


def citation_problems(files=None) -> list[str]:
    problems = []
    for citing in files if files is not None else FILES:
        if not citing.endswith((".py", ".md")) or citing == SELF:
            continue
        text = (ROOT / citing).read_text(encoding="utf-8", errors="replace")

        def where(pos: int) -> str:
            return f"{citing}:{text.count(chr(10), 0, pos) + 1}"

        for match in OUTSIDE.finditer(text):
            problems.append(f"{where(match.start())}: points outside the repository ({match.group(0)!r}); "
                            f"write the fact into a page under {DESIGN} and cite that")
        pages = _page_citations(text, citing)
        for start, _end, token, resolved in pages:
            if resolved is None:
                problems.append(f"{where(start)}: cites {token}, which is not in the repository; cite a page "
                                f"of this repository by its path (facts from elsewhere go under {DESIGN})")
        for match in SECTION.finditer(text):
            page = _section_page(text, citing, match.start(), pages)
            if page == "":
                continue  # the missing page is reported already
            if page is None:
                problems.append(f"{where(match.start())}: cites {match.group(0)!r} without naming the page; "
                                f"write it as '{DESIGN}<page>.md {match.group(0)}'")
                continue
            headings = _sections_of(page)
            for number in filter(None, match.groups()):
                if number not in headings:
                    problems.append(f"{where(match.start())}: cites {page} §{number}, which has no heading "
                                    f"numbered {number} (add '## {number} ...' to {page} or fix the number)")
    return problems


def test_cited_pages_and_sections_exist():
    problems = citation_problems()
    assert not problems, "\n".join(problems)


def test_the_checker_catches_what_it_must(tmp_path, monkeypatch):
    # The scan itself can fail: a missing page, a missing section, a bare §, a path outside the repository.
    monkeypatch.setattr(sys.modules[__name__], "ROOT", tmp_path)
    (tmp_path / "docs" / "design").mkdir(parents=True)
    (tmp_path / "docs" / "design" / "page.md").write_text("# Page\n\n## 3 Loss\n\n### 3.2 Token loss\n")
    (tmp_path / "pkg").mkdir()
    (tmp_path / "pkg" / "a.py").write_text(
        '"""As docs/design/page.md §3.2 and §3; docs/design/page.md §3.4; NOTES.md; §9 later.\n'
        "Also docs/design/gone.md, and " + "shared" + '/design/X.md."""\n')
    (tmp_path / "pkg" / "b.py").write_text('"""Bare §2 with no page."""\n')
    files = ["docs/design/page.md", "pkg/a.py", "pkg/b.py"]
    monkeypatch.setattr(sys.modules[__name__], "FILE_SET", set(files))
    monkeypatch.setattr(sys.modules[__name__], "TOP_DIRS", {"docs", "pkg"})
    text = "\n".join(citation_problems(files))
    assert "pkg/a.py:1: cites docs/design/page.md §3.4" in text
    assert "pkg/a.py:1: cites NOTES.md" in text
    assert "pkg/a.py:1: cites docs/design/page.md §9" in text
    assert "pkg/a.py:2: cites docs/design/gone.md" in text
    assert "pkg/a.py:2: points outside the repository" in text
    assert "pkg/b.py:1: cites '§2' without naming the page" in text
    assert "§3.2," not in text and "§3 " not in text
