"""Every public name of the devstack modules is in their ``__all__``."""

from __future__ import annotations

import importlib

import pytest

MODULES = ["devstack.supervisor", "devstack.stack"]


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
