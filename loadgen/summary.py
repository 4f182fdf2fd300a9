"""What a load run measured, in the figures the paper reports.

Rule 1: pure; reads ``Record`` values only (so a summary of a live run and of a records file agree).
Rule 2: TTFT is split into Turn 1 and Turn 2+; TPOT, tokens/s and the local share use successful
        requests only; the success rate is completed / sent.
Rule 3: percentiles interpolate linearly between order statistics (numpy's default), and a figure
        with no samples is ``None``, never 0.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from table_builder.records import Record

__all__ = ["RunSummary", "Stat", "format_summary", "percentile", "stat", "summarize"]


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile (0..100) with linear interpolation; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


@dataclass(frozen=True, slots=True)
class Stat:
    n: int
    mean: float | None
    p50: float | None
    p99: float | None


def stat(values: Sequence[float]) -> Stat:
    if not values:
        return Stat(0, None, None, None)
    return Stat(len(values), sum(values) / len(values), percentile(values, 50), percentile(values, 99))


@dataclass(frozen=True, slots=True)
class RunSummary:
    sent: int
    ok: int
    ttft_turn1_ms: Stat
    ttft_later_ms: Stat
    tpot_ms: Stat
    e2e_ms: Stat
    output_tokens: int
    span_s: float
    local_share: float | None

    @property
    def success_rate(self) -> float | None:
        return self.ok / self.sent if self.sent else None

    @property
    def tokens_per_s(self) -> float | None:
        return self.output_tokens / self.span_s if self.span_s > 0 else None


def summarize(records: Sequence[Record]) -> RunSummary:
    """The figures of one run (or any group of records)."""
    good = [r for r in records if r.ok]
    later = [r for r in good if r.turn > 1]
    ends = [r.start_time + (r.e2e_ms or 0.0) / 1000.0 for r in records]
    span = max(ends) - min(r.start_time for r in records) if records else 0.0
    return RunSummary(
        sent=len(records),
        ok=len(good),
        ttft_turn1_ms=stat([r.ttft_ms for r in good if r.turn == 1 and r.ttft_ms is not None]),
        ttft_later_ms=stat([r.ttft_ms for r in later if r.ttft_ms is not None]),
        tpot_ms=stat([r.tpot_ms for r in good if r.tpot_ms is not None]),
        e2e_ms=stat([r.e2e_ms for r in good if r.e2e_ms is not None]),
        output_tokens=sum(r.n_out for r in good),
        span_s=span,
        local_share=(sum(r.path == "local" for r in later) / len(later)) if later else None,
    )


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_summary(s: RunSummary) -> str:
    """A small fixed-width table for a terminal."""
    rows = [
        ("TTFT Turn 1 (ms)", s.ttft_turn1_ms),
        ("TTFT Turn 2+ (ms)", s.ttft_later_ms),
        ("TPOT (ms)", s.tpot_ms),
        ("E2E (ms)", s.e2e_ms),
    ]
    lines = [f"{'metric':<20}{'n':>7}{'mean':>10}{'p50':>10}{'p99':>10}"]
    lines += [f"{name:<20}{st.n:>7}{_ms(st.mean):>10}{_ms(st.p50):>10}{_ms(st.p99):>10}" for name, st in rows]
    rate = s.success_rate
    lines.append(f"success: {s.ok}/{s.sent} ({'-' if rate is None else f'{100 * rate:.1f}%'})")
    tps = s.tokens_per_s
    lines.append(f"output tokens/s: {'-' if tps is None else f'{tps:.1f}'} over {s.span_s:.1f} s")
    if s.local_share is not None:
        lines.append(f"Turn 2+ routed local: {100 * s.local_share:.1f}%")
    return "\n".join(lines)
