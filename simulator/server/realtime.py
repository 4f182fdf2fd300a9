"""The real-time driver: runs one sans-I/O `Engine` against the wall clock with asyncio.

Invariants:
- Rule 1: absolute deadlines. A step that follows another back to back starts exactly at the previous
  step's end (`result.end`), never at the (late) moment the driver woke up, so timing errors do not
  accumulate; a step after an idle period starts at the moment work arrived.
- Rule 2: a step's tokens are delivered together, right after its deadline, in one pass over
  `result.sampled` / `result.finished`; a request that arrives while a step runs joins the next step
  (the same rule as :func:`simulator.core.virtual.run_engine`, so both produce the same step log).
- Rule 3: only the driver task calls `engine.step`; other coroutines add, abort or complete KV loads
  and then `wake()` it. Everything runs on one event loop, so no locks are needed.

Timing: the step's chunks are rendered right after `engine.step` (`JobHandle.prepare`), before the
deadline; sleep on the event loop until `spin_s` before the deadline, then spin on `time.monotonic()`
(uvloop's timers count whole milliseconds and fire up to ~1.5 ms off: `DEFAULT_SPIN_S`), yielding
to the loop on every turn so that the other drivers of a cluster process (one loop hosts them all) are
not held up by our spin. While it waits, a driver posts its deadline on the loop's `DeadlineBoard`;
the rendering and the delivery pass run in slices of `SLICE_TOKENS` streams and yield one loop turn
between slices when another driver's deadline is due (or due within `LOOKAHEAD_S`), so a deadline
waits for at most about one slice of another driver's work, not for its whole pass. `lateness`
records wake-up minus deadline per step; `delivered` records the end of the step's delivery pass (its
last token) minus the deadline.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from simulator.core.engine import Engine, EngineRequest, Finished, FinishReason, KvPull, StepResult
from simulator.server.background import BackgroundTask
from simulator.server.deadline_board import DeadlineBoard
from simulator.server.jobs import Emission, JobHandle

__all__ = ["DEFAULT_SPIN_S", "LOOKAHEAD_S", "SLICE_TOKENS", "RealtimeDriver", "StepTiming"]

logger = logging.getLogger(__name__)

# Busy-wait before a deadline. uvloop counts timers in whole milliseconds (the delay is rounded and
# the loop's clock floored, then the poll sleeps whole ms), so a timer fires up to ~1.5 ms after or
# before the requested time; a spin shorter than that leaves the timer's error in the step timing.
DEFAULT_SPIN_S = 0.0015
# Streams rendered or written between two looks at the deadline board (~8 us each on loopback TCP).
SLICE_TOKENS = 8
# Yield to another driver whose deadline falls within this much of now (about one slice of writes).
LOOKAHEAD_S = 50e-6

PullHandler = Callable[[KvPull, float], None]
StepObserver = Callable[[StepResult], None]


@dataclass(slots=True)
class StepTiming:
    """Per-step lateness (seconds) and an optional copy of the step log, for benchmarks and tests."""

    lateness: list[float] = field(default_factory=list)
    # Per recorded step: its deadline to the end of its delivery pass (the last token written straight
    # to a socket, or queued for its handler), i.e. the timing error of the step's last token.
    delivered: list[float] = field(default_factory=list)
    log: list[dict[str, Any]] = field(default_factory=list)
    record_log: bool = False
    max_samples: int = 1_000_000
    tokens: int = 0  # tokens delivered while lateness is being recorded


class RealtimeDriver:
    """Owns one engine and the handles of its requests; `run()` is its task."""

    def __init__(
        self,
        engine: Engine,
        *,
        spin_s: float = DEFAULT_SPIN_S,
        clock: Callable[[], float] = time.monotonic,
        on_pull: PullHandler | None = None,
        on_step: StepObserver | None = None,
        timing: StepTiming | None = None,
        board: DeadlineBoard | None = None,
    ) -> None:
        self.engine = engine
        self._board = board if board is not None else DeadlineBoard()
        self._spin = spin_s
        self._clock = clock
        self._on_pull = on_pull
        self._on_step = on_step
        self.timing = timing or StepTiming()
        self._handles: dict[str, JobHandle] = {}
        self._wake = asyncio.Event()
        self._task = BackgroundTask(self.run, "realtime-driver")
        self.dead = False

    # ------------------------------------------------------------------ control
    def now(self) -> float:
        return self._clock()

    def start(self) -> None:
        self._task.start()

    async def stop(self) -> None:
        await self._task.stop()
        for handle in self._handles.values():
            handle.queue.put_nowait(Emission(tokens=0, at=self.now(), finished=True, error="engine stopped"))
        self._handles.clear()

    def wake(self) -> None:
        self._wake.set()

    @property
    def num_active(self) -> int:
        return len(self._handles)

    @property
    def num_direct(self) -> int:
        """Active requests whose mid-stream tokens are written straight to the socket (`JobHandle.sink`)."""
        return sum(1 for handle in self._handles.values() if handle.sink is not None)

    # ------------------------------------------------------------------ requests
    def submit(self, request: EngineRequest, handle: JobHandle) -> None:
        """Queue a request now; its emissions arrive on `handle.queue` (at once an error if `dead`)."""
        if self.dead:
            handle.queue.put_nowait(Emission(tokens=0, at=self.now(), finished=True, error="engine dead"))
            return
        self.engine.add_request(request, self.now())
        self._handles[request.request_id] = handle
        self.wake()

    def abort(self, request_id: str) -> None:
        if self._handles.pop(request_id, None) is not None:
            self.engine.abort(request_id, self.now())
            self.wake()

    def kv_loaded(self, request_id: str, at: float, stall_s: float = 0.0) -> None:
        if self.engine.kv_loaded(request_id, at, stall_s):
            self.wake()

    def kv_recompute(self, request_id: str, at: float) -> None:
        """The pull failed; the engine computes the prompt locally (`kv_load_failure_policy=recompute`)."""
        if self.engine.kv_recompute(request_id, at):
            self.wake()

    def kv_failed(self, request_id: str, at: float, message: str) -> None:
        if self.engine.kv_failed(request_id, at) is None:
            return
        handle = self._handles.pop(request_id, None)
        if handle is not None:
            handle.queue.put_nowait(Emission(tokens=0, at=at, finished=True, error=message))
        self.wake()

    # ------------------------------------------------------------------ the loop
    async def _sleep_until(self, deadline: float) -> float:
        self._board.post(self, deadline)
        try:
            delay = deadline - self._clock() - self._spin
            if delay > 0:
                await asyncio.sleep(delay)
            now = self._clock()
            while now < deadline:
                await asyncio.sleep(0)  # spin through the loop: another driver's deadline may fall in ours
                now = self._clock()
        finally:
            self._board.clear(self)
        return now

    async def _wait_for_work(self, limit_s: float | None) -> None:
        if self._wake.is_set():
            return
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._wake.wait(), limit_s)

    async def run(self) -> None:
        """The driver task. If the engine raises, the driver is dead (`dead` is set, every request
        fails with an error emission, new ones are refused) instead of leaving requests hanging."""
        try:
            await self._run()
        except asyncio.CancelledError:
            raise
        except Exception:
            logger.exception("engine failed; this worker stops serving generation requests")
            self.dead = True
            for handle in self._handles.values():
                handle.queue.put_nowait(Emission(tokens=0, at=self.now(), finished=True, error="engine dead"))
            self._handles.clear()

    async def _run(self) -> None:
        engine = self.engine
        continuing = False  # the previous step ended at its deadline and more work was due then
        while True:
            self._wake.clear()
            due = engine.next_step_at()
            now = self._clock()
            if due is None:
                continuing = False
                await self._wait_for_work(None)
                continue
            if due > now:
                # Idle until a lease expires (or until new work wakes us).
                continuing = False
                await self._wait_for_work(due - now)
                continue
            start = due if continuing else max(due, now)
            result = engine.step(start)
            recorded = False
            if result.duration > 0:
                await self._prepare(result)
                woke = await self._sleep_until(result.end)
                timing = self.timing
                if len(timing.lateness) < timing.max_samples:
                    timing.lateness.append(woke - result.end)
                    timing.tokens += len(result.sampled)
                    recorded = True
                continuing = True
            else:
                continuing = False
            await self._deliver(result)
            if recorded:
                self.timing.delivered.append(self._clock() - result.end)
            await asyncio.sleep(0)  # let handlers write this step's tokens before the next step

    async def _prepare(self, result: StepResult) -> None:
        """Before the deadline: let the sinks render this step's tokens, so that the pass at the deadline
        (which delays any other driver of this event loop whose deadline falls in it) is mostly writes."""
        handles = self._handles
        done = {f.request_id for f in result.finished} if result.finished else ()
        board, clock = self._board, self._clock
        left = SLICE_TOKENS
        for rid in result.sampled:
            left -= 1
            if not left:
                left = SLICE_TOKENS
                if board.due(self, clock() + LOOKAHEAD_S):
                    await asyncio.sleep(0)  # another driver's deadline: let it wake (Rule: board)
            handle = handles.get(rid)
            if handle is not None and handle.prepare is not None and rid not in done:
                handle.prepare()

    async def _deliver(self, result: StepResult) -> None:
        end = result.end
        self._record(result)
        handles = self._handles
        done = {f.request_id: f for f in result.finished}
        mid_stream = Emission(tokens=1, at=end)  # frozen: one value for every unfinished stream
        board, clock = self._board, self._clock
        left = SLICE_TOKENS
        for rid in result.sampled:
            left -= 1
            if not left:
                left = SLICE_TOKENS
                if board.due(self, clock() + LOOKAHEAD_S):
                    # Another driver's deadline came during our pass: let it wake now rather than after
                    # the whole pass. Handlers may abort our requests meanwhile, hence `handles.get`.
                    await asyncio.sleep(0)
            handle = handles.get(rid)
            if handle is None:
                continue
            fin = done.pop(rid, None)
            if handle.first_token_at is None:
                handle.first_token_at = end
            if fin is None:
                if handle.sink is not None and handle.sink(mid_stream):
                    continue  # written straight to the client's socket
                handle.queue.put_nowait(mid_stream)
                continue
            del handles[rid]
            handle.cached_tokens = fin.num_cached_tokens
            handle.kv_pinned = fin.kv_pinned
            error = "KV load failed" if fin.reason is FinishReason.ERROR else None
            handle.queue.put_nowait(Emission(tokens=1, at=end, finished=True, error=error))
        self._deliver_tokenless(done, end)
        for rid in result.preempted:
            handle = handles.get(rid)
            if handle is not None:
                handle.preemptions += 1
        if result.kv_pulls and self._on_pull is not None:
            for pull in result.kv_pulls:
                self._on_pull(pull, end)

    def _record(self, result: StepResult) -> None:
        """The step's log entry, observer and first-scheduled marks (before any token goes out)."""
        timing = self.timing
        if timing.record_log and (result.duration > 0 or result.kv_pulls or result.finished):
            timing.log.append(result.log_entry())
        if self._on_step is not None:
            self._on_step(result)
        if result.n_steps > 1:
            raise RuntimeError("the real-time driver runs without fast-forward")
        for chunk in result.prefills:
            handle = self._handles.get(chunk.request_id)
            if handle is not None and handle.scheduled_at is None:
                handle.scheduled_at = result.start

    def _deliver_tokenless(self, done: dict[str, Finished], end: float) -> None:
        """Requests that finished without a token in this step (an aborted or failed one)."""
        for rid, fin in done.items():
            handle = self._handles.pop(rid, None)
            if handle is not None:
                error = "KV load failed" if fin.reason is FinishReason.ERROR else None
                handle.queue.put_nowait(Emission(tokens=0, at=end, finished=True, error=error))
