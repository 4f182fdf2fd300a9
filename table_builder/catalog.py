"""The paper's synthetic two-turn workloads (``docs/architecture.md``, "Reference facts").

A workload is named ``<turn1>_<class>``: Turn 1 is ``small`` (128 in / 128 out) or ``large``
(1024 / 1024), Turn 2 is one of nine classes with a fixed (n_in, n_out). So the context a Turn-2 request
sees is n_ctx = Turn-1 input + Turn-1 output (256 or 2048 tokens), and the cell a workload measures is
fixed by its name. Nothing here is a routing threshold: those live in the table header.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = [
    "TURN1_SETTINGS",
    "TURN2_CLASSES",
    "WORKLOADS",
    "TokenShape",
    "Workload",
    "parse_workload",
]


@dataclass(frozen=True, slots=True)
class TokenShape:
    """New input tokens and output tokens of one turn."""

    n_in: int
    n_out: int


TURN1_SETTINGS: Final[dict[str, TokenShape]] = {
    "small": TokenShape(128, 128),
    "large": TokenShape(1024, 1024),
}

TURN2_CLASSES: Final[dict[str, TokenShape]] = {
    "tiny": TokenShape(16, 32),
    "short_gen": TokenShape(32, 256),
    "long_gen": TokenShape(32, 512),
    "very_long_gen": TokenShape(64, 1024),
    "small_bal": TokenShape(64, 64),
    "mid_bal": TokenShape(128, 128),
    "mid_paste": TokenShape(256, 64),
    "big_paste": TokenShape(512, 64),
    "huge_paste": TokenShape(1024, 32),
}


@dataclass(frozen=True, slots=True)
class Workload:
    """One synthetic two-turn workload."""

    turn1: str
    turn2: str

    @property
    def name(self) -> str:
        return f"{self.turn1}_{self.turn2}"

    @property
    def first(self) -> TokenShape:
        return TURN1_SETTINGS[self.turn1]

    @property
    def second(self) -> TokenShape:
        return TURN2_CLASSES[self.turn2]

    @property
    def turn2_context(self) -> int:
        """Tokens in the conversation before Turn 2 (the Turn-1 prompt and answer)."""
        return self.first.n_in + self.first.n_out


#: The 18 workloads in a fixed order (Turn-1 setting, then class as listed above).
WORKLOADS: Final[tuple[Workload, ...]] = tuple(
    Workload(turn1, turn2) for turn1 in TURN1_SETTINGS for turn2 in TURN2_CLASSES
)


def parse_workload(name: str) -> Workload:
    """``"large_mid_paste"`` -> ``Workload("large", "mid_paste")``; ``ValueError`` for anything else."""
    turn1, sep, turn2 = name.partition("_")
    if not sep or turn1 not in TURN1_SETTINGS or turn2 not in TURN2_CLASSES:
        raise ValueError(
            f"unknown synthetic workload {name!r}: expected <turn1>_<class> with turn1 in "
            f"{'|'.join(TURN1_SETTINGS)} and class in {'|'.join(TURN2_CLASSES)}"
        )
    return Workload(turn1, turn2)
