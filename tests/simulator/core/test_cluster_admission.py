"""Admission control in the virtual-time cluster (ClusterConfig.admission, ppd/admission.py): what is
over the in-flight bound waits or is shed (its record says why, and its conversation ends), the high
tenant goes first, and nothing is lost: every request is served or shed."""

from __future__ import annotations

from typing import Any

from ppd.admission import AdmissionSettings, TenantSettings
from simulator.core.cluster import ClusterConfig, simulate
from simulator.core.profile import load_profile
from simulator.core.topology import Topology
from simulator.core.workload import Conversation, Turn

PROFILE = load_profile("llama-3.1-8b-h100")


def _burst(tenant: str, n: int, at: float) -> list[Conversation]:
    turns = (Turn(200, 50), Turn(20, 50))
    return [Conversation(f"{tenant}-{i}", tenant, at, turns) for i in range(n)]


def _run(admission: AdmissionSettings | None, conversations: list[Conversation]) -> list[dict[str, Any]]:
    config = ClusterConfig(topology=Topology.parse("1P1D"), mode="pd", admission=admission)
    return simulate(PROFILE, config, conversations).records


def test_over_the_bound_requests_wait_or_are_shed_and_none_is_lost() -> None:
    adm = AdmissionSettings(
        enabled=True,
        max_inflight=2,
        max_queue=3,
        tenants={"gold": TenantSettings(priority="high")},
    )
    conversations = _burst("bulk", 8, 0.0) + _burst("gold", 1, 0.0)
    records = _run(adm, conversations)
    shed = [r for r in records if not r["ok"]]
    assert {r["error"] for r in shed} == {"shed_queue_full", "shed_displaced"}
    assert all(r["ttft_ms"] is None and r["turn"] == 1 for r in shed)  # shed turn 1: no turn 2 follows
    served = [r for r in records if r["ok"]]
    assert len(served) == 2 * (9 - len(shed))  # the others' conversations ran both turns
    gold = next(r for r in records if r["conversation_id"] == "gold-0" and r["turn"] == 1)
    assert gold["ok"]
    # bulk-0 and bulk-1 in flight, bulk-2..4 queued, bulk-5..7 shed (queue full), gold (high)
    # displaces bulk-4 and goes before bulk-2 and bulk-3.
    shed_ids = {r["conversation_id"] for r in shed}
    assert shed_ids == {"bulk-4", "bulk-5", "bulk-6", "bulk-7"}

    def ttft(conversation: str) -> float:
        return next(
            float(r["ttft_ms"]) for r in served if r["conversation_id"] == conversation and r["turn"] == 1
        )

    assert ttft("bulk-0") < ttft("gold-0") < ttft("bulk-2") < ttft("bulk-3")


def test_the_wait_bound_sheds_in_virtual_time() -> None:
    adm = AdmissionSettings(enabled=True, max_inflight=1, max_queue=10, max_wait_normal_s=0.001)
    records = _run(adm, _burst("bulk", 4, 0.0))
    assert sum(1 for r in records if r["error"] == "shed_wait_exceeded") == 3


def test_off_or_unbounded_changes_nothing() -> None:
    conversations = _burst("bulk", 6, 0.0)
    plain = _run(None, conversations)
    assert _run(AdmissionSettings(enabled=False, max_inflight=1), conversations) == plain
    assert _run(AdmissionSettings(enabled=True), conversations) == plain
