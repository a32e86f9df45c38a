"""The docs read as a reference, not a lab notebook.

README.md, DEVELOPERS.md, docs/**/*.md, configs/*.yaml and benchmarks/*.py hold no development-diary wording
(which stop or session changed what, issue numbers, "the main job"), and every relative markdown link in the
docs points at a file that exists (and at a heading that exists, where it names one).
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

DIARY_PHRASES = [
    re.compile(p, re.IGNORECASE)
    for p in (
        r"\bstop\s+\d+\b",
        r"\bthis\s+(wave|session)\b",
        r"\bprevious\s+(wave|sessions?)\b",
        r"\btried,?\s+(and\s+)?not\s+kept\b",
        r"\(issue\s+\d+\)",
        r"\bissue\s+\d+\b",
        r"\bissue's\s+targets?\b",
        r"development\s+machine",
        r"\bmain\s+job\b",
    )
]


def documentation_files(repo: Path = REPO) -> list[Path]:
    files = [repo / "README.md", repo / "DEVELOPERS.md", repo / "ARCHITECTURE.md"]
    files += sorted((repo / "docs").rglob("*.md"))
    files += sorted((repo / "configs").glob("*.yaml"))
    files += sorted((repo / "benchmarks").glob("*.py"))
    return [f for f in files if f.is_file()]


def diary_hits(paths: Iterable[Path], root: Path = REPO) -> list[str]:
    """`file:line: phrase | text` for every development-diary phrase in `paths`, also one that a line break
    splits (reported at the line it starts on)."""
    hits = []
    for path in paths:
        name = path.relative_to(root) if path.is_relative_to(root) else path
        text = path.read_text(encoding="utf-8")
        lines = text.splitlines()
        for phrase in DIARY_PHRASES:
            for match in phrase.finditer(text):
                number = text.count("\n", 0, match.start()) + 1
                hits.append(f"{name}:{number}: {match.group(0)!r} | {lines[number - 1].strip()}")
    return sorted(hits)


def test_the_docs_hold_no_development_diary_wording():
    files = documentation_files()
    assert any(f.name == "README.md" for f in files) and any(f.suffix == ".py" for f in files)
    hits = diary_hits(files)
    assert not hits, "development-diary wording (write what is, in the present tense):\n" + "\n".join(hits)


def test_the_diary_check_reports_each_hit_with_its_file_and_line(tmp_path):
    bad = tmp_path / "notes.md"
    bad.write_text(
        "# Notes\n\nMeasured at Stop 25 on the main job.\nfine line\nTried, not kept: a cache (issue 19).\n"
        "Numbers from this session.\n"
    )
    good = tmp_path / "good.md"
    good.write_text("The calculator example runs in under 10 minutes; `--main-job` is a flag name.\n")
    hits = diary_hits([bad, good], root=tmp_path)
    assert {h.split(": ", 1)[0] for h in hits} == {"notes.md:3", "notes.md:5", "notes.md:6"}
    assert any("'Stop 25'" in h for h in hits) and any("'main job'" in h for h in hits)
    assert any("'(issue 19)'" in h for h in hits) and any("'Tried, not kept'" in h for h in hits)
    assert any("'this session'" in h for h in hits)
    assert diary_hits([good], root=tmp_path) == []


FENCE = re.compile(r"^\s*(```|~~~)")
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.*?)\s*#*\s*$")


def _prose_lines(path: Path) -> list[tuple[int, str]]:
    """The lines of a markdown file outside fenced code blocks."""
    lines, fenced = [], False
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if FENCE.match(line):
            fenced = not fenced
            continue
        if not fenced:
            lines.append((number, line))
    return lines


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading).strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def _anchors(path: Path) -> set[str]:
    anchors, seen = set(), {}
    for _, line in _prose_lines(path):
        match = HEADING.match(line)
        if match:
            slug = _slug(match.group(1))
            count = seen.get(slug, 0)
            anchors.add(slug if count == 0 else f"{slug}-{count}")
            seen[slug] = count + 1
    return anchors


def broken_links(paths: Iterable[Path], root: Path = REPO) -> list[str]:
    """`file:line: target` for every relative link of the markdown `paths` whose file or heading is missing."""
    broken = []
    for path in paths:
        name = path.relative_to(root) if path.is_relative_to(root) else path
        for number, line in _prose_lines(path):
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.IGNORECASE):  # http:, https:, mailto:
                    continue
                file_part, _, anchor = target.partition("#")
                linked = (path.parent / file_part).resolve() if file_part else path
                if not linked.exists():
                    broken.append(f"{name}:{number}: {target} (no such file)")
                elif anchor and linked.suffix == ".md" and anchor not in _anchors(linked):
                    broken.append(f"{name}:{number}: {target} (no such heading)")
    return broken


def test_relative_links_in_the_docs_point_at_files_and_headings_that_exist():
    markdown = [f for f in documentation_files() if f.suffix == ".md"]
    assert (REPO / "docs" / "benchmarks" / "README.md") in markdown
    broken = broken_links(markdown)
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_the_link_check_reports_a_missing_file_and_a_missing_heading(tmp_path):
    (tmp_path / "other.md").write_text("# Other page\n\n## A section\n")
    page = tmp_path / "page.md"
    page.write_text(
        "[ok](other.md) [ok](other.md#a-section) [web](https://example.com/x.md)\n"
        "[gone](missing.md)\n```\n[in code](nowhere.md)\n```\n[bad anchor](other.md#no-section)\n"
    )
    assert broken_links([page], root=tmp_path) == [
        "page.md:2: missing.md (no such file)",
        "page.md:6: other.md#no-section (no such heading)",
    ]
