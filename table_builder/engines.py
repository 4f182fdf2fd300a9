"""The engines a sweep can run points on, by name (no import-time side effects).

``analytic`` (the closed-form model in ``analytic.py``: fast, for pipelines and examples) is built in.
Every other engine is a plug-in found in the entry-point group ``ppd_table.engines`` (pyproject.toml):
an entry point names a ``make(options) -> Engine`` function. That is how ``sim`` (the simulator's
virtual-time P/D cluster, ``simulator/tools/sweep_engine.py``; the shipped tables; the default) reaches
``ppd-table sweep`` while this product package never imports the simulator.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, cast

from table_builder.sweep import Engine

__all__ = ["DEFAULT_ENGINE", "PLUGIN_GROUP", "EngineOptions", "engine_names", "make_engine"]

#: The entry-point group of engine plug-ins.
PLUGIN_GROUP: Final = "ppd_table.engines"
#: What ``ppd-table sweep`` runs unless told otherwise.
DEFAULT_ENGINE: Final = "sim"
_BUILT_IN: Final = ("analytic",)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineOptions:
    seed: int = 0
    #: Seconds of Poisson arrivals per grid point (the paper uses 10 s).
    duration_s: float = 10.0
    #: How the runs place P and the Turn-1 D (ppd/placement.py); an engine that models placement has a
    #: ``placement`` attribute, and a sweep asking another engine for "prefix" is refused.
    placement: str = "least_loaded"


def engine_names() -> tuple[str, ...]:
    """The built-in engines, then the installed plug-ins by name (read from metadata; nothing imported)."""
    plugins = sorted({ep.name for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)} - set(_BUILT_IN))
    return (*_BUILT_IN, *plugins)


def make_engine(name: str, options: EngineOptions) -> Engine:
    if name == "analytic":
        from table_builder.analytic import AnalyticEngine

        return AnalyticEngine(duration_s=options.duration_s, seed=options.seed)
    found = importlib.metadata.entry_points(group=PLUGIN_GROUP, name=name)
    if not found:
        raise ValueError(
            f"unknown engine {name!r}; known: {', '.join(engine_names())} "
            f"(plug-ins come from the entry-point group {PLUGIN_GROUP!r}: is the project installed?)"
        )
    make = cast(Callable[[EngineOptions], Engine], next(iter(found)).load())
    return make(options)
