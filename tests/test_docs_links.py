"""Every relative link in README.md and docs/**/*.md resolves to a tracked file (or a folder holding one),
and every ``#anchor`` into a markdown page names one of its headings (GitHub's heading ids)."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
LINK = re.compile(r"!?\[(?:[^\]\[]|\[[^\]]*\])*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")  # [text](target "title")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
CODE = re.compile(r"`[^`\n]*`")


def tracked() -> set[str] | None:
    """The repository's tracked files (None outside a git checkout: then existing files count)."""
    try:
        out = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    return {p for p in out.decode().split("\0") if p}


def pages() -> list[Path]:
    return [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def links(text: str) -> list[str]:
    """Link targets outside code blocks and inline code."""
    return LINK.findall(CODE.sub("", FENCE.sub("", text)))


def slug(heading: str) -> str:
    """GitHub's id of a heading: markdown marks dropped, lower case, punctuation dropped, spaces to dashes."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link keeps its text
    text = text.replace("`", "").replace("*", "").strip().lower()
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    out: set[str] = set()
    for line in FENCE.sub("", page.read_text()).splitlines():
        if m := re.match(r"#{1,6}\s+(.*?)\s*#*\s*$", line):
            base, n = slug(m.group(1)), 1
            name = base
            while name in out:  # GitHub numbers repeated headings: name, name-1, name-2
                name, n = f"{base}-{n}", n + 1
            out.add(name)
    return out


def broken(page: Path, files: set[str] | None, root: Path = ROOT) -> list[str]:
    out = []
    for target in links(page.read_text()):
        if re.match(r"[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        rel = dest.relative_to(root).as_posix() if dest.is_relative_to(root) else None
        if rel is None:
            out.append(f"{target} (outside the repository)")
        elif files is not None and rel not in files and not any(f.startswith(rel + "/") for f in files):
            out.append(f"{target} (not a tracked file)")
        elif files is None and not dest.exists():
            out.append(f"{target} (no such file)")
        elif anchor and dest.suffix == ".md" and dest.is_file() and anchor not in anchors(dest):
            out.append(f"{target} (no heading with id {anchor!r} in {rel})")
    return [f"{page.relative_to(root)}: {b}" for b in out]


def test_every_relative_link_resolves():
    files = tracked()
    found = [b for page in pages() for b in broken(page, files)]
    assert not found, "broken links:\n" + "\n".join(found)


def test_the_checker_sees_broken_links(tmp_path):
    """The checker itself, on a small tree: a missing file, an untracked file, a missing heading."""
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "a.md").write_text("# Top\n\n## Two words `code`\n\n```\n[x](nowhere.md)\n```\n")
    page = tmp_path / "docs" / "b.md"
    page.write_text("[ok](a.md#two-words-code) [gone](c.md) [untracked](a.md) [bad](a.md#three) "
                    "[web](https://example.com) `[code](nope.md)`\n")
    assert broken(page, {"docs/b.md"}, tmp_path) == ["docs/b.md: a.md#two-words-code (not a tracked file)",
                                                      "docs/b.md: c.md (not a tracked file)",
                                                      "docs/b.md: a.md (not a tracked file)",
                                                      "docs/b.md: a.md#three (not a tracked file)"]
    assert broken(page, {"docs/a.md", "docs/b.md"}, tmp_path) == [
        "docs/b.md: c.md (not a tracked file)", "docs/b.md: a.md#three (no heading with id 'three' in docs/a.md)"]
    assert broken(page, None, tmp_path) == ["docs/b.md: c.md (no such file)",
                                            "docs/b.md: a.md#three (no heading with id 'three' in docs/a.md)"]


@pytest.mark.parametrize("heading, want", [("5b. A stored verdict (item 9)", "5b-a-stored-verdict-item-9"),
                                           ("`ortevals profile` beside og", "ortevals-profile-beside-og"),
                                           ("K × samples: 2.06×", "k--samples-206"),
                                           ("[Link](x.md) and *more*", "link-and-more")])
def test_heading_ids_as_github_makes_them(heading, want):
    assert slug(heading) == want


DOCS_LIMIT = 2 * 1024 * 1024  # user pages, their plots and tables; raw bench data belongs elsewhere


def test_docs_stay_within_two_mib():
    files = tracked()
    if files is None:
        pytest.skip("not a git checkout")
    docs = [ROOT / p for p in files if p.startswith("docs/")]
    size = sum(p.stat().st_size for p in docs if p.is_file())
    largest = sorted(docs, key=lambda p: p.stat().st_size if p.is_file() else 0)[-3:]
    assert size <= DOCS_LIMIT, (f"docs/ is {size / 2**20:.2f} MiB tracked (limit 2 MiB); largest: "
                                + ", ".join(f"{p.relative_to(ROOT)} {p.stat().st_size // 1024} KiB" for p in largest))
