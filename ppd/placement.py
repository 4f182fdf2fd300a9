"""Placement: which worker of a role a leg goes to, by the prompt's resident prefix against load (pure).

Shared by the gateway (``gateway/plan.py``, fed by ``gateway/core.py`` from the workers' KV events)
and the virtual-time cluster (``simulator/core/cluster.py``, from its engines' prefix caches), so a
sweep measures the placement the gateway runs. It applies to the P of every leg through P, to the D
of Turn 1 and to the D of a rebind; a session's D binding and the local/PD decision are not its
business. No clock, no I/O, no state.

Rules:

1. The caller passes the candidates in today's least-loaded order (the gateway's ``WorkerView.rank``:
   busy, then KV usage, then the least recently picked; the simulator's outstanding requests, then
   the worker's index) with each one's load (requests: the gateway's ``max(running + waiting,
   in flight)``, the simulator's outstanding) and its *resident prefix*: how many of the prompt's
   leading KV blocks it holds, or None when that is unknown (its event stream is not synced, or it
   is not tracked). Unknown counts as nothing resident: residency is never guessed.
2. ``least_loaded`` placement takes the first candidate, always (the behaviour before placement).
3. ``prefix`` placement: among the candidates whose load is at most the least loaded's plus
   ``max_imbalance``, the one holding the longest resident prefix wins, when that prefix is at least
   ``min_blocks`` blocks; a tie goes to the earlier candidate (the less loaded). Otherwise, nothing
   resident anywhere, every stream unsynced, or only an overloaded worker holding it, the first
   candidate: today's least-loaded choice.
4. The answer keeps the other candidates in their order after the chosen one (the gateway's retries
   on another P follow the least-loaded order), and says whether the prefix moved the choice away
   from the least loaded (``by_prefix``, for metrics and headers) and how many blocks it reuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final, Literal, get_args

__all__ = [
    "LEAST_LOADED",
    "PLACEMENTS",
    "Candidate",
    "Placed",
    "Placement",
    "PlacementSettings",
    "place",
    "placement_order",
]

Placement = Literal["prefix", "least_loaded"]
PLACEMENTS: Final[tuple[str, ...]] = get_args(Placement)


@dataclass(frozen=True, slots=True)
class PlacementSettings:
    """How legs are placed (``[routing] placement`` in the gateway, ``ClusterConfig.placement``)."""

    policy: Placement = "prefix"
    # Rule 3: a worker holding the prefix is taken while its load is at most this many requests above
    # the least loaded's; past it the saved prefill no longer pays for the queue (measured: docs/concepts).
    max_imbalance: float = 4.0
    # Rule 3: fewer resident blocks than this is no reason to leave the least-loaded worker.
    min_blocks: int = 1

    def __post_init__(self) -> None:
        if self.policy not in PLACEMENTS:
            raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {self.policy!r}")
        if not self.max_imbalance >= 0:  # also refuses NaN
            raise ValueError(f"placement_max_imbalance must be >= 0, got {self.max_imbalance!r}")
        if self.min_blocks < 1:
            raise ValueError(f"placement_min_blocks must be >= 1, got {self.min_blocks!r}")


@dataclass(frozen=True, slots=True)
class Candidate:
    """One worker a leg may go to (rule 1)."""

    worker: str
    load: float
    resident_blocks: int | None = None  # None: unknown (unsynced or untracked)


@dataclass(frozen=True, slots=True)
class Placed:
    """Rule 4: the chosen candidate's index in the caller's list, and why."""

    index: int
    by_prefix: bool = False  # the prefix moved the choice away from the least loaded
    resident_blocks: int = 0  # blocks of the prompt the chosen worker holds (0 when unknown)


#: Rule 2's settings: the choice before placement existed.
LEAST_LOADED: Final = PlacementSettings("least_loaded")


def place(candidates: Sequence[Candidate], settings: PlacementSettings) -> Placed:
    """Rules 2 and 3 over ``candidates`` in least-loaded order; ValueError when there are none."""
    if not candidates:
        raise ValueError("placement needs at least one candidate")
    first_resident = candidates[0].resident_blocks or 0
    if settings.policy == "least_loaded" or len(candidates) == 1:
        return Placed(0, False, first_resident)
    limit = min(c.load for c in candidates) + settings.max_imbalance
    best, best_blocks = 0, -1
    for i, c in enumerate(candidates):
        blocks = c.resident_blocks or 0
        if c.load <= limit and blocks > best_blocks:
            best, best_blocks = i, blocks
    if best_blocks < settings.min_blocks:
        return Placed(0, False, first_resident)
    return Placed(best, best != 0, best_blocks)


def placement_order(count: int, placed: Placed) -> list[int]:
    """Rule 4: candidate indexes with the chosen one first, the others in their order."""
    return [placed.index, *(i for i in range(count) if i != placed.index)]
