"""The docs site builds with `mkdocs build --strict`, README stays one screen deep and its links resolve,
and every committed load-test report is reachable from the docs."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCS = REPO / "docs"
README_MAX_BYTES = 12_288
# [text](target) and ![alt](target); the target ends at whitespace or ')'
LINK = re.compile(r"!?\[[^\]]*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")


def relative_links(markdown: str) -> list[str]:
    """Link targets that point into the repository (no scheme, no bare anchor), anchors stripped."""
    text = re.sub(r"```.*?```", "", markdown, flags=re.S)  # links inside code blocks are not links
    targets = []
    for target in LINK.findall(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I) or target.startswith("#"):
            continue
        targets.append(target.split("#", 1)[0])
    return targets


def test_mkdocs_build_strict(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(REPO / "mkdocs.yml"), "-d", str(site)],
        cwd=tmp_path, capture_output=True, text=True, timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert (site / "index.html").is_file()
    # the reports render as pages with their plots beside them
    for summary in sorted((REPO / "loadtest" / "results").glob("**/summary.md")):
        rel = summary.parent.relative_to(REPO / "loadtest" / "results")
        assert (site / "results" / rel / "summary" / "index.html").is_file(), rel
        for plot in summary.parent.glob("*.png"):
            assert (site / "results" / rel / plot.name).is_file(), plot


def test_readme_is_one_screen_deep() -> None:
    size = (REPO / "README.md").stat().st_size
    assert size <= README_MAX_BYTES, f"README.md is {size} bytes; move detail into docs/ (limit {README_MAX_BYTES})"


def test_readme_relative_links_resolve() -> None:
    targets = relative_links((REPO / "README.md").read_text(encoding="utf-8"))
    assert targets, "README.md links to no file: the docs should be linked from it"
    missing = [t for t in targets if not (REPO / t).exists()]
    assert not missing, f"README.md links to files that do not exist: {missing}"


def test_every_load_test_report_is_linked_from_the_docs() -> None:
    linked: set[Path] = set()
    for page in DOCS.glob("*.md"):
        for target in relative_links(page.read_text(encoding="utf-8")):
            if target:
                linked.add(Path(os.path.realpath(page.parent / target)))
    reports = sorted((REPO / "loadtest" / "results").glob("**/summary.md"))
    assert reports, "no load-test reports found"
    unlinked = [str(r.relative_to(REPO)) for r in reports if Path(os.path.realpath(r)) not in linked]
    assert not unlinked, f"reports no docs page links to (e.g. as results/<scenario>/summary.md): {unlinked}"


def test_relative_links_parses_what_it_must() -> None:
    text = ("[a](docs/x.md#sec) ![p](plot.png) [web](https://example.com) [anchor](#here)\n"
            "```\n[not](a-link.md)\n```\n")
    assert relative_links(text) == ["docs/x.md", "plot.png"]
