"""Where the gateway's CPU goes, per request and per relayed chunk: prints figures, asserts nothing.

    python -m benchmarks.gateway_profile [--streams 16] [--requests 2000] [--chunks 1 51] [--top 25]
                                         [--stream-client aiohttp|httptools]

The gateway runs as its own process (`gateway serve`, `local` mode, Turn 2+ of named sessions) in front
of the fixed-pace stand-in of benchmarks/gateway.py (one chunk every --chunk-interval-ms, so each chunk
is its own read on the gateway's side, as from a real decode worker). Two loads differ only in the
chunks per answer (--chunks LOW HIGH); for each:
1. `cpu`: the gateway's CPU seconds from /proc without a profiler: the cost per request at LOW chunks,
   and the marginal cost of one more chunk, (cpu(HIGH) - cpu(LOW)) / (HIGH - LOW) per request.
2. `profile` (the same load again, the gateway under cProfile): its own time (tottime) grouped by where
   it is spent (aiohttp server, aiohttp client, the event loop's C code, each gateway module, ...), per
   request and, between the two loads, per extra chunk. cProfile inflates Python calls against C code;
   read the split, take the absolute figures from `cpu`.
Nothing here is imported by the gateway.
"""

from __future__ import annotations

import argparse
import pstats
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import uvloop

from benchmarks.gateway import _emit, _load, _Proc, _start
from devstack.ready import start_ready

__all__ = ["main", "measure"]

# (substring of the code's file name or of a built-in's name, category); the first that matches wins.
_CATEGORIES: tuple[tuple[str, str], ...] = (
    ("/gateway/", "gateway.{module}"),
    ("prometheus_client", "prometheus_client (metrics)"),
    ("aiohttp/web_protocol", "aiohttp server"),
    ("aiohttp/web_", "aiohttp server"),
    ("aiohttp/http_writer", "aiohttp HTTP writer"),
    ("aiohttp/_http_writer", "aiohttp HTTP writer"),
    ("aiohttp/http_parser", "aiohttp HTTP parser"),
    ("aiohttp/_http_parser", "aiohttp HTTP parser"),
    ("aiohttp/client", "aiohttp client"),
    ("aiohttp/connector", "aiohttp client"),
    ("aiohttp/streams", "aiohttp streams"),
    ("aiohttp/", "aiohttp other"),
    ("httptools", "httptools parser"),
    ("multidict", "multidict/yarl"),
    ("yarl", "multidict/yarl"),
    ("orjson", "json"),
    ("/json/", "json"),
    ("uvloop", "event loop (uvloop, C: epoll, socket I/O)"),
    ("asyncio", "asyncio (Python)"),
    ("quicktok", "tokenizer"),
)


def _category(filename: str, name: str) -> str:
    where = filename if filename != "~" else name
    for needle, label in _CATEGORIES:
        if needle in where:
            return label.format(module=Path(filename).stem)
    return "builtins" if filename == "~" else "other Python"


def _breakdown(profile: str) -> tuple[dict[str, float], list[tuple[float, str]]]:
    # {(file, line, name): (cc, nc, tottime, cumtime, callers)}
    stats: dict[Any, Any] = getattr(pstats.Stats(profile), "stats")  # noqa: B009
    by_cat: dict[str, float] = {}
    funcs: list[tuple[float, str]] = []
    for (filename, line, name), (_, _, tottime, _, _) in stats.items():
        cat = _category(filename, name)
        by_cat[cat] = by_cat.get(cat, 0.0) + tottime
        funcs.append((tottime, f"{Path(filename).name}:{line}({name})" if filename != "~" else name))
    return by_cat, sorted(funcs, reverse=True)


# The gateway under a cProfile that SIGUSR1 turns on and SIGUSR2 off (writing its file), so only the
# measured load is profiled, not start-up (imports, tokenizer files) or shutdown.
_PROFILED = """
import cProfile, signal, sys
from gateway.cli import main
prof = cProfile.Profile()
def dump(*_):
    prof.disable()
    prof.dump_stats(sys.argv[1])
signal.signal(signal.SIGUSR1, lambda *_: prof.enable())
signal.signal(signal.SIGUSR2, dump)
sys.exit(main(sys.argv[2:]))
"""


def _gateway(config: Path, profile: str | None) -> _Proc:
    serve = ["serve", "--config", str(config), "--port", "0", "--log-level", "WARNING"]
    if profile is None:
        return _start(["gateway", *serve])
    proc, ready = start_ready(
        [sys.executable, "-c", _PROFILED, profile, *serve],
        timeout_s=60,
        stderr=subprocess.DEVNULL,
        name="gateway (profiled)",
    )
    return _Proc(proc, ready)


def _stop(proc: _Proc) -> None:
    proc.proc.send_signal(signal.SIGINT)
    proc.proc.wait(timeout=60)
    if proc.proc.stdout is not None:
        proc.proc.stdout.close()


def _one(args: argparse.Namespace, config: Path, chunks: int, profile: str | None) -> tuple[float, int]:
    """The gateway's CPU seconds for the measured requests of `chunks` chunks, and their number."""
    cpu, _, requests = measure(args, config, chunks, profile)
    return cpu, requests


def measure(
    args: argparse.Namespace, config: Path, chunks: int, profile: str | None
) -> tuple[float, float, int]:
    """The gateway's CPU seconds (all, and the kernel's part) for the measured requests of `chunks`
    chunks, and their number."""
    gw = _gateway(config, profile)
    try:
        url = f"http://127.0.0.1:{gw.ready['http']}/v1/chat/completions"
        per_stream = max(1, args.requests // args.streams)
        load = {"streams": args.streams, "chunks": chunks, "warm_turn": True}
        uvloop.run(_load(url, per_stream=1, **load))  # warm-up: connections, caches
        if profile is not None:
            gw.proc.send_signal(signal.SIGUSR1)
        cpu0, sys0 = gw.cpu_seconds(), gw.system_cpu_seconds()
        uvloop.run(_load(url, per_stream=per_stream, **load))
        cpu, sys_cpu = gw.cpu_seconds() - cpu0, gw.system_cpu_seconds() - sys0
        if profile is not None:
            gw.proc.send_signal(signal.SIGUSR2)
            for _ in range(600):
                if Path(profile).exists():
                    break
                time.sleep(0.1)
            time.sleep(0.5)  # written whole
        return cpu, sys_cpu, args.streams * per_stream
    finally:
        _stop(gw)


def _run(args: argparse.Namespace) -> int:
    low, high = args.chunks
    interval = str(args.chunk_interval_ms / 1000.0)
    up = _start(["benchmarks.gateway", "upstream", "--port", "0", "--chunks", "1", "--interval", interval])
    try:
        with tempfile.TemporaryDirectory() as tmp:
            config = Path(tmp) / "gateway.toml"
            url = up.ready["url"]
            config.write_text(
                'mode = "local"\n'
                f'[upstream]\nstream_client = "{args.stream_client}"\n'
                f'[[workers]]\nid = "P0"\nrole = "prefill"\nurl = "{url}"\n'
                f'[[workers]]\nid = "D0"\nrole = "decode"\nurl = "{url}"\n'
            )
            cpu = {n: _one(args, config, n, None) for n in (low, high)}
            per_request = {n: cpu[n][0] / cpu[n][1] for n in cpu}
            extra_chunk = (per_request[high] - per_request[low]) / (high - low)
            _emit(
                {
                    "figure": "cpu",
                    "streams": args.streams,
                    "requests": cpu[low][1],
                    f"us_per_request_{low}_chunks": round(per_request[low] * 1e6, 1),
                    f"us_per_request_{high}_chunks": round(per_request[high] * 1e6, 1),
                    "us_per_extra_chunk": round(
                        (per_request[high] - per_request[low]) / (high - low) * 1e6, 2
                    ),
                    "chunks_per_s_per_core_marginal": round(1 / max(extra_chunk, 1e-12)),
                }
            )
            cats: dict[int, dict[str, float]] = {}
            for n in (low, high):
                path = str(Path(tmp) / f"gateway-{n}.prof")
                _, requests = _one(args, config, n, path)
                by_cat, funcs = _breakdown(path)
                cats[n] = {k: v / requests for k, v in by_cat.items()}
                _emit(
                    {
                        "figure": "profile",
                        "chunks": n,
                        "requests": requests,
                        "us_per_request": {
                            k: round(v * 1e6, 1) for k, v in sorted(cats[n].items(), key=lambda kv: -kv[1])
                        },
                        "top_functions_us_per_request": [
                            [name, round(t / requests * 1e6, 1)] for t, name in funcs[: args.top]
                        ],
                    }
                )
            names = set(cats[low]) | set(cats[high])
            extra = {k: (cats[high].get(k, 0.0) - cats[low].get(k, 0.0)) / (high - low) for k in names}
            _emit(
                {
                    "figure": "profile_per_extra_chunk",
                    "us": {k: round(v * 1e6, 2) for k, v in sorted(extra.items(), key=lambda kv: -kv[1])},
                }
            )
    finally:
        up.stop()
    return 0


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m benchmarks.gateway_profile", description=__doc__.split("\n\n")[0]
    )
    add = parser.add_argument
    add("--streams", type=int, default=16, help="concurrent streams (default 16)")
    add("--requests", type=int, default=2000, help="measured requests per load (default 2000)")
    add("--chunks", type=int, nargs=2, default=[1, 51], metavar=("LOW", "HIGH"), help="chunks per answer")
    add("--chunk-interval-ms", type=float, default=1.0, help="the stand-in's pace between chunks")
    add("--top", type=int, default=25, help="functions listed per profile")
    add(
        "--stream-client",
        choices=("aiohttp", "httptools"),
        default="aiohttp",
        help="the gateway's [upstream] stream_client (benchmarks/stream_client.py runs both)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return _run(_parser().parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
