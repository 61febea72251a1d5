"""The documentation site builds with `mkdocs build --strict` (MkDocs + Material, pinned in
requirements.txt): a broken link or anchor, a page missing from the nav, or a nav entry with no
page fails the suite; the README stays short and links into the site."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MKDOCS = Path(sys.executable).parent / "mkdocs"


def build(config: Path, site: Path) -> subprocess.CompletedProcess:
    if not MKDOCS.exists():
        pytest.fail(f"{MKDOCS} missing; run scripts/setup.sh (mkdocs-material in requirements.txt)")
    return subprocess.run([str(MKDOCS), "build", "--strict", "-f", str(config), "-d", str(site)],
                          capture_output=True, text=True, timeout=300, cwd=ROOT)


def test_site_builds_strict(tmp_path):
    r = build(ROOT / "mkdocs.yml", tmp_path / "site")
    assert r.returncode == 0, r.stdout + r.stderr
    nav_pages = re.findall(r"([\w/-]+\.md)", (ROOT / "mkdocs.yml").read_text())
    for page in nav_pages:
        html = tmp_path / "site" / page.removesuffix(".md").removesuffix("index") / "index.html"
        assert html.exists(), f"{page}: not built"
    obs = (tmp_path / "site" / "observability" / "index.html").read_text()
    for png in ("load-pipeline.png", "errors-and-store.png"):
        assert f"img/{png}" in obs and (tmp_path / "site" / "img" / png).stat().st_size > 10_000


def test_strict_build_catches_a_broken_link(tmp_path):
    """The check has teeth: the same site with one link pointing nowhere fails to build."""
    docs = tmp_path / "docs"
    subprocess.run(["cp", "-r", str(ROOT / "docs"), str(docs)], check=True)
    page = docs / "quickstart.md"
    page.write_text(page.read_text() + "\nSee [nowhere](no-such-page.md).\n")
    config = tmp_path / "mkdocs.yml"
    config.write_text((ROOT / "mkdocs.yml").read_text().replace("docs_dir: docs",
                                                                f"docs_dir: {docs}"))
    r = build(config, tmp_path / "site")
    assert r.returncode != 0 and "no-such-page.md" in r.stdout + r.stderr


def test_readme_is_short_and_links_into_the_site():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 150
    links = set(re.findall(r"\]\((docs/[\w/-]+\.md)\)", readme))
    nav = set(re.findall(r"([\w/-]+\.md)", (ROOT / "mkdocs.yml").read_text()))
    top = {p for p in nav if "/" not in p and p != "index.md"}
    assert {f"docs/{p}" for p in top} <= links, f"README: link every page: {sorted(top)}"
    for link in links:
        assert (ROOT / link).exists(), link
