"""Every relative link in README.md and docs/**/*.md points at a file of the repository, and every ``#anchor`` at a
heading of its page, slugged as GitHub slugs it.

GitHub's heading ids: the heading's text as rendered (code spans and link targets gone, their text kept), lower
case, every character that is not a letter, digit, ``_``, ``-`` or space dropped, each space a ``-``; a repeated
id gets ``-1``, ``-2``, ... in page order. ``<a id="x">`` / ``<a name="x">`` add ids too. Links inside code
(fenced blocks, code spans) are not links. Nothing is exempt: a link into a page another branch writes needs
that page.
"""

from __future__ import annotations

import re
import sys
from collections import Counter
from pathlib import Path
from urllib.parse import unquote

ROOT = Path(__file__).resolve().parents[2]
FENCE = re.compile(r"^ {0,3}(```|~~~).*?^ {0,3}\1[^\n]*$", re.M | re.S)
CODE_SPAN = re.compile(r"(`+)(.+?)\1", re.S)
INLINE_LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]*)>?(?:\s+\"[^\"]*\")?\s*\)")
REFERENCE_DEF = re.compile(r"^ {0,3}\[[^\]]+\]:\s*<?(\S+?)>?(?:\s+\"[^\"]*\")?\s*$", re.M)
HEADING = re.compile(r"^ {0,3}(#{1,6})[ \t]+(.*?)[ \t#]*$", re.M)
HTML_ID = re.compile(r"<a\s+(?:id|name)=\"([^\"]+)\"", re.I)
SCHEME = re.compile(r"^[a-zA-Z][a-zA-Z0-9+.-]*:")


def markdown_pages(root: Path = None) -> list[Path]:
    root = root or ROOT
    pages = [root / "README.md"] + sorted((root / "docs").rglob("*.md"))
    return [p for p in pages if p.is_file()]


def without_code(text: str) -> str:
    """The text with fenced blocks blanked (line numbers kept) and code spans emptied."""
    text = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    return CODE_SPAN.sub("``", text)


def slug(heading: str) -> str:
    text = CODE_SPAN.sub(lambda m: m.group(2), heading)
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", text)  # a link's text stays, its target goes
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML tags
    text = re.sub(r"[^\w\- ]", "", text.strip().lower())
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    found, seen = set(), Counter()
    fenced = FENCE.sub(lambda m: "\n" * m.group(0).count("\n"), text)
    for match in HEADING.finditer(fenced):
        base = slug(match.group(2))
        found.add(base if seen[base] == 0 else f"{base}-{seen[base]}")
        seen[base] += 1
    found.update(HTML_ID.findall(text))
    return found


def links(text: str) -> list[tuple[int, str]]:
    """(line, target) of every link and reference definition outside code."""
    plain = without_code(text)
    found = [(m.start(1), m.group(1)) for m in INLINE_LINK.finditer(plain)]
    found += [(m.start(1), m.group(1)) for m in REFERENCE_DEF.finditer(plain)]
    return sorted((plain.count("\n", 0, pos) + 1, target) for pos, target in found)


def link_problems(pages=None, root: Path = None) -> list[str]:
    root = root or ROOT
    problems, anchor_cache = [], {}
    for page in pages if pages is not None else markdown_pages(root):
        text = page.read_text(encoding="utf-8")
        where = page.relative_to(root).as_posix()
        for line, target in links(text):
            if not target or SCHEME.match(target) or target.startswith("//"):
                continue  # an external URL (checked by nobody here), or an empty link
            path_part, _, anchor = target.partition("#")
            dest = (page.parent / unquote(path_part)).resolve() if path_part else page.resolve()
            if root.resolve() not in (dest, *dest.parents):
                problems.append(f"{where}:{line}: {target} points outside the repository")
                continue
            if not dest.exists():
                problems.append(f"{where}:{line}: {target}: no file {dest.relative_to(root.resolve()).as_posix()}")
                continue
            if not anchor:
                continue
            if dest.is_dir() or dest.suffix != ".md":
                problems.append(f"{where}:{line}: {target}: an anchor needs a markdown page to point into")
                continue
            if dest not in anchor_cache:
                anchor_cache[dest] = anchors(dest.read_text(encoding="utf-8"))
            if unquote(anchor) not in anchor_cache[dest]:
                near = sorted(a for a in anchor_cache[dest] if a[:6] == anchor[:6])
                problems.append(f"{where}:{line}: {target}: no heading with id '{anchor}' in "
                                f"{dest.relative_to(root.resolve()).as_posix()}" + (f" (did you mean {near}?)" if near else ""))
    return problems


def test_every_relative_link_and_anchor_resolves():
    problems = link_problems()
    assert not problems, "\n".join(problems)


def test_slugs_follow_github():
    assert slug("Checking a node: `megatron-arpo doctor`") == "checking-a-node-megatron-arpo-doctor"
    assert slug("Slurm: the 32B recipes (4 nodes x 8 GPUs)") == "slurm-the-32b-recipes-4-nodes-x-8-gpus"
    assert slug("Replaying a step's rollouts") == "replaying-a-steps-rollouts"
    assert slug("`--dry-run` output") == "--dry-run-output"
    assert slug("See [the page](x.md) now") == "see-the-page-now"
    assert slug("tools.python_sandbox & co") == "toolspython_sandbox--co"


def test_the_checker_catches_what_it_must(tmp_path):
    # The fixture's pages live under guide/, not docs/: test_docs_citations.py reads docs/... in this file as citations.
    (tmp_path / "guide" / "sub").mkdir(parents=True)
    (tmp_path / "tools").mkdir()
    (tmp_path / "tools" / "x.py").write_text("")
    (tmp_path / "guide" / "a.md").write_text(
        "# A\n\n## Same\n\n## Same\n\n```bash\n# Not a heading\n[fenced](gone.md)\n```\n\n<a id=\"custom\"></a>\n")
    (tmp_path / "README.md").write_text(
        "# R\n\n"
        "[ok](guide/a.md#same-1) [ok](guide/a.md#custom) [ok](#r) [ok](tools/x.py) [ok](guide/sub/) "
        "[ext](https://example.com/gone.md) `[code](gone.md)`\n"
        "[missing file](guide/gone.md)\n"
        "[missing anchor](guide/a.md#same-2)\n"
        "[fenced heading](guide/a.md#not-a-heading)\n"
        "[anchor on code](tools/x.py#L1)\n"
        "[escape](../outside.md)\n"
        "[own anchor](#nope)\n"
        "[ref]: guide/also-gone.md\n")
    problems = link_problems(root=tmp_path, pages=[tmp_path / "README.md", tmp_path / "guide" / "a.md"])
    text = "\n".join(problems)
    expected = ["README.md:4: guide/gone.md: no file guide/gone.md",
                "README.md:5: guide/a.md#same-2: no heading with id 'same-2'",
                "README.md:6: guide/a.md#not-a-heading: no heading",
                "README.md:7: tools/x.py#L1: an anchor needs a markdown page",
                "README.md:8: ../outside.md points outside the repository",
                "README.md:9: #nope: no heading with id 'nope' in README.md",
                "README.md:10: guide/also-gone.md: no file"]
    assert [e for e in expected if e not in text] == [], text
    assert len(problems) == 7, text  # nothing else: the good links, the URL, the code span and the fenced link pass


if __name__ == "__main__":
    print("\n".join(link_problems()) or "all links resolve")
    sys.exit(0)
