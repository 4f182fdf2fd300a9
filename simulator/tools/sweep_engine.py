"""The ``sim`` sweep engine: one grid point = one run of the simulator's virtual-time P/D cluster.

``ppd-table sweep --engine sim`` finds it in the entry-point group ``ppd_table.engines``
(pyproject.toml): the table builder is a product package and never imports the simulator; the
simulator's tools implement the builder's ``Engine`` protocol instead.

``simulator.core.cluster.simulate`` runs Poisson two-turn conversations of one synthetic workload through a
simulated cluster of the point's shape, in the point's static mode, with the calibrated cost model of a
profile (default Llama-3.1-8B on H100), and returns one record per request sent. Records are checked
against the schema here (``Record.from_dict``), so a simulator bug cannot slip a bad record into a table.

Rule 1: the arrivals of a point depend on (seed, workload, QPS) only, not on the mode: pd and local runs
of a cell see the very same conversations (common random numbers), so their difference is the mode's,
not the draw's.
Rule 2: the settings carry a fingerprint of the simulator's code and profiles, so a sweep folder made
by another simulator is never resumed into the same table, and each table names the simulator it
came from.
Rule 3: ``drift`` (events in ``simulator.core.drift``'s text form, e.g. ``0:link=0.1``) runs every
point on a drifted cluster: events at 0 s measure the post-drift configuration (``ppd-bench drift``'s
oracle table). The settings name it only when set, so sweeps without drift keep their settings.
Rule 4: ``placement`` (``ppd-table sweep --placement``) places each P leg and Turn-1 D as the gateway's
``[routing] placement`` does (ppd/placement.py, from each engine's prefix cache); named in the
settings only when not ``least_loaded`` (the choice before placement existed), for the same reason.
"""

from __future__ import annotations

import zlib
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ppd.placement import PLACEMENTS, Placement, PlacementSettings
from simulator.core.cluster import ClusterConfig, simulate
from simulator.core.drift import parse_drift
from simulator.core.profile import load_profile
from simulator.core.topology import Topology
from simulator.core.workload import turn_list_conversations
from simulator.tools.fingerprint import source_fingerprint
from table_builder.engines import EngineOptions
from table_builder.records import Record
from table_builder.sweep import GridPoint

__all__ = ["SimEngine", "make", "simulator_fingerprint"]


def simulator_fingerprint() -> str:
    """The fingerprint of the simulator package in use (``simulator.tools.fingerprint``)."""
    return source_fingerprint()


@dataclass(frozen=True, slots=True)
class SimEngine:
    duration_s: float = 10.0
    seed: int = 0
    profile: str = "llama-3.1-8b-h100"
    link: str = "nvlink"
    timeout_s: float = 30.0
    simulator: str = field(default_factory=simulator_fingerprint)
    drift: tuple[str, ...] = ()
    placement: Placement = "least_loaded"  # rule 4

    @property
    def name(self) -> str:
        return "sim"

    @property
    def modes(self) -> tuple[str, ...]:
        """The static modes this engine runs (``ppd-table sweep`` runs them all by default)."""
        return ("pd", "local", "bidir")

    def settings(self) -> Mapping[str, Any]:
        out: dict[str, Any] = {
            "duration_s": self.duration_s,
            "link": self.link,
            "profile": self.profile,
            "seed": self.seed,
            "simulator": self.simulator,
            "timeout_s": self.timeout_s,
        }
        if self.drift:
            out["drift"] = list(self.drift)
        if self.placement != "least_loaded":
            out["placement"] = self.placement
        return out

    def arrivals_seed(self, point: GridPoint) -> int:
        return zlib.crc32(f"{self.seed}/{point.workload.name}/{point.qps:g}".encode())

    def run(self, point: GridPoint) -> list[Record]:
        first, second = point.workload.first, point.workload.second
        conversations = turn_list_conversations(
            [[(first.n_in, first.n_out), (second.n_in, second.n_out)]],
            point.qps,
            self.duration_s,
            workload=point.workload.name,
            seed=self.arrivals_seed(point),
        )
        config = ClusterConfig(
            topology=Topology.parse(point.shape),
            mode=point.mode,
            link=self.link,
            timeout_s=self.timeout_s,
            target_qps=point.qps,
            run_id=point.run_id,
            model=point.model,
            drift=tuple(parse_drift(text) for text in self.drift),
            placement=PlacementSettings(self.placement),
        )
        result = simulate(load_profile(self.profile), config, conversations)
        return [Record.from_dict(r) for r in result.records]


def make(options: EngineOptions) -> SimEngine:
    """The entry point of ``sim`` in the group ``ppd_table.engines``."""
    asked = options.placement or "least_loaded"
    if asked not in PLACEMENTS:
        raise ValueError(f"placement must be one of {', '.join(PLACEMENTS)}, got {asked!r}")
    placement: Placement = "prefix" if asked == "prefix" else "least_loaded"
    return SimEngine(duration_s=options.duration_s, seed=options.seed, placement=placement)
