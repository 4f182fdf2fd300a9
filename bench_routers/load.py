"""The load: streamed chat completions, timed at the first content token and at the end of the stream.

Rule 1: every target gets the very same requests (same body, same max_tokens); a request body differs
        only by its index, so no router can answer from a cache.
Rule 2: TTFT is the time from sending the request to the first SSE chunk whose delta carries text (a
        role-only first chunk does not count); end-to-end is the time to the end of the stream. A
        request counts only if it returned 200, carried a token and ended with `data: [DONE]`.
Rule 3: a batch is `streams` concurrent streams sharing its requests: each stream sends the next one
        as soon as its last one ended, on a connection pool kept for the whole run (as each router
        keeps its own upstream pool).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

import aiohttp
import orjson

__all__ = ["Batch", "LoadSpec", "RequestError", "run_batch", "stream_once"]

_HEADERS = {"Content-Type": "application/json"}
_DONE = b"data: [DONE]"


class RequestError(RuntimeError):
    """A request that did not complete as a streamed chat completion should."""


@dataclass(frozen=True, slots=True)
class LoadSpec:
    model: str
    max_tokens: int
    timeout_s: float

    def body(self, index: int) -> bytes:
        return orjson.dumps(
            {
                "model": self.model,
                "messages": [{"role": "user", "content": f"Benchmark request {index}: say something."}],
                "max_tokens": self.max_tokens,
                # A real model may stop early; the simulator runs to max_tokens anyway.
                "ignore_eos": True,
                "stream": True,
            }
        )


@dataclass(slots=True)
class Batch:
    """What one batch measured on one target: seconds per completed request, and the failures."""

    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    errors: int = 0
    first_error: str = ""

    def extend(self, other: Batch) -> None:
        self.ttft_s += other.ttft_s
        self.e2e_s += other.e2e_s
        if other.errors and not self.first_error:
            self.first_error = other.first_error
        self.errors += other.errors


def _has_token(line: bytes) -> bool:
    if not line.startswith(b"data: {"):
        return False
    try:
        chunk = orjson.loads(line[6:])
    except orjson.JSONDecodeError:
        return False
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        if delta.get("content") or delta.get("reasoning_content"):
            return True
    return False


async def stream_once(
    http: aiohttp.ClientSession, url: str, body: bytes, timeout_s: float
) -> tuple[float, float]:
    """One streamed request: (TTFT, end-to-end) in seconds; RequestError when it did not complete."""
    start = time.perf_counter()
    ttft = -1.0
    done = False
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with http.post(url, data=body, headers=_HEADERS, timeout=timeout) as resp:
            if resp.status != 200:
                raise RequestError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
            async for line in resp.content:
                if ttft < 0 and _has_token(line):
                    ttft = time.perf_counter() - start
                elif line.startswith(_DONE):
                    done = True
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise RequestError(f"{type(exc).__name__}: {exc}") from None
    end = time.perf_counter() - start
    if ttft < 0:
        raise RequestError("the stream carried no token")
    if not done:
        raise RequestError("the stream ended without data: [DONE]")
    return ttft, end


async def run_batch(
    http: aiohttp.ClientSession, url: str, spec: LoadSpec, *, streams: int, per_stream: int, first_index: int
) -> Batch:
    """`streams` concurrent streams sending `streams * per_stream` requests (indices from `first_index`)."""
    batch = Batch()
    indices: Iterator[int] = iter(range(first_index, first_index + streams * per_stream))

    async def stream() -> None:
        for index in indices:  # shared: each stream takes the next index when it is free
            try:
                ttft, e2e = await stream_once(http, url, spec.body(index), spec.timeout_s)
            except RequestError as exc:
                batch.errors += 1
                batch.first_error = batch.first_error or str(exc)
                continue
            batch.ttft_s.append(ttft)
            batch.e2e_s.append(e2e)

    await asyncio.gather(*(stream() for _ in range(streams)))
    return batch
