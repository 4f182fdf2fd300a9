"""The shared session store's added cost per request: prints figures, asserts nothing.

    python -m benchmarks.session_store [--streams 1 200] [--requests-per-stream 20] [--redis-url URL]

Two gateways run side by side in one run, identical but for `[sessions]`: one keeps sessions in its
own memory (the default), the other in Redis (`redis_url`). Both front the same fixed-pace stand-in
decode worker (`python -m benchmarks.gateway upstream`) in `local` mode, and at each concurrency in
--streams the same load goes to one, then the other. Each user holds a content-addressed
conversation (no session header, as behind a round-robin Envoy): every measured turn is Turn 2+,
one session read before the first token and one write before `[DONE]`. `sessions_lost` counts measured
turns the gateway answered as Turn 1, `store_errors` its failed Redis calls (a call slower than
`redis_timeout_s` sends the replica to local memory for a while, and turns whose session was written
to Redis before that start over).

Figures, one JSON object per line:
1. `request` per store and concurrency: the gateway's own time to the first token
   (`ppd_gateway_overhead_seconds`: the handler's time minus the worker's, so the session read is in
   it), p50/p99; the client's TTFT and whole-request time p50/p99 (the write is in the latter).
2. `added`: redis minus memory for each of those, per concurrency.
3. `ops`: one store's get and put, in process, p50/p99 in microseconds (the round trip alone).

Redis is a redis-server of its own on a unix socket (Debian's package; `make redis`), unless
--redis-url names one (a networked Redis adds its round trip to every figure).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import aiohttp
import uvloop

from benchmarks.gateway import MODEL, _emit, _histogram, _pct, _Proc, _quantile, _scrape, _start
from devstack.replicas import answers_ping, redis_argv

__all__ = ["main"]

STORES = ("memory", "redis")


@contextlib.contextmanager
def _redis_server() -> Iterator[str]:
    """A redis-server of our own on a unix socket in a fresh folder; its URL."""
    if shutil.which("redis-server") is None:
        raise SystemExit("redis-server not found: `make redis` installs Debian's package")
    folder = Path(tempfile.mkdtemp(prefix="ppd-bench-redis-"))
    sock = folder / "redis.sock"
    proc = subprocess.Popen(
        redis_argv(sock), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, stdin=subprocess.DEVNULL
    )
    try:
        deadline = time.monotonic() + 30
        while not answers_ping(sock):
            if proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit("redis-server did not start")
            time.sleep(0.05)
        yield f"unix://{sock}"
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        shutil.rmtree(folder, ignore_errors=True)


async def _turn(
    http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]], chunks: int
) -> tuple[float, float, str, str]:
    """One streamed turn: (TTFT, whole request, the answer text, the gateway's X-PPD-Turn)."""
    body = json.dumps({"model": MODEL, "messages": messages, "max_tokens": chunks, "stream": True}).encode()
    start = time.perf_counter()
    ttft = -1.0
    parts: list[str] = []
    async with http.post(url, data=body, headers={"Content-Type": "application/json"}) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        turn = resp.headers.get("X-PPD-Turn", "")
        async for line in resp.content:
            if ttft < 0:
                ttft = time.perf_counter() - start
            if line.startswith(b"data: {"):
                for choice in json.loads(line[6:]).get("choices", []):
                    parts.append(choice.get("delta", {}).get("content") or "")
    return ttft, time.perf_counter() - start, "".join(parts), turn


async def _load(
    url: str, *, streams: int, per_stream: int, chunks: int
) -> tuple[list[float], list[float], int]:
    """`streams` users, each a conversation of one unmeasured turn and `per_stream` measured ones;
    also how many measured turns the gateway answered as Turn 1 (their session not found)."""
    ttfts: list[float] = []
    totals: list[float] = []
    lost = 0
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def user() -> None:
            nonlocal lost
            messages = [{"role": "user", "content": f"benchmark {uuid.uuid4().hex}"}]
            for i in range(per_stream + 1):
                ttft, total, answer, turn = await _turn(http, url, messages, chunks)
                if i and turn == "1":
                    lost += 1
                if i:
                    ttfts.append(ttft)
                    totals.append(total)
                messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": "and then?"},
                ]

        await asyncio.gather(*(user() for _ in range(streams)))
    return ttfts, totals, lost


def _store_errors(base: str) -> float:
    """The gateway's failed shared-store calls so far."""
    prefix = "ppd_gateway_session_store_errors_total{"
    lines = _scrape(base + "/metrics").splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(prefix))


def _ms(value: float | None) -> float | None:
    return round(value * 1000, 3) if value is not None else None


def _request_figures(args: argparse.Namespace, gateways: dict[str, _Proc]) -> None:
    for streams in args.streams:
        row: dict[str, dict[str, Any]] = {}
        for store in STORES:
            base = f"http://127.0.0.1:{gateways[store].ready['http']}"
            before = _histogram(base + "/metrics", "ppd_gateway_overhead_seconds")
            errors = _store_errors(base)
            ttfts, totals, lost = uvloop.run(
                _load(
                    base + "/v1/chat/completions",
                    streams=streams,
                    per_stream=args.requests_per_stream,
                    chunks=args.chunks,
                )
            )
            after = _histogram(base + "/metrics", "ppd_gateway_overhead_seconds")
            ttft_ms = [t * 1000 for t in ttfts]
            total_ms = [t * 1000 for t in totals]
            row[store] = {
                "own_p50_ms": _ms(_quantile(before, after, 0.5)),
                "own_p99_ms": _ms(_quantile(before, after, 0.99)),
                "ttft_p50_ms": round(_pct(ttft_ms, 0.5), 3),
                "ttft_p99_ms": round(_pct(ttft_ms, 0.99), 3),
                "request_p50_ms": round(_pct(total_ms, 0.5), 3),
                "request_p99_ms": round(_pct(total_ms, 0.99), 3),
            }
            _emit(
                {
                    "figure": "request",
                    "store": store,
                    "streams": streams,
                    "requests": len(ttfts),
                    "sessions_lost": lost,
                    "store_errors": _store_errors(base) - errors,
                    **row[store],
                }
            )
        added = {
            key: round(row["redis"][key] - row["memory"][key], 3)
            for key in row["memory"]
            if row["memory"][key] is not None and row["redis"][key] is not None
        }
        _emit({"figure": "added", "streams": streams, **added})


async def _ops(redis_url: str, n: int) -> dict[str, Any]:
    """get and put of one store in process: the round trip and the script alone."""
    from gateway.metrics import GatewayMetrics
    from gateway.redis_sessions import RedisSessionStore
    from gateway.sessions import Session
    from gateway.settings import SessionSettings

    settings = SessionSettings(redis_url=redis_url, redis_prefix=f"bench-{uuid.uuid4().hex}:")
    store = RedisSessionStore.connect(settings, GatewayMetrics(), clock=time.monotonic)
    session = Session("s", worker="D0", turns=3, context_tokens=1500, output_lengths=(64, 80, 72))
    puts: list[float] = []
    gets: list[float] = []
    try:
        for i in range(n):
            start = time.perf_counter()
            await store.put(f"k{i}", session)
            puts.append(time.perf_counter() - start)
            start = time.perf_counter()
            await store.get(f"k{i}")
            gets.append(time.perf_counter() - start)
        if store.degraded:
            raise RuntimeError("the store went degraded during the benchmark")
    finally:
        await store.close()
    us = {name: [x * 1e6 for x in values] for name, values in (("get", gets), ("put", puts))}
    return {
        "figure": "ops",
        "operations": n,
        **{
            f"{name}_{q}_us": round(_pct(values, p), 1)
            for name, values in us.items()
            for q, p in (("p50", 0.5), ("p99", 0.99))
        },
    }


def _gateway(upstream: str, folder: Path, store: str, redis_url: str) -> _Proc:
    config = folder / f"gateway-{store}.toml"
    sessions = f'[sessions]\nredis_url = "{redis_url}"\n' if store == "redis" else ""
    config.write_text(
        'mode = "local"\n'
        f'[[workers]]\nid = "P0"\nrole = "prefill"\nurl = "{upstream}"\n'
        f'[[workers]]\nid = "D0"\nrole = "decode"\nurl = "{upstream}"\n'
        # Generous: on a saturated machine a 3 s connect limit fails requests; this measures cost.
        "[timeouts]\nconnect_s = 60.0\nidle_s = 600.0\n" + sessions
    )
    return _start(["gateway", "serve", "--config", str(config), "--port", "0", "--log-level", "WARNING"])


def _run(args: argparse.Namespace) -> int:
    procs: list[_Proc] = []
    with contextlib.ExitStack() as exits:
        redis_url = args.redis_url or exits.enter_context(_redis_server())
        try:
            upstream = _start(
                ["benchmarks.gateway", "upstream", "--port", "0", "--chunks", str(args.chunks),
                 "--interval", str(args.chunk_interval_ms / 1000.0)]
            )  # fmt: skip
            procs.append(upstream)
            folder = Path(exits.enter_context(tempfile.TemporaryDirectory()))
            gateways = {store: _gateway(upstream.ready["url"], folder, store, redis_url) for store in STORES}
            procs += gateways.values()
            _request_figures(args, gateways)
            _emit(uvloop.run(_ops(redis_url, args.ops)))
        finally:
            for proc in reversed(procs):
                proc.stop()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.session_store", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--streams", type=int, nargs="+", default=[1, 200], help="concurrent conversations (default 1 200)")
    add("--requests-per-stream", type=int, default=20, help="measured turns per conversation (default 20)")
    add("--chunks", type=int, default=20, help="SSE chunks per answer (default 20)")
    add("--chunk-interval-ms", type=float, default=5.0, help="the stand-in's pace between chunks (default 5)")
    add("--ops", type=int, default=2000, help="in-process get/put pairs for the ops figure (default 2000)")
    add("--redis-url", default="", help="measure against this Redis instead of a redis-server of our own")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return _run(_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
