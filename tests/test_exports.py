"""Every module of our packages declares its public names in ``__all__``, and those names exist.

One check for the whole tree (it replaced five per-package copies). A module's public names are the
classes and functions it defines without a leading underscore; the generated gRPC stubs and the
scripts that run inside the real-vLLM venv (``vllm_harness.remote``, which import vLLM) are left out.
"""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

from tests.support.packages import PACKAGES

SKIPPED = ("vllm_harness.remote",)


def _modules() -> list[str]:
    names = []
    for package in PACKAGES:
        root = importlib.import_module(package)
        for info in pkgutil.walk_packages(root.__path__, prefix=f"{package}."):
            last = info.name.rsplit(".", 1)[-1]
            if info.ispkg or last.startswith("_") or "_pb2" in last or info.name.startswith(SKIPPED):
                continue
            names.append(info.name)
    return sorted(names)


@pytest.mark.parametrize("name", _modules())
def test_all_names_the_public_api(name: str) -> None:
    module = importlib.import_module(name)
    declared = set(getattr(module, "__all__", ()))
    defined = {
        attr
        for attr, value in vars(module).items()
        if not attr.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", None) == name
    }
    assert declared >= defined, f"{name} does not export {sorted(defined - declared)}"
    assert all(hasattr(module, n) for n in declared), f"{name}.__all__ names what it lacks"
