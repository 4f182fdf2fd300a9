"""Refreshing a table from request logs: the merge by sample counts, what counts as evidence, the load
level of production lines, drift beyond the bound, no flip below the sample minimum, determinism."""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from decision_service.header import FIGURES, Figure
from decision_service.route import Router
from decision_service.table import Table
from ppd.records import CLIENT_DISCONNECTED, worker_status_error
from table_builder.aggregate import CellKey
from table_builder.build import axes_locator, default_header
from table_builder.records import Record
from table_builder.refresh import EVIDENCE_MODES, RefreshResult, refresh_table
from table_builder.refresh_report import z_for
from tests.support.records import base_records, base_table, logged, make_record

HEADER = default_header("1P3D", "llama-3.1-8b")
AXES = HEADER.axes
CELL = (0, 6, 2)  # small / mid_paste / 2 QPS: make_record's cell
LABEL = "small/mid_paste@2"


def figures(result: RefreshResult, cell: tuple[int, int, int] = CELL) -> dict[str, float]:
    table = Table.from_bytes(result.encode())
    return dict(zip(FIGURES, (float(x) for x in table.figures[cell]), strict=True))


def refresh(
    base: Table,
    records: list[Record],
    *,
    min_samples: int = 1,
    confidence: float = 0.99,
    interference: bool = False,
) -> RefreshResult:
    return refresh_table(
        base, records, min_samples=min_samples, confidence=confidence, interference=interference
    )


# --- the merge -------------------------------------------------------------------------------------


def test_logged_figures_merge_into_the_base_weighted_by_sample_counts() -> None:
    base = base_table()  # local: 4 requests, mean TTFT 40
    result = refresh(base, logged("local", 4, ttft=70.0, tpot=13.0))
    got = figures(result)
    assert got["local_ttft_ms"] == pytest.approx((4 * 40.0 + 4 * 70.0) / 8)
    assert got["local_tpot_ms"] == pytest.approx((4 * 11.0 + 4 * 13.0) / 8)
    assert got["local_samples"] == 8
    assert got["local_success"] == 1.0
    # The path the logs do not show keeps its base figures.
    assert (got["pd_ttft_ms"], got["pd_samples"]) == (100.0, 4)
    assert result.drift.used == 4
    assert result.drift.merged == 1


def test_failed_requests_count_in_the_success_rate_only() -> None:
    failed = [make_record(mode="ppd", path="local", ok=False, conversation_id=f"f{i}") for i in range(2)]
    got = figures(refresh(base_table(), failed))
    assert got["local_success"] == pytest.approx(4 / 6)
    assert got["local_samples"] == 6
    assert got["local_ttft_ms"] == 40.0


def test_ppd_lines_count_by_the_path_they_took_and_the_rest_is_left_out() -> None:
    records = [
        *logged("pd", 2, ttft=130.0),
        make_record(mode="local", path="local", run_id="static", ttft_ms=40.0),
        make_record(mode="ppd", path="replica"),
        make_record(mode="fraction:0.5", path="local"),
        make_record(mode="replica", path="replica"),
        make_record(mode="ppd", path="pd", turn=1, n_ctx=0),
        make_record(shape="2P2D", mode="ppd"),
    ]
    result = refresh(base_table(), records)
    assert figures(result)["pd_ttft_ms"] == pytest.approx((4 * 100.0 + 2 * 130.0) / 6)
    assert figures(result)["local_samples"] == 5
    assert result.drift.used == 3
    assert result.drift.left_out == {
        "mode fraction:0.5 (evidence is ppd, pd, local and bidir)": 1,
        "mode replica (evidence is ppd, pd, local and bidir)": 1,
        "other shape/model (2P2D/llama-3.1-8b)": 1,
        "path replica": 1,
        "turn 1 (always PD; not part of the decision)": 1,
    }
    assert {"ppd", "pd", "local", "bidir"} == EVIDENCE_MODES


def test_a_production_line_without_a_target_qps_is_filed_at_the_logs_own_arrival_rate() -> None:
    base = base_table(
        base_records() + [dataclasses.replace(r, target_qps=q) for q in (4.0, 8.0) for r in base_records()]
    )
    # 8 requests a second for 30 s, no target_qps: two-turn conversations, so 4 conversations a second,
    # the table's unit (a benchmark's target_qps); counting every turn would file them at 8.
    t0 = 1_767_300_000.0
    lines = [
        make_record(
            run_id="gateway", mode="ppd", path="local", target_qps=0.0, ttft_ms=70.0,
            conversation_id=f"c{i}", start_time=t0 + i / 8, **({} if i % 2 else {"turn": 1, "n_ctx": 0}),
        )
        for i in range(240)
    ]  # fmt: skip
    result = refresh_table(base, lines, min_samples=1, confidence=0.99, qps_window_s=10.0)
    at_4 = figures(result, (0, 6, AXES.qps_levels.index(4.0)))
    at_8 = figures(result, (0, 6, AXES.qps_levels.index(8.0)))
    at_2 = figures(result, CELL)
    assert at_2["local_samples"] == 4  # nothing landed at 2 QPS, not even the first and last lines
    assert at_8["local_samples"] == 4
    assert at_4["local_samples"] == 4 + 120
    with pytest.raises(ValueError, match="qps_window_s"):
        refresh_table(base, lines, min_samples=1, confidence=0.99, qps_window_s=0.0)


def test_a_cell_empty_in_the_base_is_filled_only_when_both_paths_are_logged() -> None:
    base = base_table()
    at_4 = (0, 6, AXES.qps_levels.index(4.0))
    at_8 = (0, 6, AXES.qps_levels.index(8.0))
    records = [
        *logged("pd", 4, ttft=90.0, target_qps=4.0),
        *logged("local", 4, ttft=30.0, target_qps=4.0),
        *logged("local", 4, ttft=30.0, target_qps=8.0),
    ]
    result = refresh(base, records)
    assert figures(result, at_4)["pd_ttft_ms"] == pytest.approx(90.0)
    assert figures(result, at_4)["local_samples"] == 4
    assert figures(result, at_8)["local_samples"] == 0
    assert result.drift.filled == ("small/mid_paste@4",)
    assert result.drift.one_path_only == ("small/mid_paste@8",)


# --- drift -----------------------------------------------------------------------------------------


def test_figures_beyond_the_confidence_bound_are_reported_with_the_bound() -> None:
    base = base_table()
    result = refresh(base, logged("local", 6, ttft=200.0))
    (drift,) = result.drift.drifted
    assert drift.cell == LABEL
    (shift,) = drift.shifts
    assert shift.figure == Figure.LOCAL_TTFT_MS.label
    assert (shift.base, shift.logged, shift.logged_samples) == (40.0, 200.0, 6)
    assert shift.z is not None
    assert shift.z > z_for(0.99)
    assert shift.merged == pytest.approx((4 * 40.0 + 6 * 200.0) / 10)
    text = result.drift.format()
    assert "drift beyond the 0.99 bound (|logged - base| > 2.58 standard errors): 1 cell(s)" in text
    assert "local_ttft_ms 40 -> 200" in text


def test_replace_drifted_gives_a_drifted_path_the_logged_figures_alone() -> None:
    """Rule 7: the drifted path's base figures are dropped (not merged); the other path, and a path
    within the bound, merge as before; the provenance says so; off, the bytes are a plain refresh's."""
    records = [*logged("local", 6, ttft=200.0), *logged("pd", 4, ttft=100.0, tpot=10.0)]
    result = refresh_table(base_table(), records, min_samples=1, confidence=0.99, replace_drifted=True)
    got = figures(result)
    assert got["local_ttft_ms"] == pytest.approx(200.0)
    assert got["local_samples"] == 6
    assert got["pd_samples"] == 8  # within the bound: merged by counts
    ((shift,),) = [d.shifts for d in result.drift.drifted]
    assert shift.merged == shift.logged == 200.0
    assert Table.from_bytes(result.encode()).header.provenance["replace_drifted"] is True
    plain = refresh_table(base_table(), records, min_samples=1, confidence=0.99)
    assert "replace_drifted" not in Table.from_bytes(plain.encode()).header.provenance
    assert figures(plain)["local_samples"] == 10


def test_figures_within_the_bound_are_not_drift() -> None:
    # Logged 38..48 around a base of 40 with 4 samples: well within 2.58 standard errors.
    assert refresh(base_table(), logged("local", 6, ttft=43.0)).drift.drifted == ()


def test_the_same_figures_logged_again_are_not_drift_whatever_the_rounding() -> None:
    # 200 lines of 742.236 ms average to 742.2360000000001: no spread, and no drift either.
    base = base_table(base_records(pd_ttft=742.236))
    same = [make_record(mode="ppd", conversation_id=f"s{i}", ttft_ms=742.236) for i in range(200)]
    assert refresh(base, same).drift.drifted == ()
    moved = [make_record(mode="ppd", conversation_id=f"s{i}", ttft_ms=742.3) for i in range(200)]
    (drift,) = refresh(base, moved).drift.drifted
    assert drift.shifts[0].z is None  # no spread: any real difference is beyond every bound


def test_a_success_rate_that_dropped_is_drift() -> None:
    failed = [make_record(mode="ppd", path="pd", ok=False, conversation_id=f"f{i}") for i in range(10)]
    (drift,) = refresh(base_table(), failed).drift.drifted
    assert [s.figure for s in drift.shifts] == ["pd_success"]
    assert drift.shifts[0].logged == 0.0


def test_confidence_must_lie_strictly_between_zero_and_one() -> None:
    assert z_for(0.95) == pytest.approx(1.96, abs=1e-3)
    for bad in (0.0, 1.0):
        with pytest.raises(ValueError, match="confidence"):
            refresh(base_table(), [], confidence=bad)
    with pytest.raises(ValueError, match="min_samples"):
        refresh(base_table(), [], min_samples=0)


# --- flips -----------------------------------------------------------------------------------------


def _answer(table: Table, cell: tuple[int, int, int]) -> bool:
    return Router(table).cell(*cell).verdict.local


def test_a_cell_flips_with_enough_logged_requests() -> None:
    base = base_table()
    assert _answer(base, CELL) is True  # local 40 ms vs pd 100 ms
    result = refresh(base, logged("local", 20, ttft=400.0), min_samples=20)
    assert _answer(Table.from_bytes(result.encode()), CELL) is False
    (flip,) = [f for f in result.drift.flips if f.cell == LABEL]
    assert (flip.before, flip.after, flip.reason, flip.logged, flip.source) == (
        "local",
        "pd",
        "TABLE",
        20,
        LABEL,
    )
    assert result.drift.held == ()
    # Unmeasured levels of the same (context, workload) read this cell and flip with it.
    assert {f.source for f in result.drift.flips} == {LABEL}
    assert len(result.drift.flips) == len(AXES.qps_levels)
    assert "small/mid_paste@2: local -> pd (TABLE, 20 logged; profiles balanced, tpot, ttft flip too)" in (
        result.drift.format()
    )


def test_no_cell_flips_on_fewer_than_the_sample_minimum() -> None:
    base = base_table()
    result = refresh(base, logged("local", 19, ttft=400.0), min_samples=20)
    assert result.drift.flips == ()
    assert [(h.cell, h.logged) for h in result.drift.held] == [(LABEL, 19)]
    assert figures(result) == figures(refresh(base, []))  # the base figures, untouched
    assert result.drift.drifted  # the drift is still reported
    assert "held at the base figures" in result.drift.format()


def test_a_new_cell_that_would_flip_its_level_on_too_few_samples_stays_empty() -> None:
    base = base_table()  # (small, mid_paste) answers local at every level, read from 2 QPS
    at_8 = (0, 6, AXES.qps_levels.index(8.0))
    records = [*logged("pd", 3, ttft=50.0, target_qps=8.0), *logged("local", 3, ttft=300.0, target_qps=8.0)]
    held = refresh(base, records, min_samples=7)
    assert figures(held, at_8)["pd_samples"] == 0
    assert [h.cell for h in held.drift.held] == ["small/mid_paste@8"]
    assert held.drift.filled == ()
    flipped = refresh(base, records, min_samples=6)
    assert _answer(Table.from_bytes(flipped.encode()), at_8) is False


def test_a_profile_flip_is_held_too() -> None:
    # Under the 'tpot' profile (0.2, 1) a local TPOT 30% worse loses; under (1, 1) local still wins.
    base = base_table()
    records = logged("local", 12, ttft=40.0, tpot=17.6)
    result = refresh(base, records, min_samples=13)
    assert [h.cell for h in result.drift.held] == [LABEL]
    flipped = refresh(base, records, min_samples=12)
    flips = {f.cell: f for f in flipped.drift.flips}
    assert flips[LABEL].profiles == ("tpot",)
    assert (flips[LABEL].before, flips[LABEL].after) == ("local", "local")
    assert f"{LABEL}: stays local, profiles tpot flip (TABLE, 12 logged)" in flipped.drift.format()


# --- determinism and provenance ----------------------------------------------------------------------


def test_provenance_names_the_base_and_the_build_time_comes_from_the_newest_record() -> None:
    base = base_table()
    result = refresh(base, logged("local", 3, ttft=50.0, start=1_767_300_000.0))
    provenance = result.spec.header.provenance
    assert provenance["source"] == "refresh"
    assert provenance["base"]["version"] == base.version
    assert provenance["base"]["provenance"] == dict(base.header.provenance)
    assert provenance["built_at"] == "2026-01-01T20:40:02Z"
    assert provenance["runs"] == ["gateway"]
    assert result.spec.header.profiles == base.header.profiles
    assert result.drift.notes == ()


def test_refreshing_a_refreshed_table_warns_that_logs_count_twice() -> None:
    once = Table.from_bytes(refresh(base_table(), logged("local", 3, ttft=50.0)).encode())
    (note,) = refresh(once, logged("local", 3, ttft=50.0)).drift.notes
    assert "counted again" in note


def test_the_report_as_json() -> None:
    report = refresh(base_table(), logged("local", 20, ttft=400.0), min_samples=20).drift
    data = report.to_json()
    assert data["flipped"] == len(report.flips)
    assert data["drifted"] == 1
    assert data["drift"][0]["shifts"][0]["figure"] == "local_ttft_ms"
    assert data["flips"][0]["profiles"] == ["balanced", "tpot", "ttft"]  # every profile flipped too


# --- properties --------------------------------------------------------------------------------------

_CELLS = [(256, 64, 2.0), (256, 64, 8.0), (16, 512, 2.0), (3000, 64, 4.0), (256, 64, 0.0)]


@st.composite
def evidence(draw: st.DrawFn) -> list[Record]:
    """Log lines in a handful of cells (one without a target QPS), either path, some failing."""
    n = draw(st.integers(0, 60))
    out = []
    for i in range(n):
        n_in, n_out, qps = draw(st.sampled_from(_CELLS))
        ok = draw(st.booleans()) or draw(st.booleans())
        out.append(
            make_record(
                run_id="gateway",
                mode=draw(st.sampled_from(["ppd", "ppd", "pd", "local"])),
                path=draw(st.sampled_from(["pd", "local"])),
                target_qps=qps,
                workload="sharegpt",
                conversation_id=f"c{i}",
                n_in=n_in,
                n_out=n_out,
                n_ctx=draw(st.sampled_from([256, 1500])),
                ttft_ms=draw(st.floats(1.0, 2000.0)),
                tpot_ms=draw(st.floats(1.0, 100.0)),
                start_time=1_767_300_000.0 + draw(st.floats(0.0, 60.0)),
                ok=ok,
            )
        )
    # Records whose path disagrees with their static mode are what a fallback logs; keep them.
    return out


PROPERTY = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@PROPERTY
@given(records=evidence(), order=st.randoms(use_true_random=False), interference=st.booleans())
def test_the_same_evidence_in_any_order_gives_the_same_bytes(
    records: list[Record], order: Any, interference: bool
) -> None:
    base = base_table()
    shuffled = list(records)
    order.shuffle(shuffled)
    first = refresh(base, records, min_samples=5, interference=interference).encode()
    assert first == refresh(base, shuffled, min_samples=5, interference=interference).encode()


@PROPERTY
@given(records=evidence(), min_samples=st.integers(1, 30), interference=st.booleans())
def test_no_answer_flips_unless_the_cell_it_is_read_from_holds_the_sample_minimum(
    records: list[Record], min_samples: int, interference: bool
) -> None:
    base = base_table(base_records() + [dataclasses.replace(r, target_qps=8.0) for r in base_records(2)])
    result = refresh(base, records, min_samples=min_samples, interference=interference)
    new = Router(Table.from_bytes(result.encode()))
    old = Router(base)
    # The test's own count of logged requests per cell (the classifier; QPS as refresh's rule 2).
    locate = axes_locator(AXES)
    arrivals = sorted(r.start_time for r in records if r.target_qps == 0)
    counts: Counter[CellKey] = Counter()
    for r in records:
        low = (
            min(max(r.start_time - 5.0, arrivals[0]), max(arrivals[-1] - 10.0, arrivals[0]))
            if arrivals
            else 0
        )
        qps = r.target_qps or sum(1 for t in arrivals if low <= t <= low + 10.0) / 10.0
        counts[locate(n_ctx=r.n_ctx, n_in=r.n_in, n_out=r.n_out, qps=qps, workload=r.workload)] += 1
    weights = [HEADER.default_weights, *HEADER.profiles.values()]
    nc, nw, nq = AXES.shape
    for c in range(nc):
        for w in range(nw):
            for q in range(nq):
                before, after = old.cell(c, w, q), new.cell(c, w, q)
                answers = [
                    (
                        rule.forced[0]
                        if rule.forced is not None
                        else wt.w_ttft * rule.delta_ttft - wt.w_tpot * rule.delta_tpot > 0
                    )
                    for rule in (before, after)
                    for wt in weights
                ]
                if answers[: len(weights)] != answers[len(weights) :]:
                    source = CellKey(c, w, AXES.qps_levels.index(after.qps_level))
                    assert counts[source] >= min_samples, (c, w, q, counts[source])


# --- rule 8: the decode interference of LOCAL turns ------------------------------------------------


def _interfering_logs(seed: int = 1) -> list[Record]:
    """100 s of one cell's Turn-2 lines, 4 a second, half LOCAL by a seeded draw. Every line's TPOT is
    10 ms plus 2 ms per LOCAL arrival during its 1 s of decoding, whichever path it took itself: the
    cell's two paths show the same mean TPOT, and LOCAL costs everyone's."""
    import random

    draw = random.Random(seed)
    t0 = 1_767_300_000.0
    starts = [t0 + i / 4 for i in range(400)]
    local = [draw.random() < 0.5 for _ in starts]
    local_at = [t for t, is_local in zip(starts, local, strict=True) if is_local]
    lines = []
    for i, (t, is_local) in enumerate(zip(starts, local, strict=True)):
        during = sum(1 for a in local_at if t + 0.05 <= a <= t + 1.05)
        lines.append(
            make_record(
                run_id="gateway", mode="ppd", path="local" if is_local else "pd", conversation_id=f"c{i}",
                start_time=t, ttft_ms=50.0, e2e_ms=1050.0, tpot_ms=10.0 + 2.0 * during,
            )
        )  # fmt: skip
    return lines


def test_interference_reads_the_tpot_cost_of_local_from_everyones_requests() -> None:
    base = base_table()
    lines = _interfering_logs()
    own = figures(refresh(base, lines, min_samples=1))
    fitted = refresh(base, lines, min_samples=1, interference=True)
    after = figures(fitted)
    # Per path, the cell's own lines show no cost: the merged TPOTs stay within a few percent.
    assert abs(own["local_tpot_ms"] / own["pd_tpot_ms"] - 1.0) < 0.1, own
    # The fit: 2 ms per LOCAL arrival a second, 4 arrivals a second, a mean TPOT near 14 ms: were the
    # whole load LOCAL, TPOT would rise by about 2 x 4 / 14 = 57 %.
    effect = after["local_tpot_ms"] / after["pd_tpot_ms"] - 1.0
    assert 0.45 < effect < 0.7, after
    assert after["pd_tpot_ms"] == own["pd_tpot_ms"]
    table = Table.from_bytes(fitted.encode())
    assert table.header.provenance["interference"] == {LABEL: pytest.approx(effect)}
    assert "interference" not in Table.from_bytes(refresh(base, lines).encode()).header.provenance


def test_interference_needs_both_paths_and_a_significant_fit() -> None:
    base = base_table()
    only_local = [dataclasses.replace(r, path="local") for r in _interfering_logs()]
    assert figures(refresh(base, only_local, interference=True)) == figures(refresh(base, only_local))
    # No interference at all (every TPOT the same): the fit finds no effect beyond its error.
    flat = [dataclasses.replace(r, tpot_ms=12.0) for r in _interfering_logs()]
    result = refresh(base, flat, interference=True)
    assert figures(result) == figures(refresh(base, flat))
    assert Table.from_bytes(result.encode()).header.provenance["interference"] == {}


# --- the bidir path ----------------------------------------------------------------------------------


def _bidir_base(n: int = 4, ttft: float = 30.0) -> Table:
    """The base table with BIDIR figures in make_record's cell: n static bidir requests, mean TTFT given."""
    bidir = [
        make_record(run_id="run-bidir", mode="bidir", path="bidir", conversation_id=f"b{i}", ttft_ms=ttft)
        for i in range(n)
    ]
    return base_table([*base_records(), *bidir])


def test_bidir_lines_merge_into_the_bidir_figures_by_sample_counts() -> None:
    base = _bidir_base()
    assert base.format_version == 2
    result = refresh(base, logged("bidir", 4, ttft=60.0, tpot=12.0))
    got = Table.from_bytes(result.encode()).figures[CELL]
    assert got[Figure.BIDIR_TTFT_MS] == pytest.approx((4 * 30.0 + 4 * 60.0) / 8)
    assert got[Figure.BIDIR_TPOT_MS] == pytest.approx((4 * 10.0 + 4 * 12.0) / 8)
    assert (got[Figure.BIDIR_SAMPLES], got[Figure.BIDIR_SUCCESS]) == (8, 1.0)
    assert result.drift.used == 4
    assert "path bidir" not in result.drift.left_out


def test_bidir_lines_give_a_cell_without_bidir_figures_its_first_and_flip_capable_callers() -> None:
    base = base_table()  # format 1: pd 100 ms, local 40 ms; local for every caller
    assert base.format_version == 1
    result = refresh(base, logged("bidir", 4, ttft=20.0, tpot=10.0))
    table = Table.from_bytes(result.encode())
    assert table.format_version == 2
    got = table.figures[CELL]
    assert (got[Figure.BIDIR_TTFT_MS], got[Figure.BIDIR_SAMPLES], got[Figure.BIDIR_SUCCESS]) == (20.0, 4, 1.0)
    # pd and local untouched; a caller that can serve BIDIR now gets it, the others still local.
    assert got[Figure.LOCAL_TTFT_MS] == base.figures[CELL][Figure.LOCAL_TTFT_MS]
    (flip,) = [f for f in result.drift.flips if f.cell == LABEL]
    assert (flip.before, flip.after) == ("local", "bidir (without bidir: local)")


def test_a_bidir_flip_on_too_few_logged_requests_is_held() -> None:
    base = base_table()
    result = refresh(base, logged("bidir", 4, ttft=20.0, tpot=10.0), min_samples=10)
    assert [h.cell for h in result.drift.held] == [LABEL]
    assert result.drift.flips == ()
    table = Table.from_bytes(result.encode())
    assert table.format_version == 1  # the held cell kept its base figures: still no bidir anywhere
    assert (table.figures == base.figures).all()


def test_bidir_lines_alone_do_not_fill_an_empty_cell() -> None:
    result = refresh(base_table(), logged("bidir", 6, ttft=20.0, n_in=16, n_out=32, workload="small_tiny"))
    assert result.drift.filled == ()
    assert len(result.drift.one_path_only) == 1


def test_bidir_lines_that_all_failed_are_censored_named_and_change_no_answer() -> None:
    """A broken bidir path in production: its first figures take the timeout as TTFT and a success of
    0, the report says so, and no caller is sent to it."""
    failed = [
        make_record(
            run_id="gateway", mode="ppd", path="bidir", ok=False, ttft_ms=None, conversation_id=f"x{i}"
        )
        for i in range(3)
    ]
    result = refresh(base_table(), failed)
    got = Table.from_bytes(result.encode()).figures[CELL]
    assert (got[Figure.BIDIR_TTFT_MS], got[Figure.BIDIR_SUCCESS], got[Figure.BIDIR_SAMPLES]) == (
        30_000.0,
        0.0,
        3,
    )
    assert [n for n in result.drift.notes if n.startswith(LABEL)] == [
        f"{LABEL}: bidir completed 0/3 in the logs; its bidir TTFT is the timeout, 30000 ms"
    ]
    assert result.drift.flips == ()


# --- hostile logs (issue 24): evidence only from the path, bounded, each request once -------------


def test_a_client_that_disconnected_is_no_failure_of_the_path() -> None:
    # 25 conversations whose client closed its streamed Turn 2 on the local path after the first
    # event: the gateway logs them failed, but neither the path nor its worker failed.
    gone = [
        make_record(
            run_id="gateway", mode="ppd", path="local", ok=False, error=CLIENT_DISCONNECTED,
            conversation_id=f"gone{i}", start_time=1_767_300_100.0 + i,
        )
        for i in range(25)
    ]  # fmt: skip
    result = refresh(base_table(), [*logged("local", 20, ttft=40.0), *gone], min_samples=20)
    assert result.drift.flips == ()
    assert figures(result)["local_success"] == 1.0
    assert figures(result)["local_samples"] == 4 + 20
    assert result.drift.used == 20
    assert result.drift.left_out == {"client disconnected (no failure of the path)": 25}


@pytest.mark.parametrize(("status", "counts"), [(400, False), (413, False), (429, True), (503, True)])
def test_a_request_the_worker_refused_is_no_failure_of_the_path(status: int, counts: bool) -> None:
    # 25 requests a worker refused as bad (too long, bad parameters: any path would) say nothing
    # about the local path; a 429 or a 5xx is the worker's own state and counts.
    refused = [
        make_record(
            run_id="gateway", mode="ppd", path="local", ok=False, error=worker_status_error("D0", status),
            conversation_id=f"bad{i}", start_time=1_767_300_100.0 + i,
        )
        for i in range(25)
    ]  # fmt: skip
    result = refresh(base_table(), [*logged("local", 20, ttft=40.0), *refused], min_samples=20)
    assert (result.drift.flips != ()) is counts
    assert (figures(result)["local_success"] < 1.0) is counts
    assert result.drift.used == (45 if counts else 20)


def test_static_mode_lines_of_production_logs_are_not_evidence() -> None:
    # A production gateway's lines (no target_qps) in a static mode: a client asked for the path
    # (X-PPD-Mode); only the gateway's own routing (ppd) is evidence there. Benchmark runs stay.
    production = [
        make_record(run_id="gateway", mode=mode, path=path, target_qps=0.0, conversation_id=f"{mode}{i}",
                    ttft_ms=900.0, start_time=1_767_300_000.0 + i)
        for i in range(20)
        for mode, path in (("pd", "pd"), ("local", "local"), ("bidir", "bidir"))
    ]  # fmt: skip
    benchmark = make_record(run_id="static", mode="local", path="local", conversation_id="b", ttft_ms=40.0)
    result = refresh(base_table(), [*production, benchmark], min_samples=1)
    assert result.drift.used == 1
    assert result.drift.flips == ()
    assert result.drift.left_out == {
        "mode bidir in a production log (no target_qps: evidence there is ppd lines)": 20,
        "mode local in a production log (no target_qps: evidence there is ppd lines)": 20,
        "mode pd in a production log (no target_qps: evidence there is ppd lines)": 20,
    }


def test_a_latency_beyond_the_timeout_is_a_failure_not_a_mean() -> None:
    # One line of local TTFT 1e9 ms among 20 would have made local's mean 12 days.
    wild = make_record(run_id="gateway", mode="ppd", path="local", conversation_id="wild", ttft_ms=1e9)
    result = refresh(base_table(), [*logged("local", 20, ttft=40.0), wild], min_samples=20)
    assert result.drift.flips == ()
    got = figures(result)
    assert got["local_ttft_ms"] == pytest.approx(40.0)
    assert got["local_samples"] == 4 + 21
    assert got["local_success"] == pytest.approx(24 / 25)  # timed out: sent, not completed
    assert any("beyond the 30000 ms timeout" in note for note in result.drift.notes)
    # The bound is the refresh's option; its default is the base's benchmark timeout.
    tight = refresh_table(
        base_table(), logged("local", 4, ttft=40.0), min_samples=1, confidence=0.99, timeout_ms=30.0
    )
    assert figures(tight)["local_success"] == pytest.approx(4 / 8)
    with pytest.raises(ValueError, match="timeout_ms"):
        refresh_table(base_table(), [], min_samples=1, confidence=0.99, timeout_ms=0.0)


def test_overflowing_latencies_are_bounded_too() -> None:
    huge = [
        make_record(run_id="gateway", mode="ppd", path="pd", conversation_id=f"h{i}", tpot_ms=1.7e308)
        for i in range(2)
    ]
    result = refresh(base_table(), huge)
    assert figures(result)["pd_tpot_ms"] == 10.0
    assert figures(result)["pd_success"] == pytest.approx(4 / 6)


def test_a_line_repeated_counts_once() -> None:
    line = make_record(run_id="gateway", mode="ppd", path="local", conversation_id="same", ttft_ms=400.0)
    result = refresh(base_table(), [line] * 20, min_samples=20)
    assert result.drift.flips == ()
    assert result.drift.used == 1
    assert result.drift.left_out == {"duplicate line (the same request again)": 19}
    once, thrice = (Table.from_bytes(refresh(base_table(), [line] * n).encode()) for n in (1, 3))
    assert once.figures.tobytes() == thrice.figures.tobytes()


def test_a_production_lines_cell_comes_from_its_token_counts_not_its_workload_label() -> None:
    # (16, 32) is the benchmark shape of `tiny`, which the live classifier calls small_bal: a
    # production line is filed where the decision service placed it, whatever its label says.
    lines = [
        make_record(run_id="gateway", mode="ppd", path="local", target_qps=0.0, workload=workload,
                    conversation_id=f"{workload}{i}", n_in=16, n_out=32, start_time=1_767_300_000.0 + i)
        for i in range(3)
        for workload in ("", "small_tiny")
    ]  # fmt: skip
    result = refresh(base_table(), lines)
    assert result.drift.used == 6
    assert [label.split("@")[0] for label in result.drift.one_path_only] == ["small/small_bal"]
