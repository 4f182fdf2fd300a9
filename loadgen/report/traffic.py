"""Seeded conversations for the simulated experiments (``drift``, ``slo``): a mix of the paper's
synthetic two-turn workloads as one Poisson process, and a load ramp made of such segments.

Conversation i of a segment is of ``workloads[i % len]`` and carries that workload's name, so its
records file under the workload's class as a sweep's do. Ids name the seed, the segment's offset and
i, so segments concatenate without clashes (a shifting mix is two segments).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ppd import catalog

__all__ = ["mix_conversations", "ramp_conversations"]


def mix_conversations(
    workloads: Sequence[str], qps: float, duration_s: float, seed: int, *, offset_s: float = 0.0
) -> list[Any]:
    """Poisson conversations at ``qps`` for ``duration_s`` s from ``offset_s``; conversation i is of
    ``workloads[i % len]`` and carries its name (so its records file under that workload's class).
    A mix that shifts is two calls with offsets, concatenated."""
    from simulator.core.workload import Conversation, Turn, poisson_starts

    if not workloads:
        raise ValueError("the mix needs at least one workload")
    shapes = [catalog.parse_workload(name) for name in workloads]
    out = []
    for i, t in enumerate(poisson_starts(qps, duration_s, seed)):
        wl = shapes[i % len(shapes)]
        turns = (Turn(wl.first.n_in, wl.first.n_out), Turn(wl.second.n_in, wl.second.n_out))
        out.append(Conversation(f"{wl.name}-{seed}-{offset_s:g}-{i}", wl.name, offset_s + t, turns))
    return out


def ramp_conversations(
    workloads: Sequence[str], levels: Sequence[float], step_s: float, seed: int
) -> list[Any]:
    """A load ramp: ``step_s`` seconds at each QPS of ``levels`` in turn (segment k seeded ``seed + k``)."""
    out: list[Any] = []
    for k, qps in enumerate(levels):
        out += mix_conversations(workloads, qps, step_s, seed + k, offset_s=k * step_s)
    return out
