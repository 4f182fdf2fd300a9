"""The figures of one concurrency level, from what its batches measured (pure: no I/O, no clocks).

Rule 1: added TTFT is a router's percentile minus the direct path's percentile at the same level, in
        the same run (p50 - p50, p99 - p99), in milliseconds.
Rule 2: router CPU per 1,000 requests is the CPU seconds its process tree used during its own batches,
        divided by the requests it was sent (completed or not), times 1,000; the worker's the same.
Rule 3: a ratio is ours / SGLang's; None (printed "n/a") when either figure is missing or not
        positive (an added latency at or below zero is noise), so a ratio never changes sign or
        divides by noise around zero; the figures themselves are printed beside it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from bench_routers.load import Batch
from loadgen.summary import percentile

__all__ = ["DIRECT", "OURS", "PEER", "TARGETS", "TargetTotals", "format_level", "level_figures", "ratio"]

DIRECT = "direct"
OURS = "gateway"
PEER = "sglang"
#: The targets in the order they are printed.
TARGETS = (DIRECT, OURS, PEER)


@dataclass(slots=True)
class TargetTotals:
    """One target's measurements over every measured batch of a level."""

    batch: Batch = field(default_factory=Batch)
    router_cpu_s: float | None = None
    worker_cpu_s: float | None = None
    wall_s: float = 0.0

    def add(
        self, batch: Batch, *, router_cpu_s: float | None, worker_cpu_s: float | None, wall_s: float
    ) -> None:
        self.batch.extend(batch)
        if router_cpu_s is not None:
            self.router_cpu_s = (self.router_cpu_s or 0.0) + router_cpu_s
        if worker_cpu_s is not None:
            self.worker_cpu_s = (self.worker_cpu_s or 0.0) + worker_cpu_s
        self.wall_s += wall_s


def _ms(values: Sequence[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else round(value * 1000, 3)


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def _per_1k(cpu_s: float | None, requests: int) -> float | None:
    return None if cpu_s is None or requests == 0 else round(cpu_s / requests * 1000, 3)


def ratio(ours: float | None, peer: float | None) -> float | None:
    if ours is None or peer is None or ours <= 0 or peer <= 0:
        return None
    return round(ours / peer, 3)


def level_figures(streams: int, totals: Mapping[str, TargetTotals]) -> dict[str, Any]:
    """The level's figures: per target, and ours over SGLang's (JSON-ready)."""
    direct = totals[DIRECT].batch
    direct_p50, direct_p99 = _ms(direct.ttft_s, 50), _ms(direct.ttft_s, 99)
    targets: dict[str, dict[str, Any]] = {}
    for name in TARGETS:
        t = totals[name]
        sent = len(t.batch.ttft_s) + t.batch.errors
        p50, p99 = _ms(t.batch.ttft_s, 50), _ms(t.batch.ttft_s, 99)
        targets[name] = {
            "requests": sent,
            "errors": t.batch.errors,
            "first_error": t.batch.first_error or None,
            "ttft_p50_ms": p50,
            "ttft_p99_ms": p99,
            "added_ttft_p50_ms": None if name == DIRECT else _minus(p50, direct_p50),
            "added_ttft_p99_ms": None if name == DIRECT else _minus(p99, direct_p99),
            "e2e_p50_ms": _ms(t.batch.e2e_s, 50),
            "router_cpu_s_per_1k": _per_1k(t.router_cpu_s, sent),
            "worker_cpu_s_per_1k": _per_1k(t.worker_cpu_s, sent),
            "wall_s": round(t.wall_s, 3),
        }
    ours, peer = targets[OURS], targets[PEER]
    return {
        "streams": streams,
        "targets": targets,
        "ours_over_sglang": {
            key: ratio(ours[key], peer[key])
            for key in ("added_ttft_p50_ms", "added_ttft_p99_ms", "router_cpu_s_per_1k")
        },
    }


def _cell(value: float | None, width: int, *, signed: bool = False) -> str:
    if value is None:
        return "-".rjust(width)
    return f"{value:+.2f}".rjust(width) if signed else f"{value:.2f}".rjust(width)


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def format_level(level: Mapping[str, Any], rounds: int) -> str:
    """The level as a small text table, milliseconds and CPU seconds per 1,000 requests."""
    targets = level["targets"]
    n = targets[DIRECT]["requests"]
    lines = [
        f"{level['streams']} concurrent streams ({n} requests per target in {rounds} interleaved rounds)",
        "  target    TTFT p50  TTFT p99  added p50  added p99   E2E p50  router CPU s/1k"
        "  worker CPU s/1k  errors",
    ]
    for name in TARGETS:
        f = targets[name]
        lines.append(
            f"  {name:<8}"
            + _cell(f["ttft_p50_ms"], 10)
            + _cell(f["ttft_p99_ms"], 10)
            + _cell(f["added_ttft_p50_ms"], 11, signed=True)
            + _cell(f["added_ttft_p99_ms"], 11, signed=True)
            + _cell(f["e2e_p50_ms"], 10)
            + _cell(f["router_cpu_s_per_1k"], 17)
            + _cell(f["worker_cpu_s_per_1k"], 17)
            + str(f["errors"]).rjust(8)
        )
    r = level["ours_over_sglang"]
    p50, p99, cpu = (_times(r[k]) for k in ("added_ttft_p50_ms", "added_ttft_p99_ms", "router_cpu_s_per_1k"))
    lines.append(f"  ours/SGLang: added TTFT p50 {p50}, p99 {p99}; router CPU per request {cpu}")
    for name in TARGETS:
        if targets[name]["first_error"]:
            lines.append(f"  {name}: {targets[name]['errors']} failed, first: {targets[name]['first_error']}")
    return "\n".join(lines)
