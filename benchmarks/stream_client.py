"""The gateway's streaming leg on aiohttp vs on asyncio Protocols + httptools, side by side: prints
figures, asserts nothing.

    python -m benchmarks.stream_client [--rounds 3] [--streams 16] [--requests 800] [--chunks 1 51]

One fixed-pace stand-in worker (benchmarks/gateway.py, one chunk every --chunk-interval-ms so each
chunk is its own read) and, per round, one gateway process per `[upstream] stream_client` (the order
alternates between rounds), each run twice, with answers of LOW and HIGH chunks (`local` mode, Turn 2+
of named sessions, as benchmarks/gateway_profile.py). From the gateway's CPU seconds (/proc, not wall
clock) it prints per client and round, then the median over rounds and the ratio httptools/aiohttp:
- `us_per_extra_chunk`: (cpu(HIGH) - cpu(LOW)) / (HIGH - LOW) per request: one relayed chunk's CPU;
  `us_per_extra_chunk_kernel` its system-time part (system calls and the loopback TCP stack);
- `chunks_per_cpu_s`: its inverse, relayed chunks per CPU-second (per core) at the margin;
- `cpu_s_per_1000_requests_{LOW,HIGH}_chunks`: CPU seconds per 1,000 streamed requests.
Then the split of one relayed chunk, in this process (getrusage CPU, not wall clock):
- `read_only`: the same streams read through each client alone (`HttpUpstream`,
  `ProtocolStreamUpstream`: open, read every chunk, close; no relay, no client), CPU per extra chunk;
- `read_floor_us`: the same streams read by a Protocol that only counts the bytes (no parser, no
  task woken per chunk): the event loop's and the kernel's part of receiving a chunk, the floor;
- `relay_feed_us`: `StreamRelay.feed` on one of the stand-in's chunks (the fast path);
- the rest of a relayed chunk (gateway figure minus both): writing it to the client through aiohttp's
  server, the relay task's wake-up, the loop.
Nothing here is imported by the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import resource
import statistics
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvloop

from benchmarks.gateway import MODEL, _emit, _start
from benchmarks.gateway_profile import measure
from gateway.plan import UpstreamCall
from gateway.ports import Upstream
from gateway.relay import StreamRelay
from gateway.settings import TimeoutSettings
from gateway.stream_upstream import ProtocolStreamUpstream
from gateway.upstream import HttpUpstream, dumps

__all__ = ["main"]

CLIENTS = ("aiohttp", "httptools")


def _config(path: Path, url: str, client: str) -> Path:
    path.write_text(
        'mode = "local"\n'
        f'[upstream]\nstream_client = "{client}"\n'
        f'[[workers]]\nid = "P0"\nrole = "prefill"\nurl = "{url}"\n'
        f'[[workers]]\nid = "D0"\nrole = "decode"\nurl = "{url}"\n'
    )
    return path


def _figures(low: int, high: int, cpu: dict[int, tuple[float, float, int]]) -> dict[str, Any]:
    per_request = {n: cpu[n][0] / cpu[n][2] for n in (low, high)}
    kernel = {n: cpu[n][1] / cpu[n][2] for n in (low, high)}
    extra = (per_request[high] - per_request[low]) / (high - low)
    return {
        "requests": cpu[low][2],
        "us_per_extra_chunk": round(extra * 1e6, 2),
        "us_per_extra_chunk_kernel": round((kernel[high] - kernel[low]) / (high - low) * 1e6, 2),
        "chunks_per_cpu_s": round(1 / extra) if extra > 0 else None,
        f"cpu_s_per_1000_requests_{low}_chunks": round(per_request[low] * 1000, 3),
        f"cpu_s_per_1000_requests_{high}_chunks": round(per_request[high] * 1000, 3),
    }


def _median(values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _process_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


class _Counter(asyncio.Protocol):
    """The floor of reading a stream: bytes counted in data_received, no parser, no task woken per
    chunk (one future per answer, done at the chunked body's last bytes)."""

    def __init__(self) -> None:
        self.transport: asyncio.Transport | None = None
        self.done: asyncio.Future[None] | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]

    def data_received(self, data: bytes) -> None:
        if data.endswith(b"0\r\n\r\n") and self.done is not None and not self.done.done():
            self.done.set_result(None)


async def _read_floor(url: str, streams: int, requests: int, chunks: int) -> float:
    """This process's CPU seconds per request, as `_read_only` but through `_Counter`."""
    host, port = url.removeprefix("http://").split(":")
    body = dumps(
        {"model": MODEL, "messages": [{"role": "user", "content": "x"}], "max_tokens": chunks, "stream": True}
    )
    request = (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n\r\n"
    ).encode() + body
    loop = asyncio.get_running_loop()

    async def user(n: int, conn: _Counter) -> None:
        assert conn.transport is not None
        for _ in range(n):
            conn.done = loop.create_future()
            conn.transport.write(request)
            await conn.done

    conns = [(await loop.create_connection(_Counter, host, int(port)))[1] for _ in range(streams)]
    try:
        await asyncio.gather(*(user(1, c) for c in conns))
        per_stream = max(1, requests // streams)
        cpu0 = _process_cpu()
        await asyncio.gather(*(user(per_stream, c) for c in conns))
        return (_process_cpu() - cpu0) / (per_stream * streams)
    finally:
        for c in conns:
            if c.transport is not None:
                c.transport.close()


async def _read_only(url: str, client: str, streams: int, requests: int, chunks: int) -> float:
    """This process's CPU seconds per request, reading `requests` streams of `chunks` chunks from the
    stand-in through `client` alone, `streams` at a time."""
    base = HttpUpstream.create(TimeoutSettings())
    up: Upstream = base if client == "aiohttp" else ProtocolStreamUpstream(base, TimeoutSettings())
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "x"}],
        "max_tokens": chunks,
        "stream": True,
    }
    call = UpstreamCall("D0", url + "/v1/chat/completions", body, (("X-Request-Id", "bench"),), True)

    async def user(n: int) -> None:
        for _ in range(n):
            stream = await up.open_stream(call)
            try:
                async for _ in stream.chunks():
                    pass
            finally:
                stream.close()

    try:
        await asyncio.gather(*(user(1) for _ in range(streams)))  # warm-up: connections
        per_stream = max(1, requests // streams)
        cpu0 = _process_cpu()
        await asyncio.gather(*(user(per_stream) for _ in range(streams)))
        return (_process_cpu() - cpu0) / (per_stream * streams)
    finally:
        await up.close()


def _relay_feed_us(reps: int = 50_000) -> float:
    chunk = (  # what the stand-in sends (benchmarks/gateway.py)
        b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":'
        b'{"content":"w7 "},"finish_reason":null}]}\n\n'
    )
    relay = StreamRelay(strip_usage=True)
    start = time.process_time()
    for _ in range(reps):
        relay.feed(chunk)
    return (time.process_time() - start) / reps * 1e6


def _run(args: argparse.Namespace) -> int:
    low, high = args.chunks
    interval = str(args.chunk_interval_ms / 1000.0)
    up = _start(["benchmarks.gateway", "upstream", "--port", "0", "--chunks", "1", "--interval", interval])
    rows: dict[str, list[dict[str, Any]]] = {c: [] for c in CLIENTS}
    try:
        with tempfile.TemporaryDirectory() as tmp:
            configs = {c: _config(Path(tmp) / f"{c}.toml", up.ready["url"], c) for c in CLIENTS}
            for r in range(args.rounds):
                for client in CLIENTS if r % 2 == 0 else tuple(reversed(CLIENTS)):
                    cpu = {n: measure(args, configs[client], n, None) for n in (low, high)}
                    row = _figures(low, high, cpu)
                    rows[client].append(row)
                    _emit({"figure": "round", "round": r, "stream_client": client, **row})
        reads: dict[str, list[float]] = {c: [] for c in CLIENTS}
        floors: list[float] = []
        for r in range(args.rounds):
            for client in CLIENTS if r % 2 == 0 else tuple(reversed(CLIENTS)):
                cpu_low, cpu_high = (
                    uvloop.run(_read_only(up.ready["url"], client, args.streams, args.requests, n))
                    for n in (low, high)
                )
                reads[client].append((cpu_high - cpu_low) / (high - low) * 1e6)
            floor_low, floor_high = (
                uvloop.run(_read_floor(up.ready["url"], args.streams, args.requests, n)) for n in (low, high)
            )
            floors.append((floor_high - floor_low) / (high - low) * 1e6)
    finally:
        up.stop()
    relay_us = _relay_feed_us()
    medians = {c: {k: _median([row[k] for row in rows[c]]) for k in rows[c][0]} for c in CLIENTS}
    for client in CLIENTS:
        _emit({"figure": "median", "stream_client": client, "rounds": args.rounds, **medians[client]})
    base, new = medians["aiohttp"], medians["httptools"]
    _emit(
        {
            "figure": "ratio_httptools_over_aiohttp",
            **{
                k: round(new[k] / base[k], 3) if base[k] and new[k] else None for k in base if k != "requests"
            },
        }
    )
    split: dict[str, Any] = {
        "relay_feed_us": round(relay_us, 2),
        "read_floor_us": round(statistics.median(floors), 2),
    }
    for client in CLIENTS:
        read_us = statistics.median(reads[client])
        total = medians[client]["us_per_extra_chunk"]
        split[client] = {
            "us_per_extra_chunk": total,
            "read_only_us": round(read_us, 2),
            "relay_feed_us": round(relay_us, 2),
            "rest_us": round(total - read_us - relay_us, 2) if total is not None else None,
        }
    _emit({"figure": "split_per_extra_chunk", **split})
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.stream_client", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--rounds", type=int, default=3, help="rounds, each runs both clients (default 3)")
    add("--streams", type=int, default=16, help="concurrent streams (default 16)")
    add("--requests", type=int, default=800, help="measured requests per load (default 800)")
    add("--chunks", type=int, nargs=2, default=[1, 51], metavar=("LOW", "HIGH"), help="chunks per answer")
    add("--chunk-interval-ms", type=float, default=1.0, help="the stand-in's pace between chunks")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return _run(_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
