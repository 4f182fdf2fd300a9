"""Benchmark of the real-time mode: step timing error of a 1P3D cluster process under streaming load.

This process hosts the cluster (one event loop, uvloop); a separate client process keeps `--streams`
streaming completions open, spread round-robin over the decode workers. Once all streams are open and
a warm-up has passed, for `--seconds` every engine step's lateness (wake-up minus its absolute
deadline) is recorded, and how long after its deadline the step's last token was written (the end of
its delivery pass). Printed: lateness p50/p99/p99.9/max, the last-token delay p50/p99, steps, mean
step length, tokens streamed, and the CPU the cluster process used (its own user+system time / wall
time; the client's CPU is not counted).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import multiprocessing
import statistics
import sys
import time
from dataclasses import dataclass
from multiprocessing.queues import Queue
from multiprocessing.synchronize import Event
from typing import Any, TextIO

import aiohttp
import uvloop

from simulator.core.profile import load_profile
from simulator.core.topology import Topology
from simulator.core.worker_settings import WorkerSettings
from simulator.server.realtime import DEFAULT_SPIN_S, StepTiming
from simulator.server.worker_group import GroupSettings, WorkerGroup

__all__ = ["BenchResult", "add_arguments", "print_result", "run_bench", "run_from_args"]


@dataclass(frozen=True, slots=True)
class BenchResult:
    streams: int
    seconds: float
    steps: int
    mean_step_ms: float
    lateness_p50_ms: float
    lateness_p99_ms: float
    lateness_p999_ms: float
    lateness_max_ms: float
    delivered_p50_ms: float
    delivered_p99_ms: float
    cluster_cpu_share: float
    tokens: int
    tokens_per_s: float
    cpu_us_per_token: float
    spin_us: float

    def as_json(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


async def _client(urls: list[str], streams: int, max_tokens: int, stop: Event) -> int:
    """Keep `streams` streaming completions open until `stop` is set; returns the chunks received."""
    tokens = 0
    body = {"prompt": "Tell me a long story about the sea.", "max_tokens": max_tokens, "ignore_eos": True}
    body |= {"stream": True}
    connector = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=connector, timeout=aiohttp.ClientTimeout(total=None)) as http:

        async def one_stream(i: int) -> None:
            nonlocal tokens
            url = urls[i % len(urls)]
            while not stop.is_set():
                async with http.post(f"{url}/v1/completions", json=body) as response:
                    async for line in response.content:
                        if line.startswith(b"data: {"):
                            tokens += 1
                            if tokens % 64 == 0 and stop.is_set():
                                return

        await asyncio.gather(*(one_stream(i) for i in range(streams)))
    return tokens


def _client_process(urls: list[str], streams: int, max_tokens: int, stop: Event, out: Queue[int]) -> None:
    out.put(uvloop.run(_client(urls, streams, max_tokens, stop)))


async def _wait_for_streams(group: WorkerGroup, streams: int, limit_s: float = 120.0) -> None:
    """Readiness: every stream of the client has reached a decode worker."""
    deadline = time.monotonic() + limit_s
    for _ in range(int(limit_s / 0.05) + 1):
        if sum(w.driver.num_active for w in group.workers) >= streams:
            return
        if time.monotonic() > deadline:
            break
        await asyncio.sleep(0.05)
    raise RuntimeError(f"the client did not open {streams} streams within {limit_s:.0f} s")


def _percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    index = min(len(sorted_values) - 1, int(q * len(sorted_values)))
    return sorted_values[index]


async def run_bench(
    *, streams: int, seconds: float, warmup_s: float, spin_us: float, max_tokens: int = 100_000
) -> BenchResult:
    timing = StepTiming(max_samples=0)  # nothing recorded during warm-up
    base = WorkerSettings(worker_id="W", role="replica")
    settings = GroupSettings(topology=Topology.parse("1P3D"), base_port=0, worker=base, spin_s=spin_us / 1e6)
    group = WorkerGroup(settings, load_profile(), timing=timing)
    await group.start()
    try:
        urls = [w.url for w in group.workers if w.settings.role == "decode"]
        context = multiprocessing.get_context("spawn")
        results: Queue[int] = context.Queue()
        stop = context.Event()
        client = context.Process(
            target=_client_process, args=(urls, streams, max_tokens, stop, results), daemon=True
        )
        client.start()
        try:
            await _wait_for_streams(group, streams)
            await asyncio.sleep(warmup_s)
            timing.max_samples = 10_000_000
            cpu0, wall0 = time.process_time(), time.monotonic()
            steps0 = sum(w.engine.stats().num_steps for w in group.workers)
            await asyncio.sleep(seconds)
            cpu1, wall1 = time.process_time(), time.monotonic()
            steps1 = sum(w.engine.stats().num_steps for w in group.workers)
            timing.max_samples = 0
        finally:
            stop.set()
        loop = asyncio.get_running_loop()
        tokens = await loop.run_in_executor(None, results.get, True, 60)
        await loop.run_in_executor(None, client.join, 30)
        results.close()
    finally:
        await group.stop()
    late = sorted(x * 1e3 for x in timing.lateness)
    delivered = sorted(x * 1e3 for x in timing.delivered)
    steps = steps1 - steps0
    decode_workers = 3
    return BenchResult(
        streams=streams,
        seconds=seconds,
        steps=steps,
        mean_step_ms=(wall1 - wall0) * 1e3 * decode_workers / steps if steps else 0.0,
        lateness_p50_ms=statistics.median(late) if late else 0.0,
        lateness_p99_ms=_percentile(late, 0.99),
        lateness_p999_ms=_percentile(late, 0.999),
        lateness_max_ms=late[-1] if late else 0.0,
        delivered_p50_ms=_percentile(delivered, 0.5),
        delivered_p99_ms=_percentile(delivered, 0.99),
        cluster_cpu_share=(cpu1 - cpu0) / (wall1 - wall0),
        tokens=tokens,
        tokens_per_s=timing.tokens / (wall1 - wall0),
        cpu_us_per_token=(cpu1 - cpu0) * 1e6 / timing.tokens if timing.tokens else 0.0,
        spin_us=spin_us,
    )


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--streams", type=int, default=200, help="concurrent streams over the decode workers")
    p.add_argument("--seconds", type=float, default=20.0, help="measured duration")
    p.add_argument("--warmup", type=float, default=3.0, help="seconds of load before measuring")
    p.add_argument(
        "--spin-us", type=float, default=DEFAULT_SPIN_S * 1e6, help="busy-wait before each deadline (0: none)"
    )
    p.add_argument("--json", action="store_true", help="print one JSON object")


def print_result(result: BenchResult, out: TextIO, *, as_json: bool) -> None:
    if as_json:
        out.write(json.dumps(result.as_json()) + "\n")
        return
    out.write(
        f"1P3D real-time: {result.streams} streams, {result.seconds:.0f} s measured, "
        f"spin {result.spin_us:.0f} us\n"
        f"  steps {result.steps}, mean step {result.mean_step_ms:.2f} ms, tokens streamed {result.tokens}\n"
        f"  step lateness p50 {result.lateness_p50_ms:.3f} ms, p99 {result.lateness_p99_ms:.3f} ms, "
        f"p99.9 {result.lateness_p999_ms:.3f} ms, max {result.lateness_max_ms:.3f} ms\n"
        f"  step's last token written after its deadline p50 {result.delivered_p50_ms:.3f} ms, "
        f"p99 {result.delivered_p99_ms:.3f} ms\n"
        f"  cluster process CPU {100 * result.cluster_cpu_share:.0f}% of one core, "
        f"{result.tokens_per_s:.0f} tokens/s generated, {result.cpu_us_per_token:.1f} us CPU per token\n"
    )


def run_from_args(args: argparse.Namespace) -> int:
    result = uvloop.run(
        run_bench(streams=args.streams, seconds=args.seconds, warmup_s=args.warmup, spin_us=args.spin_us)
    )
    print_result(result, sys.stdout, as_json=args.json)
    return 0
