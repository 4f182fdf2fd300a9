"""The experiment sections' shared pieces: Markdown tables, mean, nearest-rank P99, milliseconds."""

from __future__ import annotations

from loadgen.report.section import md_table, mean, ms, p99


def test_md_table_mean_p99_and_ms() -> None:
    assert md_table(["a", "b"], [["1", "2"]]) == ["| a | b |", "|---|---|", "| 1 | 2 |", ""]
    assert mean([]) is None
    assert mean([1.0, 2.0]) == 1.5
    assert p99([]) is None
    assert p99([float(i) for i in range(1, 101)]) == 99.0
    assert p99([float(i) for i in range(1, 201)]) == 198.0
    assert p99([5.0]) == 5.0
    assert ms(None) == "-"
    assert ms(1.234) == "1.2"
