"""Gateway overhead benchmark: prints figures, asserts nothing.

    python -m benchmarks.gateway run [--streams 50 200] [--requests-per-stream 20] [--chunks 100] ...
    python -m benchmarks.gateway upstream --port 0      (the fixed-pace SSE worker it measures against)

What it measures, each printed as one JSON object per line:
1. `ttft`: added time to first token in `local` mode (Turn 2+ of a session) versus calling the decode
   worker directly, at each concurrency in --streams: p50/p99 of both and of the difference.
   The upstream is a fixed-pace stand-in for a decode worker (first chunk at once, then one chunk every
   --chunk-interval-ms), so the difference is the gateway's own cost, not a model's noise.
   `--upstream sim` uses the simulator's workers instead (real vLLM wire format, noisier timing).
2. `relay`: chunks relayed per second per gateway CPU core (CPU time read from /proc for the gateway
   process during the runs above).
3. `memory`: gateway RSS before and after --proxied requests, and an in-process session store's RSS
   growth with --sessions sessions created and expired against its entry bound.

Every server runs as its own process on 127.0.0.1 port 0; nothing here is imported by the gateway.
One module (about 480 lines) because the upstream it measures against is started as
`python -m benchmarks.gateway upstream`: the stand-in and its driver are one command line.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
from aiohttp import web

from devstack.ready import start_ready

__all__ = ["main", "stub_worker_app"]

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


# ---------------------------------------------------------------------------- the upstream


def _upstream_app(chunks: int, interval_s: float) -> web.Application:
    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or chunks)
        if not body.get("stream"):
            kv = None
            if isinstance(body.get("kv_transfer_params"), dict):
                kv = {"do_remote_prefill": True, "remote_engine_id": "bench", "remote_block_ids": [[0]]}
            return web.json_response(
                {
                    "id": "x",
                    "object": "chat.completion",
                    "choices": [{"index": 0, "message": {"role": "assistant", "content": "w " * n}}],
                    "usage": {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n},
                    "kv_transfer_params": kv,
                }
            )
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        head = b'data: {"id":"x","object":"chat.completion.chunk","choices":[{"index":0,"delta":{"content":"'
        for i in range(n):
            await resp.write(head + f"w{i} ".encode() + b'"},"finish_reason":null}]}\n\n')
            if interval_s and i + 1 < n:
                await asyncio.sleep(interval_s)
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 10, "completion_tokens": n, "total_tokens": 10 + n}
            await resp.write(
                b"data: " + json.dumps({"id": "x", "choices": [], "usage": usage}).encode() + b"\n\n"
            )
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return stub_worker_app(complete)


def stub_worker_app(
    complete: Callable[[web.Request], Awaitable[web.StreamResponse]],
) -> web.Application:
    """A stand-in worker: `complete` answers chat completions; `/health` and `/metrics` answer empty,
    `/v1/models` vLLM's card (the gateway checks every request against max_model_len)."""

    async def ok(request: web.Request) -> web.StreamResponse:
        return web.Response(text="")

    async def models(request: web.Request) -> web.StreamResponse:
        return web.json_response({"object": "list", "data": [{"id": MODEL, "max_model_len": 131072}]})

    app = web.Application()
    app.router.add_post("/v1/chat/completions", complete)
    app.router.add_get("/health", ok)
    app.router.add_get("/metrics", ok)
    app.router.add_get("/v1/models", models)
    return app


async def _serve_upstream(port: int, chunks: int, interval_s: float) -> None:
    runner = web.AppRunner(_upstream_app(chunks, interval_s), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port, backlog=4096)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []
    sys.stdout.write(json.dumps({"url": f"http://127.0.0.1:{sockets[0].getsockname()[1]}"}) + "\n")
    sys.stdout.flush()
    await asyncio.Event().wait()


# ---------------------------------------------------------------------------- processes


@dataclass
class _Proc:
    proc: subprocess.Popen[str]
    ready: dict[str, Any]

    def cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def system_cpu_seconds(self) -> float:
        """The kernel's share of cpu_seconds (system calls, the TCP stack)."""
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return int(fields[12]) / os.sysconf("SC_CLK_TCK")

    def rss_mib(self) -> float:
        for line in Path(f"/proc/{self.proc.pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _start(args: Sequence[str], *, env: dict[str, str] | None = None) -> _Proc:
    """``python -m args`` started and ready (its ready line read); `env` replaces the environment."""
    proc, ready = start_ready(
        [sys.executable, "-m", *args], timeout_s=60, stderr=subprocess.DEVNULL, name=" ".join(args), env=env
    )
    return _Proc(proc, ready)


# ---------------------------------------------------------------------------- load


def _pct(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _stream(
    http: aiohttp.ClientSession, url: str, body: bytes, headers: dict[str, str], *, later_turn: bool = False
) -> float:
    start = time.perf_counter()
    ttft = -1.0
    async with http.post(url, data=body, headers=headers) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        if later_turn and resp.headers.get("X-PPD-Turn") == "1":  # only the gateway sends the header
            raise RuntimeError("a measured request was Turn 1 at the gateway: its session was not continued")
        async for _ in resp.content.iter_any():
            if ttft < 0:
                ttft = time.perf_counter() - start
    return ttft


async def _load(
    url: str, *, streams: int, per_stream: int, chunks: int, warm_turn: bool
) -> tuple[list[float], float]:
    """`streams` concurrent users, each sending `per_stream` streaming requests one after another.
    With `warm_turn`, each user first sends one unmeasured turn so later ones are Turn 2+."""
    connector = aiohttp.TCPConnector(limit=0)
    ttfts: list[float] = []
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def user() -> None:
            sid = uuid.uuid4().hex
            headers = {"Content-Type": "application/json", "X-Session-ID": sid}
            # A real conversation: each turn's history extends the last (the gateway checks that a named
            # session's history does), the stand-in's answer standing in as the assistant message.
            messages = [{"role": "user", "content": "benchmark turn"}]

            def body() -> bytes:
                return json.dumps(
                    {"model": MODEL, "messages": messages, "max_tokens": chunks, "stream": True}
                ).encode()

            def answered() -> None:
                messages.extend(
                    [
                        {"role": "assistant", "content": "answer"},
                        {"role": "user", "content": "benchmark turn"},
                    ]
                )

            if warm_turn:
                await _stream(http, url, body(), headers)
                answered()
            for _ in range(per_stream):
                ttfts.append(await _stream(http, url, body(), headers, later_turn=warm_turn))
                answered()

        start = time.perf_counter()
        await asyncio.gather(*(user() for _ in range(streams)))
        elapsed = time.perf_counter() - start
    return ttfts, elapsed


async def _proxied(url: str, total: int, concurrency: int) -> None:
    connector = aiohttp.TCPConnector(limit=0)
    queue = iter(range(total))
    async with aiohttp.ClientSession(connector=connector) as http:

        async def worker() -> None:
            for _ in queue:
                sid = uuid.uuid4().hex  # a new conversation each time: the session store fills up
                body = json.dumps(
                    {
                        "model": MODEL,
                        "messages": [{"role": "user", "content": sid}],
                        "max_tokens": 2,
                        "stream": True,
                    }
                ).encode()
                await _stream(http, url, body, {"Content-Type": "application/json"})

        await asyncio.gather(*(worker() for _ in range(concurrency)))


def _session_store_memory(sessions: int, bound: int) -> dict[str, Any]:
    from gateway.sessions import InMemorySessionStore, Session, content_key

    def rss() -> float:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
        return 0.0

    now = [0.0]
    # TTL longer than the run: the entry bound, not expiry, is what holds memory while they are made.
    store = InMemorySessionStore(ttl_s=3600.0, max_entries=bound, clock=lambda: now[0])
    gc.collect()
    before = rss()
    peak = before
    for i in range(sessions):
        now[0] += 0.001
        key = content_key(
            MODEL, [{"role": "user", "content": f"conversation {i}"}, {"role": "assistant", "content": "x"}]
        )
        store.put_now(key, Session(uuid.uuid4().hex, "D0", 1, 300, (64,)))
        if i % 50_000 == 0:
            peak = max(peak, rss())
            store.expire_now()
    peak = max(peak, rss())
    full = len(store)
    now[0] += 7200
    store.expire_now()
    gc.collect()
    return {
        "sessions_created": sessions,
        "entry_bound": bound,
        "entries_at_peak": full,
        "evicted_by_bound": store.evicted,
        "rss_before_mib": round(before, 1),
        "rss_peak_mib": round(peak, 1),
        "rss_after_expiry_mib": round(rss(), 1),
        "bytes_per_entry": round((peak - before) * 1024 * 1024 / max(full, 1)),
        "entries_after_expiry": len(store),
    }


# ---------------------------------------------------------------------------- run


def _emit(obj: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def _scrape(url: str) -> str:
    """One scrape of a Prometheus /metrics page, its text."""

    async def fetch() -> str:
        async with aiohttp.ClientSession() as http, http.get(url) as resp:
            return await resp.text()

    return uvloop.run(fetch())


def _histogram(url: str, name: str) -> dict[float, float]:
    """Cumulative bucket counts of one Prometheus histogram (all label sets summed)."""
    counts: dict[float, float] = {}
    for line in _scrape(url).splitlines():
        if line.startswith(name + "_bucket{"):
            le = line.split('le="', 1)[1].split('"', 1)[0]
            bound = float("inf") if le == "+Inf" else float(le)
            counts[bound] = counts.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return counts


def _quantile(before: dict[float, float], after: dict[float, float], q: float) -> float | None:
    """Quantile of the observations between two scrapes, interpolated inside its bucket."""
    bounds = sorted(after)
    counts = [after[b] - before.get(b, 0.0) for b in bounds]
    total = counts[-1] if counts else 0.0
    if total <= 0:
        return None
    rank = q * total
    lower_bound, lower_count = 0.0, 0.0
    for bound, count in zip(bounds, counts, strict=True):
        if count >= rank:
            if bound == float("inf"):
                return lower_bound
            span = count - lower_count
            return lower_bound + (bound - lower_bound) * ((rank - lower_count) / span if span else 1.0)
        lower_bound, lower_count = bound, count
    return bounds[-1]


def _pin(proc: _Proc, cpus: set[int] | None) -> None:
    if cpus:
        os.sched_setaffinity(proc.proc.pid, cpus)


def _start_upstreams(args: argparse.Namespace) -> tuple[list[_Proc], str, str]:
    if args.upstream == "sim":
        p = _start(["simulator", "worker", "--role", "prefill", "--port", "0", "--id", "P0"])
        d = _start(["simulator", "worker", "--role", "decode", "--port", "0", "--id", "D0"])
        return [p, d], p.ready["url"], d.ready["url"]
    interval = str(args.chunk_interval_ms / 1000.0)
    up = _start(
        [
            "benchmarks.gateway",
            "upstream",
            "--port",
            "0",
            "--chunks",
            str(args.chunks),
            "--interval",
            interval,
        ]
    )
    return [up], up.ready["url"], up.ready["url"]


def _run(args: argparse.Namespace) -> int:
    gateway_cpus = set(args.gateway_cpus) if args.gateway_cpus else None
    other_cpus = set(range(os.cpu_count() or 1)) - (gateway_cpus or set()) or None
    if other_cpus and gateway_cpus:
        os.sched_setaffinity(0, other_cpus)
    procs: list[_Proc] = []
    try:
        upstreams, p_url, d_url = _start_upstreams(args)
        procs += upstreams
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "gateway.toml"
            config.write_text(
                'mode = "local"\n'
                f'[[workers]]\nid = "P0"\nrole = "prefill"\nurl = "{p_url}"\n'
                f'[[workers]]\nid = "D0"\nrole = "decode"\nurl = "{d_url}"\n'
                f"[sessions]\nmax_entries = {args.session_bound}\n"
            )
            gw = _start(
                ["gateway", "serve", "--config", str(config), "--port", "0", "--log-level", "WARNING"]
            )
            procs.append(gw)
            _pin(gw, gateway_cpus)
            _measure(args, gw, d_url)
        _emit({"figure": "memory_sessions", **_session_store_memory(args.sessions, args.session_bound)})
    finally:
        for proc in reversed(procs):
            proc.stop()
    return 0


def _measure(args: argparse.Namespace, gw: _Proc, d_url: str) -> None:
    base = f"http://127.0.0.1:{gw.ready['http']}"
    gw_url = base + "/v1/chat/completions"
    direct_url = f"{d_url}/v1/chat/completions"
    chunks_relayed = 0
    cpu_used = 0.0
    load = {"per_stream": args.requests_per_stream, "chunks": args.chunks, "warm_turn": True}
    for streams in args.streams:
        direct, _ = uvloop.run(_load(direct_url, streams=streams, **load))
        cpu0 = gw.cpu_seconds()
        hist0 = _histogram(base + "/metrics", "ppd_gateway_overhead_seconds")
        via, elapsed = uvloop.run(_load(gw_url, streams=streams, **load))
        cpu = gw.cpu_seconds() - cpu0
        hist1 = _histogram(base + "/metrics", "ppd_gateway_overhead_seconds")
        chunks_relayed += streams * (args.requests_per_stream + 1) * args.chunks
        cpu_used += cpu
        ms = [x * 1000 for x in direct]
        mg = [x * 1000 for x in via]
        own = {q: _quantile(hist0, hist1, q) for q in (0.5, 0.99)}
        _emit(
            {
                "figure": "ttft",
                "mode": "local",
                "upstream": args.upstream,
                "cpus": os.cpu_count(),
                "gateway_cpus": sorted(args.gateway_cpus or []),
                "streams": streams,
                "requests": len(via),
                "direct_p50_ms": round(_pct(ms, 0.5), 3),
                "direct_p99_ms": round(_pct(ms, 0.99), 3),
                "gateway_p50_ms": round(_pct(mg, 0.5), 3),
                "gateway_p99_ms": round(_pct(mg, 0.99), 3),
                "added_p50_ms": round(_pct(mg, 0.5) - _pct(ms, 0.5), 3),
                "added_p99_ms": round(_pct(mg, 0.99) - _pct(ms, 0.99), 3),
                "added_mean_ms": round(statistics.fmean(mg) - statistics.fmean(ms), 3),
                "gateway_own_p50_ms": round(own[0.5] * 1000, 3) if own[0.5] is not None else None,
                "gateway_own_p99_ms": round(own[0.99] * 1000, 3) if own[0.99] is not None else None,
                "gateway_cpu_s": round(cpu, 2),
                "gateway_cpu_share": round(cpu / elapsed, 2),
                "wall_s": round(elapsed, 2),
            }
        )
    _emit(
        {
            "figure": "relay",
            "chunks_relayed": chunks_relayed,
            "gateway_cpu_s": round(cpu_used, 2),
            "chunks_per_s_per_core": round(chunks_relayed / cpu_used) if cpu_used else None,
        }
    )
    rss0 = gw.rss_mib()
    uvloop.run(_proxied(gw_url, args.proxied, concurrency=min(64, args.proxied)))
    _emit(
        {
            "figure": "memory_proxied",
            "proxied_requests": args.proxied,
            "session_bound": args.session_bound,
            "gateway_rss_before_mib": round(rss0, 1),
            "gateway_rss_after_mib": round(gw.rss_mib(), 1),
        }
    )


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gateway", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the benchmark and print figures (JSON lines)")
    add = run.add_argument
    add("--streams", type=int, nargs="+", default=[50, 200], help="concurrent streams (default 50 200)")
    add("--requests-per-stream", type=int, default=20, help="measured requests per stream")
    add("--chunks", type=int, default=100, help="SSE chunks per response (default 100)")
    add("--chunk-interval-ms", type=float, default=10.0, help="upstream pace between chunks")
    add("--upstream", choices=["echo", "sim"], default="echo", help="fixed-pace stand-in or simulator")
    add("--proxied", type=int, default=100_000, help="requests for the RSS figure (default 100000)")
    add("--sessions", type=int, default=1_000_000, help="sessions for the store RSS figure")
    add("--session-bound", type=int, default=200_000, help="sessions.max_entries (default 200000)")
    add("--gateway-cpus", type=int, nargs="*", help="pin the gateway to these CPUs, everything else off them")
    up = sub.add_parser("upstream", help="serve the fixed-pace SSE stand-in for a decode worker")
    up.add_argument("--port", type=int, default=0)
    up.add_argument("--chunks", type=int, default=100)
    up.add_argument("--interval", type=float, default=0.01, help="seconds between chunks")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "upstream":
        with contextlib.suppress(KeyboardInterrupt):
            uvloop.run(_serve_upstream(args.port, args.chunks, args.interval))
        return 0
    return _run(args)


if __name__ == "__main__":
    raise SystemExit(main())
