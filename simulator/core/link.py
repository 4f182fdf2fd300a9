"""The KV link between a prefill and a decode node, sans-I/O (docs/emulator-model.md 3.4).

Three modes:

- ``shared_link``: processor sharing. n active flows each get bandwidth/n; finish times are
  recomputed whenever a flow starts or ends. A transfer is delivered ``latency_s`` after its last byte.
- ``async``: every transfer takes ``latency + bytes / bandwidth`` on its own, no contention.
- ``blocking_on_decode`` (the paper's emulation): the bytes really move over the ``physical`` link
  (NVLink by default, no contention), and the decode worker then sleeps
  ``max(0, bytes / bandwidth − physical time)`` inside the step that admits the request. The link
  reports that sleep as ``TransferDone.stall_s``; the engine adds it to the step (``kv_loaded``).

Protocol: ``start(now, n_bytes) -> transfer id``; ``next_completion_at()``; ``completions_until(t)``
returns every transfer delivered at or before ``t``, in delivery order; ``set_bandwidth(now, bw)``
(drift). Times only move forward.

Invariant (shared mode): all active flows have received the same number of bytes since they started,
so one "virtual bytes per flow" counter and a heap of per-flow targets describe the whole state.
"""

from __future__ import annotations

import enum
import heapq
import math
from collections import deque
from dataclasses import dataclass

from simulator.core.profile import LinkSpec

__all__ = ["Link", "TransferDone", "TransferMode"]


class TransferMode(enum.StrEnum):
    SHARED_LINK = "shared_link"
    ASYNC = "async"
    BLOCKING_ON_DECODE = "blocking_on_decode"


@dataclass(frozen=True, slots=True)
class TransferDone:
    transfer_id: int
    at: float
    n_bytes: int
    stall_s: float = 0.0


class Link:
    """One link (one P->D node pair, or a shared fabric) in one of the three modes."""

    __slots__ = (
        "_bw",
        "_delivered",
        "_heap",
        "_lat",
        "_mode",
        "_n",
        "_next_id",
        "_phys_bw",
        "_sizes",
        "_t",
        "_v",
        "spec",
    )

    def __init__(self, spec: LinkSpec, mode: TransferMode, physical: LinkSpec | None = None) -> None:
        self.spec = spec
        self._mode = mode
        self._bw = spec.bandwidth_bytes_per_s
        self._lat = spec.latency_s
        self._phys_bw = physical.bandwidth_bytes_per_s if physical is not None else None
        self._t = 0.0
        self._v = 0.0  # bytes each active flow has received (shared mode)
        self._n = 0
        self._heap: list[tuple[float, int]] = []  # shared: (target v, id); others: (done at, id)
        self._sizes: dict[int, tuple[int, float]] = {}  # id -> (bytes, stall)
        self._delivered: deque[TransferDone] = deque()
        self._next_id = 0

    @property
    def mode(self) -> TransferMode:
        return self._mode

    @property
    def active(self) -> int:
        return len(self._sizes)

    def start(self, now: float, n_bytes: int) -> int:
        tid = self._next_id
        self._next_id += 1
        if self._mode is TransferMode.SHARED_LINK:
            self._advance(now)
            self._sizes[tid] = (n_bytes, 0.0)
            heapq.heappush(self._heap, (self._v + n_bytes, tid))
            self._n += 1
            return tid
        if self._mode is TransferMode.ASYNC:
            done, stall = now + self._lat + n_bytes / self._bw, 0.0
        else:
            phys = n_bytes / self._phys_bw if self._phys_bw else 0.0
            done, stall = now + phys, max(0.0, n_bytes / self._bw - phys)
        self._sizes[tid] = (n_bytes, stall)
        heapq.heappush(self._heap, (done, tid))
        return tid

    def set_bandwidth(self, now: float, bytes_per_s: float) -> None:
        """From ``now`` on the link moves ``bytes_per_s`` (a drift event). Shared mode: flows under way
        continue at the new rate; the other modes price only transfers started from now on."""
        if not (math.isfinite(bytes_per_s) and bytes_per_s > 0):
            raise ValueError(f"bandwidth must be a positive number, got {bytes_per_s}")
        if self._mode is TransferMode.SHARED_LINK:
            self._advance(now)
        self._bw = bytes_per_s

    def cancel(self, transfer_id: int, now: float) -> bool:
        if transfer_id not in self._sizes:
            return False
        if self._mode is TransferMode.SHARED_LINK:
            self._advance(now)
            self._n -= 1
        del self._sizes[transfer_id]
        self._heap = [e for e in self._heap if e[1] != transfer_id]
        heapq.heapify(self._heap)
        self._delivered = deque(d for d in self._delivered if d.transfer_id != transfer_id)
        return True

    def next_completion_at(self) -> float | None:
        best = self._delivered[0].at if self._delivered else None
        if self._heap:
            if self._mode is TransferMode.SHARED_LINK:
                t = self._t + (self._heap[0][0] - self._v) * self._n / self._bw + self._lat
            else:
                t = self._heap[0][0]
            best = t if best is None else min(best, t)
        return best

    def completions_until(self, t: float) -> list[TransferDone]:
        if self._mode is TransferMode.SHARED_LINK:
            self._advance(t)
        else:
            heap = self._heap
            while heap and heap[0][0] <= t:
                done, tid = heapq.heappop(heap)
                n_bytes, stall = self._sizes.pop(tid)
                self._delivered.append(TransferDone(tid, done, n_bytes, stall))
        out: list[TransferDone] = []
        delivered = self._delivered
        while delivered and delivered[0].at <= t:
            out.append(delivered.popleft())
        return out

    def _advance(self, t: float) -> None:
        heap = self._heap
        while heap and self._n > 0:
            target, tid = heap[0]
            finish = self._t + (target - self._v) * self._n / self._bw
            if finish > t:
                break
            heapq.heappop(heap)
            self._t = finish
            self._v = target
            self._n -= 1
            n_bytes, _ = self._sizes.pop(tid)
            self._delivered.append(TransferDone(tid, finish + self._lat, n_bytes))
        if t > self._t:
            if self._n > 0:
                self._v += (t - self._t) * self._bw / self._n
            self._t = t
