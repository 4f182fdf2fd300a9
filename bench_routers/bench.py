"""The run: start the targets, drive them interleaved at each concurrency, stop everything.

Rule 1: at each concurrency level every target first gets one unmeasured warm-up batch (one request
        per stream: connections opened, code paths warm). Then the measured requests are split into
        `rounds` batches per target, run one target at a time in round-robin order, the order rotated
        every round, so that machine noise (other tenants, the worker's own pace) hits all alike.
Rule 2: a router's CPU time is read around its own batches only (its process tree, /proc); the
        worker's likewise, to show what each path costs the worker.
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

from bench_routers.cpu import tree_cpu_seconds
from bench_routers.figures import DIRECT, OURS, PEER, TARGETS, TargetTotals, format_level, level_figures
from bench_routers.load import Batch, LoadSpec, run_batch
from bench_routers.targets import Target, model_of, start_gateway, start_sglang, start_worker, wait_ready
from devstack.supervisor import Supervisor

__all__ = ["BenchSettings", "run"]


@dataclass(frozen=True, slots=True)
class BenchSettings:
    streams: tuple[int, ...] = (1, 16, 64, 200)
    # Measured requests per target at each level (at least one per stream per round).
    requests: int = 200
    rounds: int = 4
    max_tokens: int = 32
    timeout_s: float = 60.0
    ready_timeout_s: float = 60.0
    # An OpenAI-compatible worker to use (e.g. real vLLM); empty = start a simulated one.
    worker_url: str = ""
    # A new client connection for every request instead of keep-alive pools.
    connection_per_request: bool = False

    def per_stream(self, streams: int) -> int:
        """Requests per stream in one measured batch."""
        return max(1, math.ceil(self.requests / (self.rounds * streams)))


def _loadavg() -> list[float]:
    return [round(x, 2) for x in os.getloadavg()]


def _cpu(pid: int | None) -> float | None:
    return None if pid is None else tree_cpu_seconds(pid)


@dataclass(slots=True)
class _Run:
    settings: BenchSettings
    targets: list[Target]
    sessions: dict[str, aiohttp.ClientSession]
    spec: LoadSpec
    worker_pid: int | None
    sent: int = 0

    def indices(self, n: int) -> int:
        """The first of `n` request indices never used before in this run."""
        first = self.sent
        self.sent += n
        return first

    async def batch(self, target: Target, streams: int, per_stream: int) -> Batch:
        return await run_batch(
            self.sessions[target.name], target.chat_url, self.spec, streams=streams,
            per_stream=per_stream, first_index=self.indices(streams * per_stream),
        )  # fmt: skip

    async def level(self, streams: int) -> dict[str, Any]:
        for target in self.targets:  # warm-up, unmeasured
            await self.batch(target, streams, 1)
        per_stream = self.settings.per_stream(streams)
        totals = {name: TargetTotals() for name in TARGETS}
        for round_no in range(self.settings.rounds):
            shift = round_no % len(self.targets)
            for target in self.targets[shift:] + self.targets[:shift]:
                cpu0, worker0 = _cpu(target.pid), _cpu(self.worker_pid)
                start = time.perf_counter()
                batch = await self.batch(target, streams, per_stream)
                wall = time.perf_counter() - start
                cpu1, worker1 = _cpu(target.pid), _cpu(self.worker_pid)
                totals[target.name].add(
                    batch,
                    router_cpu_s=None if cpu0 is None or cpu1 is None else cpu1 - cpu0,
                    worker_cpu_s=None if worker0 is None or worker1 is None else worker1 - worker0,
                    wall_s=wall,
                )
        return level_figures(streams, totals)


async def run(settings: BenchSettings, emit: Callable[[str], None]) -> dict[str, Any]:
    """Run the benchmark, `emit` each level's table as it is measured; every figure, JSON-ready."""
    sup = Supervisor(grace_s=10.0)
    sessions: dict[str, aiohttp.ClientSession] = {}
    try:
        with tempfile.TemporaryDirectory(prefix="ppd-bench-routers-") as scratch:
            for name in TARGETS:  # one client pool per target, kept for the whole run
                connector = aiohttp.TCPConnector(limit=0, force_close=settings.connection_per_request)
                sessions[name] = aiohttp.ClientSession(connector=connector)
            probe = sessions[DIRECT]
            worker_pid: int | None = None
            if settings.worker_url:
                worker_url = settings.worker_url.rstrip("/")
            else:
                worker = await start_worker(sup, settings.ready_timeout_s)
                worker_url, worker_pid = str(worker.ready["url"]), worker.proc.pid
            model = await model_of(probe, worker_url, settings.ready_timeout_s)
            spec = LoadSpec(model=model, max_tokens=settings.max_tokens, timeout_s=settings.timeout_s)
            direct = Target(DIRECT, worker_url, None)
            await wait_ready(probe, direct, spec, settings.ready_timeout_s)
            ours = await start_gateway(sup, worker_url, Path(scratch), settings.ready_timeout_s)
            await wait_ready(sessions[ours.name], ours, spec, settings.ready_timeout_s)
            peer = await start_sglang(sup, sessions[PEER], worker_url, spec, settings.ready_timeout_s)
            bench = _Run(settings, [direct, ours, peer], sessions, spec, worker_pid)
            date = datetime.now(UTC).isoformat(timespec="seconds")
            worker_label = worker_url if settings.worker_url else "simulated (replica)"
            version = importlib.metadata.version("sglang-router")
            clients = "a connection per request" if settings.connection_per_request else "keep-alive clients"
            load_start = _loadavg()
            emit(
                f"ppd-bench-routers {date}: worker {worker_label} ({model}), "
                f"max_tokens {settings.max_tokens}, {clients}, sglang-router {version}, "
                f"{os.cpu_count()} CPUs, load average {' '.join(map(str, load_start))}"
            )
            levels = []
            for streams in settings.streams:
                level = await bench.level(streams)
                levels.append(level)
                emit(format_level(level, settings.rounds))
            load_end = _loadavg()
            emit(f"load average at the end: {' '.join(map(str, load_end))}")
            return {
                "benchmark": "ppd-bench-routers",
                "date": date,
                "machine": {"cpus": os.cpu_count(), "loadavg_start": load_start, "loadavg_end": load_end},
                "settings": {
                    "streams": list(settings.streams),
                    "requests": settings.requests,
                    "rounds": settings.rounds,
                    "max_tokens": settings.max_tokens,
                    "connection_per_request": settings.connection_per_request,
                    "worker": worker_label,
                    "model": model,
                    "sglang_router": version,
                },
                "processes": {"worker": worker_pid, OURS: ours.pid, PEER: peer.pid},
                "levels": levels,
            }
    finally:
        for session in sessions.values():
            await session.close()
        await sup.stop_all()
