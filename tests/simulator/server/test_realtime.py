"""The real-time driver and sim-engine's virtual-time driver produce the same step log for the same arrivals.

Arrivals come in bursts, each submitted at one instant while the driver is idle, so the comparison never
depends on where a wall-clock arrival lands relative to a step (no timer race). Within a burst the
real-time steps follow each other at absolute deadlines, so their start times match the virtual ones.
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from simulator.core.engine import Engine, EngineConfig, EngineRequest, KvPull
from simulator.core.profile import load_profile
from simulator.core.virtual import run_engine
from simulator.server.jobs import Emission, JobHandle
from simulator.server.realtime import RealtimeDriver, StepTiming

BURST_GAP_S = 1000.0


def burst(tag: str, base_stream: int) -> list[EngineRequest]:
    return [
        EngineRequest.from_stream(f"{tag}-short", base_stream, 40, max_tokens=12),
        EngineRequest.from_stream(f"{tag}-long", base_stream + 1, 3000, max_tokens=6),
        EngineRequest.from_stream(f"{tag}-stop", base_stream + 2, 200, max_tokens=30, eos_at=9),
        EngineRequest.from_stream(f"{tag}-pd", base_stream + 3, 500, max_tokens=5, remote_prefill=True),
        EngineRequest.from_stream(f"{tag}-p", base_stream + 4, 300, max_tokens=1, remote_decode=True),
    ]


def follow_up() -> list[EngineRequest]:
    # Extends stream 0's prompt: hits the blocks the first burst left in the prefix cache.
    return [EngineRequest.from_stream("b-turn2", 0, 120, max_tokens=8), *burst("b", 10)]


def relative(log: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Step log with times relative to the first step of their burst."""
    out: list[dict[str, Any]] = []
    origin = 0.0
    previous_end: float | None = None
    for entry in log:
        if previous_end is None or entry["t"] > previous_end + 1e-6:  # an idle gap: a new burst
            origin = entry["t"]
        previous_end = entry["t"] + entry["dt"]
        out.append(entry | {"t": entry["t"] - origin})
    return out


def virtual_log() -> list[dict[str, Any]]:
    engine = Engine(load_profile(), EngineConfig(lease_s=1e9))
    arrivals = [(0.0, r) for r in burst("a", 0)] + [(BURST_GAP_S, r) for r in follow_up()]
    return relative(run_engine(engine, arrivals).step_log)


async def realtime_log() -> list[dict[str, Any]]:
    engine = Engine(load_profile(), EngineConfig(lease_s=1e9))
    timing = StepTiming(record_log=True)
    holder: list[RealtimeDriver] = []

    def on_pull(pull: KvPull, at: float) -> None:
        holder[0].kv_loaded(pull.request_id, at)  # the KV is there at once, as in run_engine

    driver = RealtimeDriver(engine, spin_s=0.0, on_pull=on_pull, timing=timing)
    holder.append(driver)
    driver.start()
    try:
        for requests in (burst("a", 0), follow_up()):
            handles = []
            for request in requests:
                handle = JobHandle(request_id=request.request_id, submitted_at=driver.now())
                driver.submit(request, handle)
                handles.append(handle)
            for handle in handles:
                last: Emission | None = None
                while last is None or not last.finished:
                    last = await asyncio.wait_for(handle.queue.get(), 30)
                assert last.error is None
            assert engine.load() == 0
    finally:
        await driver.stop()
    return relative(timing.log)


async def test_realtime_and_virtual_step_logs_agree() -> None:
    expected = virtual_log()
    got = await realtime_log()
    assert len(got) == len(expected)
    for mine, theirs in zip(got, expected, strict=True):
        assert {k: v for k, v in mine.items() if k not in ("t", "dt")} == {
            k: v for k, v in theirs.items() if k not in ("t", "dt")
        }
        assert mine["dt"] == pytest.approx(theirs["dt"], rel=1e-9, abs=1e-12)
        assert mine["t"] == pytest.approx(theirs["t"], abs=1e-6)
    assert any(e["pulls"] for e in expected)
    assert any(p[2] > 0 for e in expected for p in e["prefill"])  # the follow-up hit the prefix cache
