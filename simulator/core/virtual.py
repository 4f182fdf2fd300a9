"""The discrete-event driver of one engine in virtual time (no HTTP, no clock, no sleeping).

``run_engine(engine, arrivals)`` feeds timed arrivals to an :class:`~simulator.core.engine.Engine` and
steps it exactly as the real-time worker does: a request that arrives while a step runs joins the
next step; a step's tokens are delivered at its end. It returns the step log (the format of
``StepResult.log_entry``) and per-request first-token and finish times, so a test can feed the
same arrivals to the real-time driver and compare the two logs.

Rule: an arrival at time t is added before any step that starts at or after t.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from simulator.core.engine import Engine, EngineRequest, Finished

__all__ = ["RequestTimes", "VirtualRun", "run_engine"]


@dataclass(slots=True)
class RequestTimes:
    arrival: float
    first_token: float | None = None
    finished: float | None = None
    result: Finished | None = None
    token_times: list[float] = field(default_factory=list)


@dataclass(slots=True)
class VirtualRun:
    step_log: list[dict[str, Any]]
    requests: dict[str, RequestTimes]
    end: float


def run_engine(
    engine: Engine,
    arrivals: Iterable[tuple[float, EngineRequest]],
    *,
    record_tokens: bool = False,
    until: float = math.inf,
) -> VirtualRun:
    """Run ``engine`` over ``arrivals`` ((time, request), any order) until idle or ``until``."""
    pending = sorted(arrivals, key=lambda a: a[0])
    times: dict[str, RequestTimes] = {}
    log: list[dict[str, Any]] = []
    i = 0
    now = 0.0 if not pending else pending[0][0]
    while True:
        t_step = engine.next_step_at()
        t_arr = pending[i][0] if i < len(pending) else None
        if t_step is None and t_arr is None:
            break
        if t_arr is not None and (t_step is None or t_arr <= max(now, t_step)):
            now = max(now, t_arr)
            while i < len(pending) and pending[i][0] <= now:
                at, req = pending[i]
                engine.add_request(req, at)
                times[req.request_id] = RequestTimes(arrival=at)
                i += 1
            continue
        assert t_step is not None
        start = max(now, t_step)
        if start > until:
            break
        horizon = pending[i][0] if i < len(pending) else math.inf
        result = engine.step(start, horizon)
        end = result.end
        now = end
        if result.duration > 0 or result.kv_pulls or result.finished:
            log.append(result.log_entry())
        for rid in result.first_tokens:
            times[rid].first_token = end
        if record_tokens:
            for rid in result.sampled:
                times[rid].token_times.append(end)
        for fin in result.finished:
            rt = times[fin.request_id]
            rt.finished = end
            rt.result = fin
        for pull in result.kv_pulls:
            # No remote peer in a single-engine run: the KV is there at once.
            engine.kv_loaded(pull.request_id, end)
    return VirtualRun(step_log=log, requests=times, end=now)
