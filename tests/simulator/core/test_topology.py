"""Cluster topologies such as 1P3D, 4R (pure parsing)."""

from __future__ import annotations

import pytest

from simulator.core.topology import Topology, TopologyError


def test_topologies() -> None:
    topo = Topology.parse("1P3D")
    assert [(w.id, w.role) for w in topo.workers] == [
        ("P0", "prefill"),
        ("D0", "decode"),
        ("D1", "decode"),
        ("D2", "decode"),
    ]
    assert [w.id for w in Topology.parse("4r").workers] == ["R0", "R1", "R2", "R3"]
    assert len(Topology.parse("3P1D").workers) == 4
    for bad in ("", "P3D", "1X", "3D", "100R", "0R"):
        with pytest.raises(TopologyError):
            Topology.parse(bad)
