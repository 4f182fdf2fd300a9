"""The tree says what the code does: every package's README names each of its modules, and a module
over about 450 lines says in its docstring why it stays one module (issue 10's layout rules)."""

from __future__ import annotations

import ast
import re
import tomllib
from pathlib import Path

import pytest

from tests.support.packages import PACKAGES

REPO = Path(__file__).resolve().parent.parent
MAX_LINES = 450
WHY_WHOLE = re.compile(r"one module|stays whole|stay whole", re.IGNORECASE)


def _modules(package: str) -> list[Path]:
    return sorted(
        path
        for path in (REPO / package).rglob("*.py")
        if path.name not in ("__init__.py", "__main__.py") and "_pb2" not in path.name
    )


@pytest.mark.parametrize("package", PACKAGES)
def test_the_package_readme_names_each_module(package: str) -> None:
    readme = (REPO / package / "README.md").read_text(encoding="utf-8")
    missing = [str(p.relative_to(REPO)) for p in _modules(package) if p.name not in readme]
    assert not missing, f"{package}/README.md does not name: {', '.join(missing)}"


@pytest.mark.parametrize("package", PACKAGES)
def test_a_long_module_says_why_it_stays_whole(package: str) -> None:
    unexplained = []
    for path in _modules(package):
        source = path.read_text(encoding="utf-8")
        docstring = ast.get_docstring(ast.parse(source)) or ""
        if source.count("\n") > MAX_LINES and not WHY_WHOLE.search(docstring):
            unexplained.append(str(path.relative_to(REPO)))
    assert not unexplained, f"over {MAX_LINES} lines with no word on why they stay whole: {unexplained}"


def test_the_docs_layout_table_names_each_package() -> None:
    page = (REPO / "docs" / "development" / "index.md").read_text(encoding="utf-8")
    layout = page[page.index("## Layout") : page.index("\n## ", page.index("## Layout") + 1)]
    missing = [p for p in PACKAGES if f"`{p}/`" not in layout]
    assert not missing, f"docs/development/index.md's Layout table does not name: {missing}"


def test_the_checks_walk_every_package_the_import_contracts_know() -> None:
    config = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert set(config["tool"]["importlinter"]["root_packages"]) == set(PACKAGES)
