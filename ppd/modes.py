"""Routing modes: the one grammar and the one `fraction:<x>` split, shared by the gateway, the
simulator and the benchmark records.

Rule 1 (grammar): a mode is `pd`, `local`, `ppd`, `replica`, `bidir` or `fraction:<x>` with
0 <= x <= 1. `bidir` sends every turn 2+ down vLLM's bidirectional path (docs/vllm-protocol.md 3.4: P
pulls the history's KV from D, appends, and D pulls the result back).
`parse_mode` reads exactly that text; `loose=True` also ignores case and surrounding spaces (what a
config file, a command line or an HTTP header may carry). Anything else is a `ModeError`.
Rule 2 (the split): `fraction:<x>` sends a conversation local on turns 2+ when the BLAKE2b-64 hash
of its id, read as a number in [0, 1), is below x. One conversation never flips between turns, and
the gateway and the simulator put the same conversations local for the same x.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Final, Literal, get_args

__all__ = [
    "NAMED_MODES",
    "Mode",
    "ModeError",
    "ModeKind",
    "fraction_goes_local",
    "parse_mode",
    "unit_interval",
]

ModeKind = Literal["pd", "local", "fraction", "ppd", "replica", "bidir"]
#: The modes without a parameter; `fraction:<x>` is the one parametrised mode.
NAMED_MODES: Final = frozenset(k for k in get_args(ModeKind) if k != "fraction")


class ModeError(ValueError):
    """Text that is not a routing mode; the message says why."""


@dataclass(frozen=True, slots=True)
class Mode:
    kind: ModeKind
    fraction: float = 0.0

    def __str__(self) -> str:
        return f"fraction:{self.fraction:g}" if self.kind == "fraction" else self.kind

    @property
    def local_share(self) -> float | None:
        """The share of turns 2+ sent local: 0 for `pd` and `bidir`, 1 for `local`, x for
        `fraction:x`; None for the modes without a fixed share (`ppd`, `replica`)."""
        if self.kind in ("pd", "bidir"):
            return 0.0
        if self.kind == "local":
            return 1.0
        if self.kind == "fraction":
            return self.fraction
        return None


def parse_mode(text: str, *, loose: bool = False) -> Mode:
    """Rule 1; raises ModeError."""
    mode = text.strip().lower() if loose else text
    if mode in NAMED_MODES:
        return Mode(mode)  # type: ignore[arg-type]
    if mode.startswith("fraction:"):
        try:
            x = float(mode.removeprefix("fraction:"))
        except ValueError:
            raise ModeError(f"routing mode {text!r}: fraction is not a number") from None
        if not 0.0 <= x <= 1.0:
            raise ModeError(f"routing mode {text!r}: fraction must lie in [0, 1]")
        return Mode("fraction", x)
    raise ModeError(f"routing mode {text!r} is not one of pd, local, ppd, replica, bidir, fraction:<x>")


def unit_interval(conversation_id: str) -> float:
    """The conversation's place in [0, 1): BLAKE2b-64 of its UTF-8 id over 2**64."""
    digest = hashlib.blake2b(conversation_id.encode("utf-8"), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2.0**64


def fraction_goes_local(conversation_id: str, fraction: float) -> bool:
    """Rule 2: whether `fraction:<fraction>` sends this conversation local (turns 2+)."""
    return unit_interval(conversation_id) < fraction
