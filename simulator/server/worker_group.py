"""Several simulated workers in one process sharing one KV fabric (`ppd-sim cluster`, `ppd-sim worker`).

Invariants:
- Rule 1: the ready line is printed only after every worker answered `GET /health` over TCP.
- Rule 2: SIGINT and SIGTERM stop every worker (sites closed, drivers cancelled) and the process exits 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from typing import Any, TextIO

import aiohttp

from simulator.core.faults import Faults
from simulator.core.kv_load_policy import KvLoadFailurePolicy
from simulator.core.profile import Profile
from simulator.core.tokenizer import Llama3Tokenizer
from simulator.core.topology import Topology
from simulator.core.worker_settings import WorkerSettings
from simulator.server.deadline_board import DeadlineBoard
from simulator.server.fabric import Fabric, FabricSettings
from simulator.server.realtime import DEFAULT_SPIN_S, StepTiming
from simulator.server.tracing import worker_tracing
from simulator.server.worker import Worker

__all__ = ["GroupSettings", "WorkerGroup", "serve_group"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class GroupSettings:
    """A topology, its first port (0 = any free ports) and the settings every worker starts from."""

    topology: Topology
    base_port: int
    worker: WorkerSettings
    fabric: FabricSettings = field(default_factory=FabricSettings)
    worker_faults: Mapping[str, Faults] = field(default_factory=dict)
    nodes: Mapping[str, str] = field(default_factory=dict)  # worker id -> node (default: its own)
    # worker id -> kv_load_failure_policy (default: the worker settings')
    kv_load_failure_policies: Mapping[str, KvLoadFailurePolicy] = field(default_factory=dict)
    # worker ids that run bidirectional_kv_xfer whatever the worker settings say (--bidir-workers)
    bidir_workers: frozenset[str] = frozenset()
    spin_s: float = DEFAULT_SPIN_S
    # vLLM's --otlp-traces-endpoint: each worker exports an `llm_request` span per request (tracing.py).
    otlp_traces_endpoint: str = ""


class WorkerGroup:
    def __init__(
        self,
        settings: GroupSettings,
        profile: Profile,
        *,
        tokenizer: Llama3Tokenizer | None = None,
        timing: StepTiming | None = None,
    ) -> None:
        self.settings = settings
        self.tokenizer = tokenizer or Llama3Tokenizer()
        self.fabric = Fabric(profile, settings.fabric)
        board = DeadlineBoard()  # one event loop hosts every worker's driver
        self._tracing = worker_tracing(settings.otlp_traces_endpoint)
        tracer = self._tracing.tracer if self._tracing is not None else None
        self.workers: list[Worker] = []
        for i, spec in enumerate(settings.topology.workers):
            port = settings.base_port + i if settings.base_port else 0
            faults = settings.worker_faults.get(spec.id, settings.worker.faults)
            worker_settings = replace(
                settings.worker,
                worker_id=spec.id,
                role=spec.role,
                port=port,
                faults=faults,
                fault_seed=i,
                node=settings.nodes.get(spec.id, ""),
                kv_load_failure_policy=settings.kv_load_failure_policies.get(
                    spec.id, settings.worker.kv_load_failure_policy
                ),
                bidirectional_kv_xfer=settings.worker.bidirectional_kv_xfer
                or spec.id in settings.bidir_workers,
                kv_events=settings.worker.kv_events.offset(i) if settings.worker.kv_events else None,
            )
            self.workers.append(
                Worker(
                    worker_settings,
                    tokenizer=self.tokenizer,
                    fabric=self.fabric,
                    spin_s=settings.spin_s,
                    timing=timing,
                    board=board,
                    tracer=tracer,
                )
            )

    def worker(self, worker_id: str) -> Worker:
        for w in self.workers:
            if w.settings.worker_id == worker_id:
                return w
        raise KeyError(worker_id)

    async def start(self) -> None:
        self.fabric.start()
        for w in self.workers:
            await w.start()
        await self._wait_healthy()

    async def _wait_healthy(self) -> None:
        timeout = aiohttp.ClientTimeout(total=5)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for w in self.workers:
                if w.is_down:
                    continue
                async with session.get(f"{w.url}/health") as response:
                    if response.status != 200:
                        raise RuntimeError(
                            f"worker {w.settings.worker_id} answered /health with {response.status}"
                        )

    async def stop(self) -> None:
        for w in self.workers:  # every worker refuses half-parsed requests before the first one waits
            w.begin_stop()
        for w in self.workers:
            await w.stop()
        await self.fabric.stop()
        if self._tracing is not None:
            await asyncio.to_thread(self._tracing.close)  # exports the spans still queued

    def ready_line(self) -> dict[str, Any]:
        return {"topology": self.settings.topology.name, "workers": [w.describe() for w in self.workers]}


async def serve_group(group: WorkerGroup, out: TextIO, *, single: bool = False) -> int:
    """Start, print the ready line, run until SIGINT/SIGTERM, stop."""
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    try:
        await group.start()
        line = group.workers[0].describe() if single else group.ready_line()
        out.write(json.dumps(line) + "\n")
        out.flush()
        logger.info("serving %s", json.dumps(line))
        await stop.wait()
        logger.info("signal received, stopping")
    finally:
        await group.stop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            with contextlib.suppress(Exception):
                loop.remove_signal_handler(sig)
    return 0
