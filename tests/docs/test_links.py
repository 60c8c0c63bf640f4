"""README.md and docs/*.md link only to files that exist (relative links and backticked paths)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK_RE = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")  # [text](target) without a URL scheme
# `bench/x.py`, `docs/y.md`: paths of the repository's own folders named in backticks
PATH_RE = re.compile(
    r"`((?:bench|docs|engine|kernels|native|operator|manifests|charts|docker|scripts)/[\w./-]*\w)`"
)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_relative_links_resolve(page):
    for target in LINK_RE.findall(page.read_text()):
        if "://" in target:
            continue
        assert (page.parent / target).exists(), (
            f"{page.relative_to(ROOT)} links to {target}, which does not exist"
        )


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_named_paths_exist(page):
    for path in PATH_RE.findall(page.read_text()):
        if "*" in path or "{" in path:
            continue
        assert (ROOT / path).exists(), f"{page.relative_to(ROOT)} names {path}, which does not exist"
