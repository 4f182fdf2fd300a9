"""Routing modes and the decisions they make without asking anyone.

Rule 1: turn 1 always takes P then D (no KV exists anywhere yet); in `replica` mode every turn goes to
the session's replica.
Rule 2: `fraction:<x>` sends a fixed share x of conversations local, chosen by a hash of the session
id, so one conversation never flips between turns (the grammar and the hash: `ppd/modes.py`, shared
with the simulator).
Rule 2b: `bidir` sends every turn 2+ down vLLM's bidirectional path; plan.py falls back to PD when the
session holds no live params from its D.
Rule 3: only `ppd` mode on turn 2+ needs the DecisionService; `static_decision` returns None then.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Final

from gateway.types import Path
from ppd.modes import Mode, fraction_goes_local

__all__ = ["Decision", "static_decision"]


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request's prefill should run and why (the reason goes into headers and metrics)."""

    path: Path
    reason: str
    table_version: str = ""
    score: float = 0.0
    detail: str = ""
    fallback: bool = False
    # The DecisionService's word on exploring the other path (RouteResponse.alternative_allowed), and
    # what the exploration policy made of it (ppd/explore.py): taken the other path, with the
    # propensity of the path taken (1.0 when exploration is off or the request was not eligible).
    alternative_allowed: bool = False
    explored: bool = False
    propensity: float = 1.0


# The modes that send every turn 2+ down one path.
_FIXED: Final[Mapping[str, Decision]] = {
    "pd": Decision("pd", "mode_pd"),
    "local": Decision("local", "mode_local"),
    "bidir": Decision("bidir", "mode_bidir"),
}


def static_decision(mode: Mode, *, turn: int, session_id: str) -> Decision | None:
    if mode.kind == "replica":
        return Decision("replica", "mode_replica")
    if turn <= 1:
        return Decision("pd", "turn_one")
    fixed = _FIXED.get(mode.kind)
    if fixed is not None:
        return fixed
    if mode.kind == "fraction":
        local = fraction_goes_local(session_id, mode.fraction)
        return Decision("local" if local else "pd", "mode_fraction")
    return None
