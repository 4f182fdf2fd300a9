"""Routing modes and the decisions they make without asking anyone.

Rule 1: turn 1 always takes P then D (no KV exists anywhere yet); in `replica` mode every turn goes to
the session's replica.
Rule 2: `fraction:<x>` sends a fixed share x of conversations local, chosen by a hash of the session
id, so one conversation never flips between turns.
Rule 3: only `ppd` mode on turn 2+ needs the DecisionService; `static_decision` returns None then.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Literal

from gateway.types import Path

__all__ = ["Decision", "Mode", "ModeKind", "parse_mode", "static_decision"]

ModeKind = Literal["pd", "local", "fraction", "ppd", "replica"]


@dataclass(frozen=True, slots=True)
class Mode:
    kind: ModeKind
    fraction: float = 0.0

    def __str__(self) -> str:
        return f"fraction:{self.fraction:g}" if self.kind == "fraction" else self.kind


@dataclass(frozen=True, slots=True)
class Decision:
    """Where a request's prefill should run and why (the reason goes into headers and metrics)."""

    path: Path
    reason: str
    table_version: str = ""
    score: float = 0.0
    detail: str = ""
    fallback: bool = False


def parse_mode(text: str) -> Mode:
    """`pd`, `local`, `ppd`, `replica` or `fraction:<x>` with 0 <= x <= 1; ValueError otherwise."""
    text = text.strip().lower()
    if text in ("pd", "local", "ppd", "replica"):
        return Mode(text)  # type: ignore[arg-type]
    if text.startswith("fraction:"):
        try:
            x = float(text.removeprefix("fraction:"))
        except ValueError:
            raise ValueError(f"bad fraction in routing mode {text!r}") from None
        if not 0.0 <= x <= 1.0:
            raise ValueError(f"fraction must be within [0, 1], got {x}")
        return Mode("fraction", x)
    raise ValueError(f"unknown routing mode {text!r} (pd, local, ppd, replica, fraction:<x>)")


def _unit_interval(session_id: str) -> float:
    digest = hashlib.blake2b(session_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def static_decision(mode: Mode, *, turn: int, session_id: str) -> Decision | None:
    if mode.kind == "replica":
        return Decision("replica", "mode_replica")
    if turn <= 1:
        return Decision("pd", "turn_one")
    if mode.kind == "pd":
        return Decision("pd", "mode_pd")
    if mode.kind == "local":
        return Decision("local", "mode_local")
    if mode.kind == "fraction":
        local = _unit_interval(session_id) < mode.fraction
        return Decision("local" if local else "pd", "mode_fraction")
    return None
