"""The engines a sweep can run points on, by name (explicit registry, no import-time side effects)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

from table_builder.sweep import Engine

__all__ = ["ENGINES", "EngineOptions", "make_engine"]

#: ``analytic``: the closed-form model in ``analytic.py`` (fast, for pipelines and examples);
#: ``sim``: the simulator's virtual-time P/D cluster (calibrated; the shipped tables; the default).
ENGINES: Final = ("analytic", "sim")


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineOptions:
    seed: int = 0
    #: Seconds of Poisson arrivals per grid point (the paper uses 10 s).
    duration_s: float = 10.0


def make_engine(name: str, options: EngineOptions) -> Engine:
    if name == "analytic":
        from table_builder.analytic import AnalyticEngine

        return AnalyticEngine(duration_s=options.duration_s, seed=options.seed)
    if name == "sim":
        from table_builder.sim_engine import SimEngine

        return SimEngine(duration_s=options.duration_s, seed=options.seed)
    raise ValueError(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
