from __future__ import annotations

import importlib

import pytest

MODULES = [
    "loadgen.tokens",
    "loadgen.workloads",
    "loadgen.sharegpt",
    "loadgen.load",
    "loadgen.summary",
    "loadgen.report.comparison",
    "loadgen.report.report",
    "loadgen.report.reproduce",
    "loadgen.cli",
]


@pytest.mark.parametrize("name", MODULES)
def test_all_names_the_public_api(name: str) -> None:
    module = importlib.import_module(name)
    exported = set(module.__all__)
    public = {
        attr
        for attr, value in vars(module).items()
        if not attr.startswith("_")
        and getattr(value, "__module__", None) == name
        and (isinstance(value, type) or callable(value))
    }
    assert exported >= public, f"public but not in __all__: {sorted(public - exported)}"
    assert all(hasattr(module, n) for n in exported)


def test_the_report_does_not_import_matplotlib_until_it_draws() -> None:
    import subprocess
    import sys

    code = "import sys, loadgen.cli, loadgen.report.report; print('matplotlib' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
