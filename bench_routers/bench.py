"""The run: start the workers and the routers, drive them interleaved at each answer length and
concurrency (a cell), Turn 1 and Turn 2 of the same conversations, stop everything.

Rule 1: in every cell each target first gets one unmeasured warm-up conversation per stream (both
        turns: connections opened, code paths warm). Then the measured conversations are split into
        `rounds` batches per target, run one target at a time in round-robin order, the order rotated
        every round, so that machine noise (other tenants, the workers' own pace) hits all alike.
Rule 2: a target's batch is two: Turn 1 of its conversations (measured as the pd turn when the target
        routes vLLM P/D, else sent unmeasured), then Turn 2 of those same conversations (the local
        turn). The CPU time of every process of the router (its process tree each, /proc) is read
        around each of the two on its own, and the workers' likewise.
Rule 3: every process started is stopped before `run` returns or raises, cancellation included.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import aiohttp

from bench_routers.cpu import processes_cpu_seconds, tree_cpu_seconds
from bench_routers.figures import TURNS, TargetTotals, cell_figures, format_cell, format_summary, summary
from bench_routers.load import Batch, Conversation, LoadSpec, run_batch
from bench_routers.targets import (
    DIRECT,
    TARGETS,
    Target,
    Workers,
    direct_target,
    gateway_config,
    model_of,
    start_cluster,
    start_envoy_picker,
    start_gateway,
    start_sglang,
    wait_ready,
)
from devstack.supervisor import Supervisor

__all__ = ["BenchSettings", "Progress", "run"]

#: Told once per measured target batch pair (`advance`), with what is being measured (`describe`).
Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class BenchSettings:
    streams: tuple[int, ...] = (1, 16, 64, 200)
    # Tokens per answer (one SSE chunk each), one set of cells each.
    max_tokens: tuple[int, ...] = (1, 32, 256)
    # Measured conversations per target in each cell (at least one per stream per round). Small, so
    # that the whole grid runs in about 10 minutes: at one stream a 256-token conversation takes ~4 s.
    requests: int = 8
    rounds: int = 2
    timeout_s: float = 120.0
    ready_timeout_s: float = 60.0
    # An existing P/D pair (e.g. real vLLM); empty = start a simulated 1P1D cluster.
    prefill_url: str = ""
    decode_url: str = ""
    # A new client connection for every request instead of keep-alive pools.
    connection_per_request: bool = False
    # Also Envoy on envoy-gie.yaml (GIE's full-duplex mode: every answer chunk through the picker).
    envoy_gie: bool = False

    def per_stream(self, streams: int) -> int:
        """Conversations per stream in one measured batch."""
        return max(1, math.ceil(self.requests / (self.rounds * streams)))

    @property
    def batches(self) -> int:
        """Measured target batches in the whole run (what the progress bar counts)."""
        targets = len(TARGETS) if self.envoy_gie else len(TARGETS) - 1
        return len(self.max_tokens) * len(self.streams) * self.rounds * targets


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


@dataclass(slots=True)
class _Measured:
    batch: Batch
    cpu_s: dict[str, float]
    worker_cpu_s: float | None
    wall_s: float


@dataclass(slots=True)
class _Run:
    settings: BenchSettings
    targets: list[Target]
    sessions: dict[str, aiohttp.ClientSession]
    worker_pid: int | None
    progress: Progress
    next_index: int = 0

    def conversations(self, n: int) -> list[Conversation]:
        """`n` conversations whose indices were never used before in this run."""
        first = self.next_index
        self.next_index += n
        return [Conversation(i) for i in range(first, first + n)]

    async def batch(
        self, target: Target, spec: LoadSpec, conversations: list[Conversation], turn: int, streams: int
    ) -> _Measured:
        worker0 = None if self.worker_pid is None else tree_cpu_seconds(self.worker_pid)
        cpu0 = processes_cpu_seconds(target.pids)
        start = time.perf_counter()
        batch = await run_batch(
            self.sessions[target.name], target.turn1 if turn == 1 else target.turn2, spec, conversations,
            turn=turn, streams=streams, tag=target.name,
        )  # fmt: skip
        wall = time.perf_counter() - start
        cpu1 = processes_cpu_seconds(target.pids)
        worker_s = (
            None
            if worker0 is None or self.worker_pid is None
            else tree_cpu_seconds(self.worker_pid) - worker0
        )
        return _Measured(batch, {role: cpu1[role] - cpu0[role] for role in cpu0}, worker_s, wall)

    async def cell(self, spec: LoadSpec, streams: int) -> dict[str, Any]:
        for target in self.targets:  # warm-up, unmeasured
            warm = self.conversations(streams)
            for turn in (1, 2):
                await self.batch(target, spec, warm, turn, streams)
        per_stream = self.settings.per_stream(streams)
        totals: dict[str, dict[str, TargetTotals]] = {turn: {} for turn in TURNS}
        for round_no in range(self.settings.rounds):
            shift = round_no % len(self.targets)
            for target in self.targets[shift:] + self.targets[:shift]:
                self.progress(
                    f"{spec.max_tokens} tokens, {streams} streams, round {round_no + 1}: {target.name}"
                )
                conversations = self.conversations(streams * per_stream)
                for turn, name in ((1, "pd"), (2, "local")):
                    m = await self.batch(target, spec, conversations, turn, streams)
                    if turn == 1 and not target.routes_pd:
                        continue  # sent so that D holds the conversation; not vLLM P/D, not measured
                    totals[name].setdefault(target.name, TargetTotals()).add(
                        m.batch, cpu_s=m.cpu_s, worker_cpu_s=m.worker_cpu_s, wall_s=m.wall_s
                    )
        planes = {t.name: t.data_plane for t in self.targets if t.data_plane}
        return cell_figures(spec.max_tokens, streams, totals, planes)


async def _workers(sup: Supervisor, settings: BenchSettings) -> Workers:
    if settings.prefill_url:
        return Workers(settings.prefill_url.rstrip("/"), settings.decode_url.rstrip("/"))
    return await start_cluster(sup, settings.ready_timeout_s)


async def run(settings: BenchSettings, emit: Callable[[str], None], progress: Progress) -> dict[str, Any]:
    """Run the benchmark, `emit` each cell's tables as it is measured and the summary at the end;
    every figure, JSON-ready. Raises ChildError when something cannot start, ValueError for workers
    the picker's Envoy cannot reach (addressed by name)."""
    sup = Supervisor(grace_s=10.0)
    sessions: dict[str, aiohttp.ClientSession] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="ppd-bench-routers-") as scratch:
            for name in TARGETS:  # one client pool per target, kept for the whole run
                connector = aiohttp.TCPConnector(limit=0, force_close=settings.connection_per_request)
                sessions[name] = aiohttp.ClientSession(connector=connector)
            workers = await _workers(sup, settings)
            config = Path(scratch) / "gateway.toml"
            config.write_text(gateway_config(workers), encoding="utf-8")
            model = await model_of(sessions[DIRECT], workers.decode_url, settings.ready_timeout_s)
            probe = LoadSpec(model=model, max_tokens=1, timeout_s=settings.timeout_s)
            direct = direct_target(workers)
            await wait_ready(sessions[DIRECT], direct, probe, settings.ready_timeout_s)
            ours = await start_gateway(sup, config, settings.ready_timeout_s)
            await wait_ready(sessions[ours.name], ours, probe, settings.ready_timeout_s)
            envoy = await start_envoy_picker(sup, config, Path(scratch), settings.ready_timeout_s, workers)
            await wait_ready(sessions[envoy.name], envoy, probe, settings.ready_timeout_s)
            targets = [direct, ours, envoy]
            if settings.envoy_gie:
                gie = await start_envoy_picker(
                    sup, config, Path(scratch), settings.ready_timeout_s, workers, gie=True
                )
                await wait_ready(sessions[gie.name], gie, probe, settings.ready_timeout_s)
                targets.append(gie)
            peer = await start_sglang(
                sup, sessions["sglang"], workers.decode_url, probe, settings.ready_timeout_s
            )
            targets.append(peer)
            bench = _Run(settings, targets, sessions, workers.pid, progress)
            date = datetime.now(UTC).isoformat(timespec="seconds")
            worker_label = (
                f"P {workers.prefill_url}, D {workers.decode_url}"
                if settings.prefill_url
                else "simulated 1P1D"
            )
            version = importlib.metadata.version("sglang-router")
            clients = "a connection per request" if settings.connection_per_request else "keep-alive clients"
            load_start = _loadavg()
            emit(
                f"ppd-bench-routers {date}: workers {worker_label} ({model}), {clients}, sglang-router "
                f"{version}, {os.cpu_count()} CPUs, load average {' '.join(map(str, load_start))}"
            )
            cells = []
            for max_tokens in settings.max_tokens:
                spec = LoadSpec(model=model, max_tokens=max_tokens, timeout_s=settings.timeout_s)
                for streams in settings.streams:
                    cell = await bench.cell(spec, streams)
                    cells.append(cell)
                    emit(format_cell(cell, settings.rounds))
            totals = summary(cells)
            emit(format_summary(cells, totals))
            load_end = _loadavg()
            emit(f"load average at the end: {' '.join(map(str, load_end))}")
            return {
                "benchmark": "ppd-bench-routers",
                "date": date,
                "machine": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": load_end},
                "settings": {
                    "streams": list(settings.streams),
                    "max_tokens": list(settings.max_tokens),
                    "requests": settings.requests,
                    "rounds": settings.rounds,
                    "connection_per_request": settings.connection_per_request,
                    "envoy_gie": settings.envoy_gie,
                    "workers": worker_label,
                    "model": model,
                    "sglang_router": version,
                },
                "processes": {
                    "workers": workers.pid,
                    **{target.name: dict(target.pids) for target in targets if target.pids},
                },
                "cells": cells,
                "summary": totals,
            }
    finally:
        for session in sessions.values():
            await session.close()
        await sup.stop_all()
