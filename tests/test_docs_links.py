"""The documentation holds together: every relative markdown link in README.md and docs/*.md names a file
that exists, an anchor it names is a heading of that file, no page under docs/ outgrows 50 KB (a page
that long is several pages), and the README stays a first screen."""

from __future__ import annotations

import glob
import os
import re

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PAGES = [
    "README.md",
    *sorted(os.path.relpath(p, ROOT) for p in glob.glob(os.path.join(ROOT, "docs", "**", "*.md"), recursive=True)),
]
LINK = re.compile(r"(?<!!)\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", flags=re.M | re.S)
# pages kept whole on purpose: the measured results, owned with their tables
SIZE_EXEMPT = ("docs/BENCHMARKS.md", "docs/benchmarks/")


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but hyphens and underscores dropped, spaces to hyphens."""
    text = re.sub(r"`|\*\*|\[([^\]]*)\]\([^)]*\)", r"\1", heading.strip().lower())
    return re.sub(r"[^\w\- ]", "", text).replace(" ", "-")


def anchors(path: str) -> set[str]:
    with open(path) as f:
        text = FENCE.sub("", f.read())
    seen: dict[str, int] = {}
    out = set()
    for heading in re.findall(r"^#{1,6}\s+(.+?)\s*#*\s*$", text, flags=re.M):
        base = slug(heading)
        n = seen.get(base, 0)
        seen[base] = n + 1
        out.add(base if n == 0 else f"{base}-{n}")
    return out


def test_every_relative_link_names_a_file_that_exists_and_a_heading_it_has():
    broken = []
    for page in PAGES:
        with open(os.path.join(ROOT, page)) as f:
            text = FENCE.sub("", f.read())
        for target in LINK.findall(text):
            if re.match(r"[a-z][a-z0-9+.-]*:", target) or target.startswith("<"):
                continue  # http(s), mailto: not this test's to check offline
            path, _, anchor = target.partition("#")
            resolved = (
                os.path.normpath(os.path.join(ROOT, os.path.dirname(page), path)) if path else os.path.join(ROOT, page)
            )
            if not os.path.exists(resolved):
                broken.append(f"{page}: {target} (no such file)")
            elif anchor and resolved.endswith(".md") and anchor not in anchors(resolved):
                broken.append(f"{page}: {target} (no heading with that anchor)")
    assert not broken, "broken links:\n" + "\n".join(broken)


def test_no_docs_page_is_over_50_kb():
    big = [
        f"{page}: {os.path.getsize(os.path.join(ROOT, page)) // 1000} KB"
        for page in PAGES
        if page.startswith("docs/")
        and not page.startswith(SIZE_EXEMPT)
        and os.path.getsize(os.path.join(ROOT, page)) > 50_000
    ]
    assert not big, f"pages to split by concern: {big}"


def test_the_readme_is_a_first_screen_that_links_every_docs_page():
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read()
    assert len(text.splitlines()) < 150, "README.md: keep it under 150 lines, move detail to docs/"
    first_screen = "\n".join(text.splitlines()[:40])
    assert "(docs/extending.md)" in first_screen
    unlinked = [p for p in PAGES if p.startswith("docs/") and p.count("/") == 1 and f"({p})" not in text]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"


def test_slug_follows_github():
    assert slug("Aspect-ratio buckets: models at any size") == "aspect-ratio-buckets-models-at-any-size"
    assert slug("`prunepipe compare`: the report") == "prunepipe-compare-the-report"
    assert slug("One pass, before a byte is read") == "one-pass-before-a-byte-is-read"
