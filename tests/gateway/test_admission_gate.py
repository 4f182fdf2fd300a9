"""The admission gate on a real event loop (gateway/admission_gate.py): a queued request admitted
when a slot frees, shed by its wait bound through the loop timer, dropped without a trace when its
client leaves, and a slot never lost to a cancellation."""

from __future__ import annotations

import asyncio
import time

import pytest

from gateway.admission_gate import AdmissionGate
from gateway.errors import TooManyRequestsError
from gateway.metrics import GatewayMetrics
from ppd.admission import AdmissionSettings
from tests.support.metrics import sample


def _gate(**kw: object) -> tuple[AdmissionGate, GatewayMetrics]:
    metrics = GatewayMetrics()
    settings = AdmissionSettings(enabled=True, max_inflight=1, **kw)  # type: ignore[arg-type]
    return AdmissionGate(settings, metrics, clock=time.monotonic, workers=lambda: 1), metrics


def _depth(metrics: GatewayMetrics, priority: str) -> float | None:
    return sample(metrics.registry, "ppd_gateway_admission_queue_depth", priority=priority)


async def test_a_queued_request_is_admitted_when_the_slot_frees() -> None:
    gate, metrics = _gate()
    first = await gate.enter("normal", "a")
    waiting = asyncio.create_task(gate.enter("normal", "b"))
    await asyncio.sleep(0)
    assert _depth(metrics, "normal") == 1
    gate.leave(first)
    gate.leave(first)  # once only
    second = await waiting
    assert sample(metrics.registry, "ppd_gateway_admission_in_flight") == 1
    gate.leave(second)
    assert sample(metrics.registry, "ppd_gateway_admission_in_flight") == 0


async def test_the_wait_bound_sheds_through_the_loop_timer() -> None:
    gate, metrics = _gate(max_wait_low_s=0.05)
    await gate.enter("normal", "a")
    with pytest.raises(TooManyRequestsError) as shed:
        await asyncio.wait_for(gate.enter("low", "b"), timeout=30.0)
    assert "wait_exceeded" in shed.value.message
    assert shed.value.response_headers() == {"Retry-After": "1"}
    assert (
        sample(metrics.registry, "ppd_gateway_admission_shed_total", reason="wait_exceeded", priority="low")
        == 1
    )
    assert _depth(metrics, "low") == 0


async def test_a_client_leaving_the_queue_is_not_shed_and_loses_no_slot() -> None:
    gate, metrics = _gate()
    first = await gate.enter("normal", "a")
    gone = asyncio.create_task(gate.enter("normal", "b"))
    await asyncio.sleep(0)
    gone.cancel()
    with pytest.raises(asyncio.CancelledError):
        await gone
    assert _depth(metrics, "normal") == 0
    assert (
        sample(metrics.registry, "ppd_gateway_admission_shed_total", reason="queue_full", priority="normal")
        is None
    )
    # Admitted and cancelled in the same turn of the loop: its slot comes back.
    racing = asyncio.create_task(gate.enter("normal", "c"))
    await asyncio.sleep(0)
    gate.leave(first)
    racing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await racing
    assert sample(metrics.registry, "ppd_gateway_admission_in_flight") == 0
    assert (await gate.enter("normal", "d")).number >= 0
