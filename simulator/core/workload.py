"""Conversations to simulate: the paper's 18 synthetic two-turn workloads and generic multi-turn lists.

A :class:`Conversation` is a start time and a list of turns, each ``(n_in, n_out)``: the new input
tokens of the turn and the tokens of its answer. Turn *k* is sent when turn *k − 1* has finished (plus
the configured think time); its context ``n_ctx`` is the sum of all earlier inputs and outputs.

Synthetic names are ``<turn1>_<class>`` (docs/architecture.md "Reference facts"): turn 1 is small
(128 in / 128 out) or large (1,024 / 1,024); turn 2 is one of nine classes. Arrivals are Poisson at
``qps`` conversations per second for ``duration_s`` seconds, from a seeded generator. The workload
catalog (Turn-1 settings, the nine classes) and the arrival process have one definition each, in
``ppd/catalog.py`` and ``ppd/arrivals.py``.

Shared-prefix names ``shared<L>_<G>x<C>_<turn1>_<class>`` (``ppd.catalog.SharedPrefixSpec``): each
conversation opens with its group's system prompt of ``L`` tokens (``Conversation.prefix``), counted in
Turn 1's ``n_in``. The cluster gives every conversation of a group the same KV blocks for the prompt's
full blocks (``kv_cache.PrefixedBlocks`` over the group's stream), so its prefix cache hits them as
vLLM's hits a shared system prompt; groups, and separate calls, never share a block.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ppd.arrivals import poisson_arrivals
from ppd.catalog import WORKLOADS, parse_shared_prefix, parse_workload

__all__ = [
    "Conversation",
    "SharedPrefix",
    "Turn",
    "poisson_starts",
    "shared_prefix_conversations",
    "sharegpt_like",
    "synthetic_conversations",
    "synthetic_workloads",
    "turn_list_conversations",
]


@dataclass(frozen=True, slots=True)
class Turn:
    n_in: int
    n_out: int


@dataclass(frozen=True, slots=True)
class SharedPrefix:
    """The first ``n_tokens`` of Turn 1's input are group ``group``'s system prompt."""

    group: int
    n_tokens: int


@dataclass(frozen=True, slots=True)
class Conversation:
    conversation_id: str
    workload: str
    start: float
    turns: tuple[Turn, ...]
    prefix: SharedPrefix | None = None


def synthetic_workloads() -> list[str]:
    """The paper's 18 names, e.g. ``large_mid_paste`` (``ppd.catalog.WORKLOADS``, in its order)."""
    return [w.name for w in WORKLOADS]


def poisson_starts(qps: float, duration_s: float, seed: int) -> list[float]:
    """Poisson arrival times in [0, duration_s), from ``random.Random(seed)``."""
    rng = random.Random(seed)  # noqa: S311 -- reproducible simulation input, not security
    return poisson_arrivals(rng, qps, duration_s)


def synthetic_conversations(
    workload: str, qps: float, duration_s: float, seed: int = 0
) -> list[Conversation]:
    """Two-turn conversations of one of the paper's 18 synthetic workloads, Poisson at ``qps``."""
    names = synthetic_workloads()
    if workload not in names:
        raise ValueError(f"unknown synthetic workload {workload!r} (e.g. {names[0]})")
    shapes = parse_workload(workload)
    turns = (Turn(shapes.first.n_in, shapes.first.n_out), Turn(shapes.second.n_in, shapes.second.n_out))
    return [
        Conversation(f"{workload}-{seed}-{i}", workload, t, turns)
        for i, t in enumerate(poisson_starts(qps, duration_s, seed))
    ]


def shared_prefix_conversations(
    workload: str, qps: float, duration_s: float, seed: int = 0, *, turns: int = 2
) -> list[Conversation]:
    """Conversations of a shared-prefix workload (``shared2048_4x8_small_mid_bal``), Poisson at ``qps``.

    Turn 1 is the group's prompt plus the Turn-1 setting's input; turns 2.. are the class's. Raises
    ``ValueError`` for a malformed name or ``turns`` < 1.
    """
    spec = parse_shared_prefix(workload)
    if turns < 1:
        raise ValueError(f"turns must be at least 1, got {turns}")
    first, second = spec.workload.first, spec.workload.second
    shape = (Turn(spec.prefix_tokens + first.n_in, first.n_out),) + (Turn(second.n_in, second.n_out),) * (
        turns - 1
    )
    return [
        Conversation(
            f"{workload}-{seed}-{i}", workload, t, shape, SharedPrefix(spec.group_of(i), spec.prefix_tokens)
        )
        for i, t in enumerate(poisson_starts(qps, duration_s, seed))
    ]


def turn_list_conversations(
    turn_lists: Iterable[Sequence[tuple[int, int]]],
    qps: float,
    duration_s: float,
    *,
    workload: str = "sharegpt",
    seed: int = 0,
) -> list[Conversation]:
    """Conversations from lists of (n_in, n_out) per turn (e.g. ShareGPT), cycled over Poisson starts."""
    lists = [tuple(Turn(a, b) for a, b in turns) for turns in turn_lists]
    lists = [t for t in lists if t]
    if not lists:
        raise ValueError("no conversations given")
    starts = poisson_starts(qps, duration_s, seed)
    return [
        Conversation(f"{workload}-{seed}-{i}", workload, t, lists[i % len(lists)])
        for i, t in enumerate(starts)
    ]


def sharegpt_like(n: int, *, turns: int = 2, seed: int = 0) -> list[list[tuple[int, int]]]:
    """A seeded stand-in for ShareGPT turn lengths (log-normal; inputs ~ median 60, outputs ~ median 220).

    Only for tests and sanity runs on machines without the dataset; the bench feeds real ShareGPT.
    """
    rng = random.Random(seed)  # noqa: S311 -- reproducible simulation input, not security
    out = []
    for _ in range(n):
        conv = []
        for k in range(turns):
            n_in = int(min(2048, max(4, rng.lognormvariate(math.log(120 if k == 0 else 60), 1.0))))
            n_out = int(min(1024, max(4, rng.lognormvariate(math.log(220), 0.8))))
            conv.append((n_in, n_out))
        out.append(conv)
    return out
