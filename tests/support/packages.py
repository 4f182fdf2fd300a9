"""Our top-level packages, for the checks that walk the whole tree (tests/test_layout.py,
tests/test_exports.py). A new package is added here and in pyproject.toml."""

from __future__ import annotations

from typing import Final

PACKAGES: Final = (
    "ppd",
    "decision_service",
    "gateway",
    "table_builder",
    "loadgen",
    "devstack",
    "benchmarks",
    "simulator",
    "vllm_harness",
    "bench_routers",
)
