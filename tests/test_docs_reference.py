"""The reference pages in docs/reference/ are what tools/docs/gen_reference.py writes from the code now.

Rule 1: each page regenerated equals the file, so a command, flag, setting, metric, header or RPC
added (or changed) without regenerating fails here, naming the page and the command that fixes it.
Rule 2: what only the generator's tables describe (headers, environment variables, the classes that
own a metrics registry) is checked against the code both ways, and each check is provoked here.
"""

from __future__ import annotations

import ast
import difflib
from pathlib import Path

import pytest

from tests.support.packages import PACKAGES
from tools.docs import gen_reference
from tools.docs.refgen.commands import scripts
from tools.docs.refgen.common import OUT, ReferenceError, cell, check_described
from tools.docs.refgen.headers import HEADERS, headers_in_code
from tools.docs.refgen.metrics import REGISTRY_CLASSES
from tools.docs.refgen.settings import ENVIRONMENT, annotated_config, env_variables_in_code

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(gen_reference.pages()))
def test_the_reference_page_is_current(name: str) -> None:
    wanted = gen_reference.pages()[name]()
    path = OUT / name
    have = path.read_text(encoding="utf-8") if path.is_file() else ""
    diff = "".join(
        difflib.unified_diff(
            have.splitlines(True), wanted.splitlines(True), f"{name} (file)", "generated", n=1
        )
    )
    assert have == wanted, (
        f"docs/reference/{name} is stale: run python -m tools.docs.gen_reference\n{diff[:4000]}"
    )


def test_every_script_has_its_section_on_the_commands_page() -> None:
    page = (ROOT / "docs/reference/commands.md").read_text(encoding="utf-8")
    for name in scripts():
        assert f"## `{name}`" in page


def test_the_descriptions_name_exactly_what_the_code_names() -> None:
    assert headers_in_code() == set(HEADERS)
    assert env_variables_in_code() >= set(ENVIRONMENT)


def test_the_described_check_refuses_an_undescribed_or_a_stale_name() -> None:
    check_described("header", {"X-A"}, {"X-A"})
    with pytest.raises(ReferenceError, match=r"not described .*\['X-New'\]"):
        check_described("header", {"X-A", "X-New"}, {"X-A"})
    with pytest.raises(ReferenceError, match=r"gone from the code: \['X-Old'\]"):
        check_described("header", {"X-A"}, {"X-A", "X-Old"})


def _registry_owners() -> set[str]:
    """module.Class of every class in our packages whose code builds a prometheus CollectorRegistry."""
    owners = set()
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            if "_pb2" in path.name:
                continue
            tree = ast.parse(path.read_text(encoding="utf-8"))
            module = ".".join(path.relative_to(ROOT).with_suffix("").parts)
            for node in ast.walk(tree):
                if isinstance(node, ast.ClassDef) and any(
                    isinstance(call, ast.Call)
                    and isinstance(call.func, ast.Name)
                    and call.func.id == "CollectorRegistry"
                    for call in ast.walk(node)
                ):
                    owners.add(f"{module}.{node.name}")
    return owners


def test_every_metrics_registry_is_on_the_metrics_page() -> None:
    assert _registry_owners() == set(REGISTRY_CLASSES), "add the new registry to tools/docs/refgen/metrics.py"


def test_the_annotated_gateway_config_is_read() -> None:
    readme = annotated_config()
    assert readme[("decision", "fallback")] == "pd | local"
    assert readme[("", "host")]
    assert ("sessions", "redis_url") in readme


def test_a_table_cell_escapes_markup_outside_code_spans() -> None:
    assert cell("a <b> *c* `<d> *e*` | f\nnext") == "a &lt;b&gt; \\*c\\* `<d> *e*` \\| f next"
