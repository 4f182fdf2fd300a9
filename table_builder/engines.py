"""The engines a sweep can run points on, by name (no import-time side effects).

``analytic`` (the closed-form model in ``analytic.py``: fast, for pipelines and examples) is built in.
Every other engine is a plug-in found in the entry-point group ``ppd_table.engines`` (pyproject.toml):
an entry point names a ``make(options) -> Engine`` function. That is how ``sim`` (the simulator's
virtual-time P/D cluster, ``simulator/tools/sweep_engine.py``; the shipped tables; the default) reaches
``ppd-table sweep`` while this product package never imports the simulator; ``vllm-cpu`` and ``endpoints``
(a running deployment behind its front door, ``loadgen/sweep_engine.py``) the same way.
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Final, cast

from table_builder.sweep import Engine

__all__ = ["DEFAULT_ENGINE", "PLUGIN_GROUP", "EngineError", "EngineOptions", "engine_names", "make_engine"]

#: The entry-point group of engine plug-ins.
PLUGIN_GROUP: Final = "ppd_table.engines"
#: What ``ppd-table sweep`` runs unless told otherwise.
DEFAULT_ENGINE: Final = "sim"
_BUILT_IN: Final = ("analytic",)


@dataclass(frozen=True, slots=True, kw_only=True)
class EngineOptions:
    """What ``ppd-table sweep`` hands an engine; each engine reads the fields it needs and ignores the
    rest (the ones below ``duration_s`` are for engines that drive a running deployment: ``endpoints``)."""

    seed: int = 0
    #: Seconds of Poisson arrivals per grid point (the paper uses 10 s).
    duration_s: float = 10.0
    #: The front door of a running deployment (our gateway, or Envoy in front of the picker).
    url: str | None = None
    #: Workers to watch and reset between points, ``URL`` or ``ROLE=URL`` (when the front door does not
    #: list them).
    workers: tuple[str, ...] = ()
    #: The gateway's admin token (``admin_token``), to list its workers at ``GET /admin/workers``.
    admin_token: str | None = field(default=None, repr=False)
    #: The model id to ask for (default: the first one the front door's ``/v1/models`` lists).
    served_model: str | None = None
    #: Seconds a request may take before it is a failed record.
    timeout_s: float = 30.0
    #: Seconds to wait before a point for the workers' queues to drain.
    settle_timeout_s: float = 120.0
    #: How the runs place P and the Turn-1 D (ppd/placement.py), None when ``--placement`` was not
    #: given. An engine has a ``placement`` attribute when it models placement (sim) or reads it from
    #: the deployment (endpoints); a sweep asking another placement of an engine is refused.
    placement: str | None = None


class EngineError(RuntimeError):
    """An engine cannot start with these options (a deployment unreachable, a grid it cannot run);
    the message says what and what to do."""


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
