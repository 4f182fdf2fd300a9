"""Every gateway module declares its public names in __all__, and exactly those (httpx's check)."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import pytest

import gateway

MODULES = sorted(m.name for m in pkgutil.iter_modules(gateway.__path__) if not m.name.startswith("_"))


@pytest.mark.parametrize("name", MODULES)
def test_all_matches_the_public_names(name: str) -> None:
    module = importlib.import_module(f"gateway.{name}")
    declared = set(getattr(module, "__all__", ()))
    defined = {
        n
        for n, obj in vars(module).items()
        if not n.startswith("_")
        and (inspect.isclass(obj) or inspect.isfunction(obj))
        and getattr(obj, "__module__", None) == module.__name__
    }
    assert declared >= defined, f"gateway.{name} does not export {sorted(defined - declared)}"
    assert all(hasattr(module, n) for n in declared)
