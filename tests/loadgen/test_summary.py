from __future__ import annotations

import pytest

from loadgen.summary import format_summary, percentile, stat, summarize
from table_builder.records import Record


def rec(
    turn: int, ttft: float | None, *, ok: bool = True, path: str = "pd", start: float = 0.0, n_out: int = 10
) -> Record:
    return Record(
        run_id="r",
        shape="1P3D",
        model="m",
        mode="ppd",
        target_qps=1.0,
        workload="w",
        conversation_id="c",
        turn=turn,
        n_in=5,
        n_out=n_out,
        n_ctx=0 if turn == 1 else 20,
        path=path,
        ttft_ms=ttft if ok else None,
        tpot_ms=2.0 if ok else None,
        e2e_ms=1000.0 if ok else None,
        ok=ok,
        error=None if ok else "timeout",
        start_time=start,
    )


def test_percentile_interpolates_like_numpy() -> None:
    assert percentile([], 50) is None
    assert percentile([3.0], 99) == 3.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5
    assert percentile(list(map(float, range(101))), 99) == pytest.approx(99.0)
    assert stat([]).mean is None


def test_summary_splits_turns_and_counts_failures() -> None:
    records = [
        rec(1, 100.0, start=0.0),
        rec(2, 10.0, path="local", start=1.0),
        rec(2, 30.0, path="pd", start=2.0),
        rec(1, None, ok=False, start=3.0),
    ]
    s = summarize(records)
    assert (s.sent, s.ok) == (4, 3)
    assert s.success_rate == 0.75
    assert s.ttft_turn1_ms.mean == 100.0
    assert s.ttft_later_ms.mean == 20.0
    assert s.local_share == 0.5
    assert s.output_tokens == 30
    assert s.span_s == pytest.approx(3.0)  # first start 0, last end 2 + 1 s
    assert s.tokens_per_s == pytest.approx(10.0)
    text = format_summary(s)
    assert "TTFT Turn 2+" in text
    assert "3/4 (75.0%)" in text
    assert "routed local: 50.0%" in text


def test_summary_of_nothing_has_no_figures() -> None:
    s = summarize([])
    assert s.success_rate is None
    assert s.tokens_per_s is None
    assert "success: 0/0 (-)" in format_summary(s)
