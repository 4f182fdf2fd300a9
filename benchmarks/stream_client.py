"""The gateway's streaming leg on aiohttp vs on asyncio Protocols + httptools, side by side: prints
figures, asserts nothing.

    python -m benchmarks.stream_client [--rounds 3] [--streams 16] [--requests 800] [--chunks 1 51]

One fixed-pace stand-in worker (benchmarks/gateway.py, one chunk every --chunk-interval-ms so each
chunk is its own read) and, per round, one gateway process per `[upstream] stream_client` (the order
alternates between rounds), each run twice, with answers of LOW and HIGH chunks (`local` mode, Turn 2+
of named sessions, as benchmarks/gateway_profile.py). From the gateway's CPU seconds (/proc, not wall
clock) it prints per client and round, then the median over rounds and the ratio httptools/aiohttp:
- `us_per_extra_chunk`: (cpu(HIGH) - cpu(LOW)) / (HIGH - LOW) per request: one relayed chunk's CPU;
- `chunks_per_cpu_s`: its inverse, relayed chunks per CPU-second (per core) at the margin;
- `cpu_s_per_1000_requests_{LOW,HIGH}_chunks`: CPU seconds per 1,000 streamed requests.
Nothing here is imported by the gateway.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.gateway import _emit, _start
from benchmarks.gateway_profile import _one

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


def _figures(low: int, high: int, cpu: dict[int, tuple[float, int]]) -> dict[str, Any]:
    per_request = {n: cpu[n][0] / cpu[n][1] for n in (low, high)}
    extra = (per_request[high] - per_request[low]) / (high - low)
    return {
        "requests": cpu[low][1],
        "us_per_extra_chunk": round(extra * 1e6, 2),
        "chunks_per_cpu_s": round(1 / extra) if extra > 0 else None,
        f"cpu_s_per_1000_requests_{low}_chunks": round(per_request[low] * 1000, 3),
        f"cpu_s_per_1000_requests_{high}_chunks": round(per_request[high] * 1000, 3),
    }


def _median(values: list[Any]) -> Any:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


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
                    cpu = {n: _one(args, configs[client], n, None) for n in (low, high)}
                    row = _figures(low, high, cpu)
                    rows[client].append(row)
                    _emit({"figure": "round", "round": r, "stream_client": client, **row})
    finally:
        up.stop()
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
