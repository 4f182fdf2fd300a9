"""Every simulator module's __all__ lists exactly its public names."""

from __future__ import annotations

import pytest


@pytest.mark.parametrize(
    "module_name",
    [
        "simulator.core.api_error",
        "simulator.server.fabric",
        "simulator.core.faults",
        "simulator.server.jobs",
        "simulator.server.metrics",
        "simulator.core.protocol",
        "simulator.server.realtime",
        "simulator.core.responses",
        "simulator.core.sampler",
        "simulator.server.serve_cli",
        "simulator.server.side_channel",
        "simulator.server.stream",
        "simulator.core.tokenizer",
        "simulator.core.topology",
        "simulator.server.worker",
        "simulator.server.worker_group",
        "simulator.core.worker_settings",
    ],
)
def test_all_lists_exactly_the_public_names(module_name: str) -> None:
    import importlib
    import inspect

    module = importlib.import_module(module_name)
    exported = set(module.__all__)
    defined = {
        name
        for name, value in vars(module).items()
        if not name.startswith("_")
        and (inspect.isclass(value) or inspect.isfunction(value))
        and getattr(value, "__module__", None) == module_name
    }
    assert defined <= exported, f"public but not in __all__: {defined - exported}"
    assert all(hasattr(module, name) for name in exported)
