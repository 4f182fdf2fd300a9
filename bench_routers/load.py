"""The load: two-turn conversations of streamed chat completions, timed at the first content token and
at the end of the stream.

Rule 1: every target gets the very same requests (same body, same max_tokens); a conversation's body
        differs only by its index, so no router can answer from a cache. Turn 1 is the conversation's
        first user message; turn 2 is that message, the answer turn 1 received (its text exactly as
        streamed) and a second user message, so a router that keeps sessions finds the conversation
        and the decode worker that holds its history.
Rule 2: TTFT is the time from sending the request to the first SSE chunk whose delta carries text (a
        role-only first chunk does not count); end-to-end is the time to the end of the stream. A
        request counts only if it returned 200, carried a token and ended with `data: [DONE]`. Every
        `data:` line is a relayed chunk ([DONE] included).
Rule 3: the direct path of a Turn 1 is vLLM's P/D protocol done by the client itself, as the thinnest
        proxy would (docs/vllm-protocol.md): P with `kv_transfer_params` {do_remote_decode: true},
        `max_tokens` 1, not streamed; then D streamed with the params P returned, both with one
        `X-Request-Id`. Its TTFT runs from the P request to D's first token.
Rule 4: a batch is `streams` concurrent streams sharing its conversations: each stream sends the next
        one as soon as its last one ended, on a connection pool kept for the whole run (as each router
        keeps its own upstream pool).
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import orjson

__all__ = [
    "Batch",
    "Conversation",
    "DirectPD",
    "LoadSpec",
    "Post",
    "RequestError",
    "Result",
    "Sender",
    "run_batch",
    "stream_once",
]

_HEADERS = {"Content-Type": "application/json"}
_DONE = b"data: [DONE]"
_PATH_HEADER = "X-PPD-Path"
_P_PARAMS = {
    "do_remote_decode": True,
    "do_remote_prefill": False,
    "remote_engine_id": None,
    "remote_block_ids": None,
    "remote_host": None,
    "remote_port": None,
}


class RequestError(RuntimeError):
    """A request that did not complete as a streamed chat completion should."""


@dataclass(slots=True)
class Conversation:
    """One conversation: its index and, once turn 1 completed, the answer it received."""

    index: int
    answer: str | None = None


@dataclass(frozen=True, slots=True)
class LoadSpec:
    model: str
    max_tokens: int
    timeout_s: float

    def body(self, conversation: Conversation, turn: int) -> dict[str, Any]:
        """Rule 1: turn 1's or turn 2's body (turn 2 needs turn 1's answer)."""
        messages: list[dict[str, str]] = [
            {"role": "user", "content": f"Benchmark conversation {conversation.index}: say something."}
        ]
        if turn == 2:
            if conversation.answer is None:
                raise RequestError("turn 2 of a conversation whose turn 1 failed")
            messages += [
                {"role": "assistant", "content": conversation.answer},
                {"role": "user", "content": "Go on."},
            ]
        return {
            "model": self.model,
            "messages": messages,
            "max_tokens": self.max_tokens,
            # A real model may stop early; the simulator runs to max_tokens anyway.
            "ignore_eos": True,
            "stream": True,
        }


@dataclass(frozen=True, slots=True)
class Result:
    ttft_s: float
    e2e_s: float
    text: str
    chunks: int
    # The router's X-PPD-Path header ("pd", "local", ...); "" when it sends none.
    path: str


def _token(line: bytes) -> str:
    if not line.startswith(b"data: {"):
        return ""
    try:
        chunk = orjson.loads(line[6:])
    except orjson.JSONDecodeError:
        return ""
    text = ""
    for choice in chunk.get("choices") or ():
        delta = choice.get("delta") or {}
        text += delta.get("content") or delta.get("reasoning_content") or ""
    return text


async def stream_once(
    http: aiohttp.ClientSession,
    url: str,
    body: dict[str, Any],
    timeout_s: float,
    *,
    request_id: str = "",
    start: float | None = None,
) -> Result:
    """One streamed request (Rule 2); RequestError when it did not complete. `start` (perf_counter)
    when the clock started earlier (the direct P/D path's P leg)."""
    begin = time.perf_counter() if start is None else start
    ttft = -1.0
    done = False
    chunks = 0
    parts: list[str] = []
    headers = _HEADERS | ({"X-Request-Id": request_id} if request_id else {})
    timeout = aiohttp.ClientTimeout(total=timeout_s)
    try:
        async with http.post(url, data=orjson.dumps(body), headers=headers, timeout=timeout) as resp:
            if resp.status != 200:
                raise RequestError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
            path = resp.headers.get(_PATH_HEADER, "")
            async for line in resp.content:
                if not line.startswith(b"data:"):
                    continue
                chunks += 1
                if line.startswith(_DONE):
                    done = True
                    continue
                text = _token(line)
                if text:
                    parts.append(text)
                    if ttft < 0:
                        ttft = time.perf_counter() - begin
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise RequestError(f"{type(exc).__name__}: {exc}") from None
    end = time.perf_counter() - begin
    if ttft < 0:
        raise RequestError("the stream carried no token")
    if not done:
        raise RequestError("the stream ended without data: [DONE]")
    return Result(ttft, end, "".join(parts), chunks, path)


class Sender(Protocol):
    """How one target is sent one request."""

    async def send(
        self, http: aiohttp.ClientSession, body: dict[str, Any], timeout_s: float, request_id: str
    ) -> Result: ...


@dataclass(frozen=True, slots=True)
class Post:
    """A streamed POST to one chat URL (a router, or a worker directly)."""

    url: str

    async def send(
        self, http: aiohttp.ClientSession, body: dict[str, Any], timeout_s: float, request_id: str
    ) -> Result:
        return await stream_once(http, self.url, body, timeout_s, request_id=request_id)


@dataclass(frozen=True, slots=True)
class DirectPD:
    """Rule 3: vLLM's P/D protocol done by the client: P's leg, then D's stream with P's params."""

    prefill_url: str
    decode_url: str

    async def send(
        self, http: aiohttp.ClientSession, body: dict[str, Any], timeout_s: float, request_id: str
    ) -> Result:
        start = time.perf_counter()
        p_body = body | {"stream": False, "max_tokens": 1, "kv_transfer_params": _P_PARAMS}
        headers = _HEADERS | {"X-Request-Id": request_id}
        try:
            async with http.post(
                self.prefill_url,
                data=orjson.dumps(p_body),
                headers=headers,
                timeout=aiohttp.ClientTimeout(total=timeout_s),
            ) as resp:
                raw = await resp.read()
                if resp.status != 200:
                    raise RequestError(f"P leg: HTTP {resp.status}: {raw[:200]!r}")
        except (aiohttp.ClientError, TimeoutError) as exc:
            raise RequestError(f"P leg: {type(exc).__name__}: {exc}") from None
        params = orjson.loads(raw).get("kv_transfer_params")
        if not isinstance(params, dict):
            raise RequestError("P leg: the answer carried no kv_transfer_params")
        d_body = body | {"kv_transfer_params": params}
        remaining = max(0.001, timeout_s - (time.perf_counter() - start))
        return await stream_once(http, self.decode_url, d_body, remaining, request_id=request_id, start=start)


@dataclass(slots=True)
class Batch:
    """What one batch measured on one target: seconds per completed request, chunks, the paths the
    router reported, and the failures."""

    ttft_s: list[float] = field(default_factory=list)
    e2e_s: list[float] = field(default_factory=list)
    chunks: int = 0
    paths: Counter[str] = field(default_factory=Counter)
    errors: int = 0
    first_error: str = ""

    @property
    def sent(self) -> int:
        return len(self.ttft_s) + self.errors

    def add(self, result: Result) -> None:
        self.ttft_s.append(result.ttft_s)
        self.e2e_s.append(result.e2e_s)
        self.chunks += result.chunks
        if result.path:
            self.paths[result.path] += 1

    def fail(self, error: str) -> None:
        self.errors += 1
        self.first_error = self.first_error or error

    def extend(self, other: Batch) -> None:
        self.ttft_s += other.ttft_s
        self.e2e_s += other.e2e_s
        self.chunks += other.chunks
        self.paths.update(other.paths)
        if other.errors and not self.first_error:
            self.first_error = other.first_error
        self.errors += other.errors


async def run_batch(
    http: aiohttp.ClientSession,
    sender: Sender,
    spec: LoadSpec,
    conversations: Sequence[Conversation],
    *,
    turn: int,
    streams: int,
    tag: str,
) -> Batch:
    """Rule 4: `streams` concurrent streams sending turn `turn` of each conversation; turn 1 stores
    each answer in its conversation. `tag` makes the request ids unique (target and round)."""
    batch = Batch()
    pending: Iterator[Conversation] = iter(conversations)

    async def stream() -> None:
        for conversation in pending:  # shared: each stream takes the next conversation when it is free
            try:
                result = await sender.send(
                    http,
                    spec.body(conversation, turn),
                    spec.timeout_s,
                    f"bench-{tag}-{conversation.index}-{turn}",
                )
            except RequestError as exc:
                batch.fail(str(exc))
                continue
            if turn == 1:
                conversation.answer = result.text
            batch.add(result)

    await asyncio.gather(*(stream() for _ in range(streams)))
    return batch
