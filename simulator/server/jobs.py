"""What the real-time driver hands back to the HTTP layer for one request: a queue of step emissions.

Invariant: a `JobHandle` receives `Emission`s in step order, through its `sink` (mid-stream tokens, when
one is set and accepts them) or its queue; the last one always comes through the queue with
`finished=True` (with `error` set when the request failed, e.g. a KV load after the lease expired).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Emission", "JobHandle"]


@dataclass(frozen=True, slots=True)
class Emission:
    """The tokens one engine step produced for one request (driver clock)."""

    tokens: int
    at: float
    finished: bool = False
    error: str | None = None


@dataclass(slots=True)
class JobHandle:
    """The HTTP side's view of a request inside the engine."""

    request_id: str
    submitted_at: float
    queue: asyncio.Queue[Emission] = field(default_factory=asyncio.Queue)
    scheduled_at: float | None = None  # start of the first step that computed part of its prompt
    first_token_at: float | None = None
    preemptions: int = 0
    cached_tokens: int = 0
    kv_pinned: bool = False
    # Optional fast path for mid-stream tokens: called by the driver instead of queueing the emission;
    # returns False to decline (the emission is then queued as usual). It must not raise.
    sink: Callable[[Emission], bool] | None = None
    # Optional companion of `sink`: called once a step that samples this request's next token has been
    # computed, before its deadline, so the sink's work at the deadline is little more than the write.
    # It must have no effect the client or the engine can observe. It must not raise.
    prepare: Callable[[], None] | None = None
