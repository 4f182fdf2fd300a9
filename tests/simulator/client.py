"""Helpers for the tests that talk to in-process simulated workers: start them, post, read SSE and metrics."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

import aiohttp

from simulator.core.faults import Faults
from simulator.core.profile import Profile, load_profile
from simulator.core.topology import Role, Topology, WorkerSpec
from simulator.core.worker_settings import WorkerSettings
from simulator.server.worker_group import GroupSettings, WorkerGroup
from tests.support.metrics import total

__all__ = ["metric", "post", "sse", "start_alone", "start_group"]


async def start_group(
    topology: str,
    *,
    worker_faults: Mapping[str, Faults] | None = None,
    profile: Profile | None = None,
    **worker: Any,
) -> WorkerGroup:
    """A started cluster of `topology` on free ports, its workers' settings overridden by `worker`."""
    base = replace(WorkerSettings(worker_id="W", role="replica"), **worker)
    settings = GroupSettings(
        topology=Topology.parse(topology),
        base_port=0,
        worker=base,
        worker_faults=dict(worker_faults or {}),
        spin_s=0.0,
    )
    group = WorkerGroup(settings, profile or load_profile())
    await group.start()
    return group


async def start_alone(worker_id: str, role: Role, **worker: Any) -> WorkerGroup:
    """A worker with a fabric of its own, as if it ran in its own process (KV reads go over HTTP)."""
    base = replace(WorkerSettings(worker_id="W", role="replica"), **worker)
    topology = Topology(name=worker_id, workers=(WorkerSpec(id=worker_id, role=role),))
    group = WorkerGroup(
        GroupSettings(topology=topology, base_port=0, worker=base, spin_s=0.0), load_profile()
    )
    await group.start()
    return group


async def metric(
    http: aiohttp.ClientSession, url: str, name: str, *, absent: float | None = None, **labels: str
) -> float:
    """The sum of the /metrics samples called `name` whose labels include `labels`; `absent` is its value
    when none is shown (a histogram never observed)."""
    async with http.get(f"{url}/metrics") as response:
        value = total(await response.text(), name, labels)
    if value is None and absent is not None:
        return absent
    assert value is not None, f"{name} {labels} not in /metrics"
    return value


async def post(http: aiohttp.ClientSession, url: str, body: Any, **headers: str) -> tuple[int, Any]:
    async with http.post(url, json=body, headers=headers) as response:
        return response.status, await response.json(content_type=None)


async def sse(http: aiohttp.ClientSession, url: str, body: Any, **headers: str) -> list[Any]:
    """The decoded `data:` events of a stream, `[DONE]` as the string."""
    async with http.post(url, json=body, headers=headers) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/event-stream")
        text = await response.text()
    events: list[Any] = []
    for block in text.split("\n\n"):
        if not block:
            continue
        assert block.startswith("data: ")
        payload = block[len("data: ") :]
        events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events
