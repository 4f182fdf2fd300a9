"""The paper's synthetic two-turn workloads (``docs/architecture.md``, "Reference facts").

A workload is named ``<turn1>_<class>``: Turn 1 is ``small`` (128 in / 128 out) or ``large``
(1024 / 1024), Turn 2 is one of nine classes with a fixed (n_in, n_out). So the context a Turn-2 request
sees is n_ctx = Turn-1 input + Turn-1 output (256 or 2048 tokens), and the cell a workload measures is
fixed by its name. Nothing here is a routing threshold: those live in the table header.

Our extension: Turn 1 ``huge`` (4096 / 1024, so Turn 2 sees 5120 tokens of context) measures the
context class above 4096 tokens, where the paper's prototype has no data. ``WORKLOADS`` stays the
paper's 18; ``HUGE_WORKLOADS`` are the nine ``huge_*`` ones.

One definition for the whole tree: the table builder (sweeps, artifact pairing), the load generator,
the simulator's synthetic conversations and the decision service's default axes (``paper_axes``) all
read the Turn-1 settings and the nine classes from here. Like all of ``ppd``, it imports none of our
packages.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final

__all__ = [
    "HUGE_WORKLOADS",
    "TURN1_SETTINGS",
    "TURN2_CLASSES",
    "WORKLOADS",
    "TokenShape",
    "Workload",
    "parse_workload",
    "select_workloads",
]


@dataclass(frozen=True, slots=True)
class TokenShape:
    """New input tokens and output tokens of one turn."""

    n_in: int
    n_out: int


TURN1_SETTINGS: Final[dict[str, TokenShape]] = {
    "small": TokenShape(128, 128),
    "large": TokenShape(1024, 1024),
    "huge": TokenShape(4096, 1024),
}
_PAPER_TURN1: Final = ("small", "large")

# The nine Turn-2 classes of the paper's artifact, in the order of its grid (the default axes the
# tables are built on, ``decision_service.axes.paper_axes``, take them from here).
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


#: The paper's 18 workloads in a fixed order (Turn-1 setting, then class as listed above).
WORKLOADS: Final[tuple[Workload, ...]] = tuple(
    Workload(turn1, turn2) for turn1 in _PAPER_TURN1 for turn2 in TURN2_CLASSES
)
#: The nine workloads with a ``huge`` Turn 1 (context above 4096 tokens at Turn 2).
HUGE_WORKLOADS: Final[tuple[Workload, ...]] = tuple(Workload("huge", turn2) for turn2 in TURN2_CLASSES)


def parse_workload(name: str) -> Workload:
    """``"large_mid_paste"`` -> ``Workload("large", "mid_paste")``; ``ValueError`` for anything else."""
    turn1, sep, turn2 = name.partition("_")
    if not sep or turn1 not in TURN1_SETTINGS or turn2 not in TURN2_CLASSES:
        raise ValueError(
            f"unknown synthetic workload {name!r}: expected <turn1>_<class> with turn1 in "
            f"{'|'.join(TURN1_SETTINGS)} and class in {'|'.join(TURN2_CLASSES)}"
        )
    return Workload(turn1, turn2)


def select_workloads(text: str) -> tuple[Workload, ...]:
    """A comma list of names and groups (``all``: the paper's 18, ``huge``: the nine huge-context
    ones) -> workloads in the order given, without repeats; ``ValueError`` for an unknown name."""
    chosen: dict[Workload, None] = {}
    for item in (x.strip() for x in text.split(",")):
        if not item:
            continue
        group = {"all": WORKLOADS, "huge": HUGE_WORKLOADS}.get(item)
        for w in group if group is not None else (parse_workload(item),):
            chosen[w] = None
    return tuple(chosen)
