"""The KV fabric of one simulator process: who holds which engine id, and the P->D links between nodes.

Invariants:
- Rule 1: one `Link` per (source node, destination node) pair, shared by every transfer between them,
  so a P->D transfer competes with the others on its link (processor sharing in `shared_link` mode).
- Rule 2: link time only moves forward; a transfer started "in the past" (a driver catching up) starts
  at the link's latest time instead.
- Rule 3: completions are delivered by one timer task per process, at their delivery time, through the
  callback given to `transfer`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from simulator.core.link import Link, TransferDone, TransferMode
from simulator.core.profile import Profile
from simulator.server.background import BackgroundTask

__all__ = ["Fabric", "FabricSettings", "KvSource"]

logger = logging.getLogger(__name__)

DoneCallback = Callable[[TransferDone], None]


class KvSource(Protocol):
    """A prefill worker as the decode side sees it (in this process)."""

    @property
    def node(self) -> str: ...

    def claim_lease(self, remote_request_id: str, now: float) -> bool:
        """True when the pinned blocks are still there; they stay pinned until `release_lease`."""
        ...

    def release_lease(self, remote_request_id: str, now: float) -> None:
        """The read finished (or was not needed): unpin the blocks."""
        ...


@dataclass(frozen=True, slots=True)
class FabricSettings:
    link: str = "nvlink"
    mode: TransferMode = TransferMode.SHARED_LINK
    physical_link: str = "nvlink"  # what really carries the bytes in blocking_on_decode mode


class Fabric:
    def __init__(
        self, profile: Profile, settings: FabricSettings, *, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.profile = profile
        self.settings = settings
        self._spec = profile.link(settings.link)
        self._physical = profile.link(settings.physical_link)
        self._clock = clock
        self._sources: dict[str, KvSource] = {}
        self._links: dict[tuple[str, str], Link] = {}
        self._link_time: dict[tuple[str, str], float] = {}
        self._callbacks: dict[tuple[tuple[str, str], int], DoneCallback] = {}
        self._wake = asyncio.Event()
        self._task = BackgroundTask(self._run, "kv-fabric")

    @property
    def kv_bytes_per_token(self) -> int:
        return self.profile.model.kv_bytes_per_token

    def register(self, engine_id: str, source: KvSource) -> None:
        self._sources[engine_id] = source

    def unregister(self, engine_id: str) -> None:
        self._sources.pop(engine_id, None)

    def source(self, engine_id: str) -> KvSource | None:
        return self._sources.get(engine_id)

    def _link(self, pair: tuple[str, str]) -> Link:
        link = self._links.get(pair)
        if link is None:
            physical = self._physical if self.settings.mode is TransferMode.BLOCKING_ON_DECODE else None
            link = Link(self._spec, self.settings.mode, physical)
            self._links[pair] = link
        return link

    def link_pairs(self) -> list[tuple[str, str]]:
        """The (source node, destination node) pairs that have a link so far."""
        return sorted(self._links)

    def transfer(self, src: str, dst: str, n_bytes: int, now: float, on_done: DoneCallback) -> None:
        pair = (src, dst)
        link = self._link(pair)
        start = max(now, self._link_time.get(pair, now))
        self._link_time[pair] = start
        tid = link.start(start, n_bytes)
        self._callbacks[(pair, tid)] = on_done
        self._wake.set()

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()

    def _next_at(self) -> float | None:
        best: float | None = None
        for link in self._links.values():
            t = link.next_completion_at()
            if t is not None and (best is None or t < best):
                best = t
        return best

    def _deliver_until(self, t: float) -> None:
        for pair, link in self._links.items():
            if link.active == 0 and link.next_completion_at() is None:
                continue
            self._link_time[pair] = max(self._link_time.get(pair, t), t)
            for done in link.completions_until(t):
                callback = self._callbacks.pop((pair, done.transfer_id), None)
                if callback is not None:
                    callback(done)

    async def _run(self) -> None:
        while True:
            self._wake.clear()
            due = self._next_at()
            now = self._clock()
            if due is None:
                await self._wake.wait()
                continue
            if due > now:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._wake.wait(), due - now)
                continue
            self._deliver_until(now)
