"""The figures of one cell (an answer length at a concurrency) and of the whole run, from what the
batches measured (pure: no I/O, no clocks).

Rule 1: added TTFT is a router's percentile minus the direct path's percentile in the same cell and
        turn, in the same run (p50 - p50, p99 - p99), in milliseconds.
Rule 2: router CPU per 1,000 requests is the CPU seconds of every process of the router (targets.py
        rule 3), summed, during its own batches, divided by the requests it was sent (completed or
        not), times 1,000; each process's share and the worker's the same way.
Rule 3: relayed chunks per CPU-second are the SSE chunks the client received through the target
        divided by the router's CPU seconds in the same batches; for Envoy (either config), also by
        Envoy's own (the data plane's) CPU seconds. The issue's goal for the data plane is >= 60,000.
Rule 4: a ratio is a / b; None (printed "n/a") when either figure is missing or not positive (an
        added latency at or below zero is noise), so a ratio never changes sign or divides by noise
        around zero; the figures themselves are printed beside it.
Rule 5: a turn's figures name only the targets measured on it (SGLang's Turn 1 is not vLLM P/D:
        targets.py). Run-wide figures (per answer length) add up CPU and requests over the levels.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from bench_routers.load import Batch
from bench_routers.targets import DIRECT, ENVOY, ENVOY_GIE, OURS, PEER, TARGETS
from loadgen.summary import percentile

__all__ = [
    "CHUNKS_GOAL",
    "TURNS",
    "TargetTotals",
    "cell_figures",
    "format_cell",
    "format_summary",
    "ratio",
    "summary",
]

#: The turns measured: Turn 1 (through P, "pd") and Turn 2 (on the session's D, "local").
TURNS: Final = ("pd", "local")
#: The issue's goal for Envoy: relayed chunks per CPU-second of the data plane.
CHUNKS_GOAL: Final = 60_000
_RATIOS: Final = ((ENVOY, OURS), (ENVOY_GIE, ENVOY), (OURS, PEER), (ENVOY, PEER))


@dataclass(slots=True)
class TargetTotals:
    """One target's measurements over every measured batch of one turn of a cell."""

    batch: Batch = field(default_factory=Batch)
    cpu_s: dict[str, float] = field(default_factory=dict)  # by process role
    worker_cpu_s: float | None = None
    wall_s: float = 0.0

    def add(
        self, batch: Batch, *, cpu_s: Mapping[str, float], worker_cpu_s: float | None, wall_s: float
    ) -> None:
        self.batch.extend(batch)
        for role, seconds in cpu_s.items():
            self.cpu_s[role] = self.cpu_s.get(role, 0.0) + seconds
        if worker_cpu_s is not None:
            self.worker_cpu_s = (self.worker_cpu_s or 0.0) + worker_cpu_s
        self.wall_s += wall_s

    @property
    def router_cpu_s(self) -> float | None:
        return sum(self.cpu_s.values()) if self.cpu_s else None


def _ms(values: Sequence[float], q: float) -> float | None:
    value = percentile(values, q)
    return None if value is None else round(value * 1000, 3)


def _minus(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None else round(a - b, 3)


def _per_1k(cpu_s: float | None, requests: int) -> float | None:
    return None if cpu_s is None or requests == 0 else round(cpu_s / requests * 1000, 3)


def _per_cpu_s(chunks: int, cpu_s: float | None) -> float | None:
    return None if cpu_s is None or cpu_s <= 0 else round(chunks / cpu_s)


def ratio(a: float | None, b: float | None) -> float | None:
    if a is None or b is None or a <= 0 or b <= 0:
        return None
    return round(a / b, 3)


def _target(t: TargetTotals, *, data_plane: str, direct: Mapping[str, float | None]) -> dict[str, Any]:
    sent = t.batch.sent
    p50, p99 = _ms(t.batch.ttft_s, 50), _ms(t.batch.ttft_s, 99)
    plane_cpu = t.cpu_s.get(data_plane) if data_plane else None
    return {
        "requests": sent,
        "errors": t.batch.errors,
        "first_error": t.batch.first_error or None,
        "paths": dict(sorted(t.batch.paths.items())),
        "ttft_p50_ms": p50,
        "ttft_p99_ms": p99,
        "added_ttft_p50_ms": _minus(p50, direct.get("p50")) if direct else None,
        "added_ttft_p99_ms": _minus(p99, direct.get("p99")) if direct else None,
        "e2e_p50_ms": _ms(t.batch.e2e_s, 50),
        "chunks": t.batch.chunks,
        "router_cpu_s": None if t.router_cpu_s is None else round(t.router_cpu_s, 4),
        "router_cpu_s_per_1k": _per_1k(t.router_cpu_s, sent),
        "router_cpu_s_per_1k_by_process": {role: _per_1k(s, sent) for role, s in sorted(t.cpu_s.items())},
        "worker_cpu_s_per_1k": _per_1k(t.worker_cpu_s, sent),
        "chunks_per_router_cpu_s": _per_cpu_s(t.batch.chunks, t.router_cpu_s),
        "data_plane_cpu_s": None if plane_cpu is None else round(plane_cpu, 4),
        "data_plane_chunks_per_cpu_s": _per_cpu_s(t.batch.chunks, plane_cpu),
        "wall_s": round(t.wall_s, 3),
    }


def _turn_figures(totals: Mapping[str, TargetTotals], data_planes: Mapping[str, str]) -> dict[str, Any]:
    direct = totals[DIRECT].batch
    base = {"p50": _ms(direct.ttft_s, 50), "p99": _ms(direct.ttft_s, 99)}
    targets = {
        name: _target(
            totals[name], data_plane=data_planes.get(name, ""), direct={} if name == DIRECT else base
        )
        for name in TARGETS
        if name in totals
    }
    ratios: dict[str, dict[str, float | None]] = {}
    for a, b in _RATIOS:
        if a in targets and b in targets:
            ratios[f"{a}_over_{b}"] = {
                key: ratio(targets[a][key], targets[b][key])
                for key in ("added_ttft_p50_ms", "added_ttft_p99_ms", "router_cpu_s_per_1k")
            }
    return {"targets": targets, "ratios": ratios}


def cell_figures(
    max_tokens: int,
    streams: int,
    totals: Mapping[str, Mapping[str, TargetTotals]],
    data_planes: Mapping[str, str],
) -> dict[str, Any]:
    """One cell's figures (JSON-ready): per turn, per target measured on it (rule 5), and the ratios.
    `totals` is by turn, then by target; `data_planes` names each target's data-plane process."""
    return {
        "max_tokens": max_tokens,
        "streams": streams,
        "turns": {turn: _turn_figures(totals[turn], data_planes) for turn in TURNS if turn in totals},
    }


def summary(cells: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Rule 5: per answer length, per turn, per router: CPU seconds per 1,000 requests over every
    level; Envoy's over the standalone's; and the data plane's relayed chunks per CPU-second."""
    cpu: defaultdict[tuple[int, str, str], float] = defaultdict(float)
    sent: Counter[tuple[int, str, str]] = Counter()
    plane_cpu: defaultdict[tuple[str, int], float] = defaultdict(float)
    plane_chunks: Counter[tuple[str, int]] = Counter()
    for cell in cells:
        length = int(cell["max_tokens"])
        for turn, figures in cell["turns"].items():
            for name, f in figures["targets"].items():
                if f["router_cpu_s"] is not None:
                    cpu[length, turn, name] += f["router_cpu_s"]
                    sent[length, turn, name] += f["requests"]
                if f["data_plane_cpu_s"] is not None:
                    plane_cpu[name, length] += f["data_plane_cpu_s"]
                    plane_chunks[name, length] += f["chunks"]
    lengths = sorted({length for length, _, _ in sent})
    per_1k = {
        str(length): {
            turn: {
                name: _per_1k(cpu[length, turn, name], sent[length, turn, name])
                for name in TARGETS
                if sent[length, turn, name]
            }
            for turn in TURNS
        }
        for length in lengths
    }
    planes: dict[str, dict[str, float | None]] = {}  # by target, then answer length
    for name, length in sorted(plane_cpu, key=lambda key: (TARGETS.index(key[0]), key[1])):
        planes.setdefault(name, {})[str(length)] = _per_cpu_s(
            plane_chunks[name, length], plane_cpu[name, length]
        )
    envoy_over_gateway = {
        length: {turn: ratio(by_turn[turn].get(ENVOY), by_turn[turn].get(OURS)) for turn in TURNS}
        for length, by_turn in per_1k.items()
    }
    return {
        "router_cpu_s_per_1k": per_1k,
        "envoy_over_gateway_cpu": envoy_over_gateway,
        "data_plane_chunks_per_cpu_s": planes,
        "data_plane_chunks_goal": CHUNKS_GOAL,
    }


def _cell(value: float | None, width: int, *, signed: bool = False) -> str:
    if value is None:
        return "-".rjust(width)
    return f"{value:+.2f}".rjust(width) if signed else f"{value:.2f}".rjust(width)


def _times(value: float | None) -> str:
    return "n/a" if value is None else f"{value:.2f}x"


def _count(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


_TURN_TITLES: Final = {"pd": "Turn 1 (pd: through P)", "local": "Turn 2 (local: the session's D)"}


def format_cell(cell: Mapping[str, Any], rounds: int) -> str:
    """The cell as small text tables, one per turn: milliseconds and CPU seconds per 1,000 requests."""
    lines = [f"{cell['max_tokens']}-token answers, {cell['streams']} concurrent streams ({rounds} rounds)"]
    for turn, figures in cell["turns"].items():
        targets = figures["targets"]
        lines += [
            f"  {_TURN_TITLES[turn]}, {targets[DIRECT]['requests']} requests per target",
            "    target    TTFT p50  TTFT p99  added p50  added p99   E2E p50  router CPU s/1k"
            "  worker CPU s/1k  chunks/CPU-s  errors",
        ]
        for name, f in targets.items():
            lines.append(
                f"    {name:<9}"
                + _cell(f["ttft_p50_ms"], 10)
                + _cell(f["ttft_p99_ms"], 10)
                + _cell(f["added_ttft_p50_ms"], 11, signed=True)
                + _cell(f["added_ttft_p99_ms"], 11, signed=True)
                + _cell(f["e2e_p50_ms"], 10)
                + _cell(f["router_cpu_s_per_1k"], 17)
                + _cell(f["worker_cpu_s_per_1k"], 17)
                + _count(f["chunks_per_router_cpu_s"]).rjust(14)
                + str(f["errors"]).rjust(8)
            )
        for key, r in figures["ratios"].items():
            a, b = key.split("_over_")
            p50, p99, cpu = (
                _times(r[k]) for k in ("added_ttft_p50_ms", "added_ttft_p99_ms", "router_cpu_s_per_1k")
            )
            lines.append(f"    {a}/{b}: added TTFT p50 {p50}, p99 {p99}; router CPU per request {cpu}")
        for name, f in targets.items():
            if f["first_error"]:
                lines.append(f"    {name}: {f['errors']} failed, first: {f['first_error']}")
    return "\n".join(lines)


def format_summary(cells: Sequence[Mapping[str, Any]], totals: Mapping[str, Any]) -> str:
    """The run's figures the issue asks for: added TTFT p50/p99 per router per level, router CPU per
    1,000 requests per answer length, Envoy/standalone CPU, the data plane's chunks per CPU-second."""
    levels = sorted({int(cell["streams"]) for cell in cells})
    lines = ["Added TTFT over direct, p50/p99 ms, by concurrent streams: " + " ".join(map(str, levels))]
    for turn in TURNS:
        lines.append(f"  {_TURN_TITLES[turn]}")
        for length in sorted({int(cell["max_tokens"]) for cell in cells}):
            for name in TARGETS[1:]:
                row = []
                for streams in levels:
                    cell = next(
                        (c for c in cells if c["max_tokens"] == length and c["streams"] == streams), None
                    )
                    figures = cell["turns"].get(turn) if cell else None
                    f = figures["targets"].get(name) if figures else None
                    row.append(
                        "-"
                        if f is None
                        else f"{_cell(f['added_ttft_p50_ms'], 0, signed=True)}/"
                        f"{_cell(f['added_ttft_p99_ms'], 0, signed=True)}"
                    )
                if any(cell != "-" for cell in row):
                    lines.append(f"    {length:>4} tokens  {name:<9} " + "  ".join(x.rjust(15) for x in row))
    lines.append("Router CPU seconds per 1,000 streamed requests (every process of the router), all levels")
    for length, by_turn in totals["router_cpu_s_per_1k"].items():
        for turn in TURNS:
            shown = ", ".join(f"{name} {_cell(x, 0)}" for name, x in by_turn[turn].items() if x is not None)
            ratio_text = _times(totals["envoy_over_gateway_cpu"][length][turn])
            lines.append(f"  {length:>4} tokens, {turn:<5}: {shown}; envoy/gateway {ratio_text}")
    goal = totals["data_plane_chunks_goal"]
    for name, by_length in totals["data_plane_chunks_per_cpu_s"].items():
        shown = ", ".join(f"{_count(value)} at {length} tokens" for length, value in by_length.items())
        lines.append(f"Envoy's own CPU ({name}): relayed chunks per CPU-second {shown} (goal >= {goal:,})")
    return "\n".join(lines)
