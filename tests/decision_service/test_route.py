"""The decision rule, table-driven, plus totality as a property."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from decision_service.route import MAX_TOKENS, Query, QueryError, Reason, Router, check_query, route
from decision_service.table import Figure, Table, Weights, encode_table
from tests.support.tables import row, synthetic_spec, with_header


@pytest.fixture(scope="module")
def table() -> Table:
    return Table.from_bytes(encode_table(synthetic_spec()))


@pytest.fixture(scope="module")
def router(table: Table) -> Router:
    return Router(table)


def test_turn_one_is_always_pd(router: Router) -> None:
    v = router.route(Query(turn=1, n_in=5000, n_out=10, n_ctx=0, qps=20.0))
    assert (v.local, v.reason, v.context) == (False, Reason.TURN_ONE, None)


def test_table_decision_under_default_weights(router: Router) -> None:
    v = router.route(Query(turn=2, n_in=128, n_out=128, n_ctx=1000, qps=4.0))
    assert (v.local, v.reason) == (True, Reason.TABLE)
    assert (v.context, v.workload, v.qps_level) == ("large", "mid_bal", 4.0)
    assert v.score > 0
    assert v.default_local


def test_heavy_tpot_weight_flips_to_pd_and_says_weights(router: Router) -> None:
    v = router.route(Query(turn=2, n_in=1024, n_out=32, n_ctx=1000, qps=0.5, weights=Weights(0.01, 100.0)))
    assert (v.local, v.reason, v.default_local) == (False, Reason.WEIGHTS, True)
    assert v.score < 0


def test_named_profile_is_applied(router: Router, table: Table) -> None:
    q = Query(turn=3, n_in=128, n_out=128, n_ctx=1000, qps=4.0, profile="tpot")
    v = router.route(q)
    w = table.header.profiles["tpot"]
    direct = router.route(dataclasses.replace(q, profile=None, weights=w))
    assert v == direct


def test_default_weights_given_explicitly_say_table(router: Router, table: Table) -> None:
    v = router.route(
        Query(turn=2, n_in=128, n_out=128, n_ctx=1000, qps=4.0, weights=table.header.default_weights)
    )
    assert v.reason is Reason.TABLE


def test_pd_failing_its_slo_forces_local_whatever_the_weights(router: Router) -> None:
    v = router.route(Query(turn=2, n_in=128, n_out=128, n_ctx=1000, qps=25.0, weights=Weights(0.0, 1000.0)))
    assert (v.local, v.reason) == (True, Reason.PD_FAILED_IN_CELL)


def test_local_failing_its_slo_forces_pd() -> None:
    spec = synthetic_spec(holes=False)
    fig = spec.figures.copy()
    fig[1, 5, :, Figure.LOCAL_SUCCESS] = 0.5  # in (large, mid_bal)
    table = Table.from_bytes(encode_table(dataclasses.replace(spec, figures=fig)))
    v = Router(table).route(Query(turn=2, n_in=128, n_out=128, n_ctx=1000, qps=4.0, weights=Weights(100, 0)))
    assert (v.local, v.reason) == (False, Reason.LOCAL_FAILED_IN_CELL)


def test_missing_qps_level_uses_nearest_measured_and_says_so(router: Router, table: Table) -> None:
    # (small, tiny) has no data at 10 QPS; 8 and 12 are equally near. The rule names the lower level.
    v = router.route(Query(turn=2, n_in=8, n_out=64, n_ctx=100, qps=10.0))
    assert v.reason is Reason.NEAREST_CELL
    assert v.qps_level == 8.0
    assert "no measurements at 10 QPS; nearest measured level 8" in v.detail
    # ...and it is scored with the 8-QPS cell's own figures: S = w_ttft*dTTFT - w_tpot*dTPOT, (1, 1).
    row = table.figures[0, 0, 5]
    pd_ttft, pd_tpot = float(row[Figure.PD_TTFT_MS]), float(row[Figure.PD_TPOT_MS])
    lo_ttft, lo_tpot = float(row[Figure.LOCAL_TTFT_MS]), float(row[Figure.LOCAL_TPOT_MS])
    assert v.score == 1.0 * ((pd_ttft - lo_ttft) / pd_ttft) - 1.0 * ((lo_tpot - pd_tpot) / pd_tpot)


def _uniform_table(pd_ttft: float, pd_tpot: float, local_ttft: float, local_tpot: float) -> Table:
    """Every cell measured with the same figures, both modes meeting the SLO, default weights (1, 1)."""
    spec = synthetic_spec(holes=False)
    fig = spec.figures.copy()
    fig[...] = row(
        pd_ttft_ms=pd_ttft,
        pd_tpot_ms=pd_tpot,
        local_ttft_ms=local_ttft,
        local_tpot_ms=local_tpot,
        pd_success=1.0,
        local_success=1.0,
        pd_samples=40,
        local_samples=40,
    )
    return Table.from_bytes(encode_table(dataclasses.replace(spec, figures=fig)))


@pytest.mark.parametrize(
    ("weights", "score", "local", "reason"),
    [
        # dTTFT = (64 - 16) / 64 = 0.75, dTPOT = (10 - 8) / 8 = 0.25: every number exact in binary.
        (None, 0.5, True, Reason.TABLE),  # the table's default weights (1, 1)
        (Weights(1.0, 2.0), 0.25, True, Reason.WEIGHTS),
        (Weights(1.0, 3.0), 0.0, False, Reason.WEIGHTS),  # S = 0 is not > 0: PD
        (Weights(1.0, 4.0), -0.25, False, Reason.WEIGHTS),
        (Weights(2.0, 1.0), 1.25, True, Reason.WEIGHTS),
        (Weights(0.5, 0.0), 0.375, True, Reason.WEIGHTS),
    ],
)
def test_the_score_is_the_formula_exactly(
    weights: Weights | None, score: float, local: bool, reason: Reason
) -> None:
    router = Router(_uniform_table(pd_ttft=64.0, pd_tpot=8.0, local_ttft=16.0, local_tpot=10.0))
    v = router.route(Query(turn=2, n_in=128, n_out=128, n_ctx=1000, qps=4.0, weights=weights))
    assert v.score == score
    assert (v.local, v.reason) == (local, reason)
    assert v.default_local is True  # (1, 1) scores 0.5 in every cell
    cell = router.cell(1, 5, 3)
    assert (cell.delta_ttft, cell.delta_tpot) == (0.75, 0.25)


def test_cell_without_any_data_gets_the_table_default_never_silently_local(router: Router) -> None:
    v = router.route(Query(turn=2, n_in=32, n_out=256, n_ctx=100, qps=4.0))
    assert (v.local, v.reason) == (False, Reason.DEFAULT)
    huge = router.route(Query(turn=2, n_in=128, n_out=128, n_ctx=100_000, qps=4.0, weights=Weights(1, 0)))
    assert (huge.local, huge.reason) == (False, Reason.DEFAULT)


def test_high_decode_kv_usage_turns_local_into_pd(router: Router) -> None:
    v = router.route(Query(turn=2, n_in=128, n_out=128, n_ctx=1000, qps=4.0, decode_kv_usage=0.99))
    assert (v.local, v.reason, v.default_local) == (False, Reason.LIVE_SIGNAL, True)


@pytest.fixture(scope="module")
def guarded() -> Router:
    spec = with_header(synthetic_spec(), max_decode_running=192, max_prefill_queue_depth=8)
    return Router(Table.from_bytes(encode_table(spec)))


def local_cell(*, running: int | None, queue: int | None) -> Query:
    """A turn whose cell is LOCAL in the synthetic table, with the given live signals."""
    return Query(
        turn=2, n_in=128, n_out=128, n_ctx=1000, qps=4.0, decode_running=running, prefill_queue_depth=queue
    )


@pytest.mark.parametrize(
    ("running", "queue", "local"),
    [
        (193, 0, False),  # decode loaded, P idle: the prefill moves to P
        (193, 8, False),  # at the queue limit P still counts as having headroom
        (193, None, False),  # no prefill signal: nothing says P is the scarcer side
        (192, 0, True),  # at the limit, not above it
        (193, 9, True),  # P's queue is deeper than its limit: P is the scarcer side, stay local
        (None, 0, True),  # no decode signal: the guard cannot fire
        (5000, 100, True),
    ],
)
def test_decode_load_guard_moves_local_to_pd_only_when_p_has_headroom(
    guarded: Router, running: int | None, queue: int | None, local: bool
) -> None:
    v = guarded.route(local_cell(running=running, queue=queue))
    assert v.local is local
    assert v.default_local is True  # the table's own verdict is still reported
    if not local:
        assert v.reason is Reason.LIVE_SIGNAL
        assert "193 requests" in v.detail
        assert "192" in v.detail


def test_decode_load_guard_never_turns_pd_into_local(guarded: Router) -> None:
    pd = guarded.route(Query(turn=2, n_in=32, n_out=256, n_ctx=100, qps=4.0, decode_running=0))
    assert (pd.local, pd.reason) == (False, Reason.DEFAULT)
    first = guarded.route(Query(turn=1, n_in=128, n_out=128, n_ctx=0, qps=4.0, decode_running=10_000))
    assert (first.local, first.reason) == (False, Reason.TURN_ONE)


def test_a_table_without_a_decode_limit_ignores_the_running_count(router: Router) -> None:
    assert router.table.header.max_decode_running is None
    v = router.route(local_cell(running=1_000_000, queue=0))
    assert (v.local, v.reason) == (True, Reason.TABLE)


@pytest.mark.parametrize(
    ("query", "message"),
    [
        (Query(turn=0, n_in=1, n_out=1, n_ctx=1, qps=1.0), "turn"),
        (Query(turn=2, n_in=-1, n_out=1, n_ctx=1, qps=1.0), "new_input_tokens"),
        (Query(turn=2, n_in=1, n_out=MAX_TOKENS + 1, n_ctx=1, qps=1.0), "expected_output_tokens"),
        (Query(turn=2, n_in=1, n_out=1, n_ctx=-5, qps=1.0), "context_tokens"),
        (Query(turn=2, n_in=1, n_out=1, n_ctx=1, qps=float("nan")), "qps"),
        (Query(turn=2, n_in=1, n_out=1, n_ctx=1, qps=float("inf")), "qps"),
        (Query(turn=2, n_in=1, n_out=1, n_ctx=1, qps=1.0, weights=Weights(-1, 1)), "weights"),
        (Query(turn=2, n_in=1, n_out=1, n_ctx=1, qps=1.0, weights=Weights(0, 0)), "both zero"),
        (Query(turn=2, n_in=1, n_out=1, n_ctx=1, qps=1.0, profile="nope"), "unknown weights profile"),
        (Query(turn=2, n_in=1, n_out=1, n_ctx=1, qps=1.0, decode_kv_usage=1.5), "decode_kv_usage"),
        (Query(turn=2, n_in=1, n_out=1, n_ctx=1, qps=1.0, prefill_queue_depth=-1), "prefill_queue_depth"),
    ],
)
def test_invalid_queries_say_what_was_wrong(table: Table, query: Query, message: str) -> None:
    with pytest.raises(QueryError, match=message):
        route(table, query)


_tokens = st.integers(min_value=0, max_value=MAX_TOKENS)


@settings(max_examples=300, deadline=None)
@given(
    turn=st.integers(min_value=1, max_value=1000),
    n_in=_tokens,
    n_out=_tokens,
    n_ctx=_tokens,
    qps=st.floats(min_value=0, max_value=1e9),
    weights=st.none() | st.tuples(st.floats(0, 1e6), st.floats(0, 1e6)).filter(lambda w: w != (0, 0)),
    kv=st.none() | st.floats(0, 1),
)
def test_rule_is_total(
    router: Router,
    table: Table,
    turn: int,
    n_in: int,
    n_out: int,
    n_ctx: int,
    qps: float,
    weights: tuple[float, float] | None,
    kv: float | None,
) -> None:
    q = Query(
        turn=turn,
        n_in=n_in,
        n_out=n_out,
        n_ctx=n_ctx,
        qps=qps,
        weights=Weights(*weights) if weights else None,
        decode_kv_usage=kv,
    )
    check_query(q, table)
    v = router.route(q)
    assert isinstance(v.local, bool)
    assert v.reason in Reason
    assert (turn == 1) == (v.reason is Reason.TURN_ONE)
    if v.local and v.reason in (Reason.TABLE, Reason.WEIGHTS):
        assert v.score > 0


# Rule 6: whether exploration may take the path the verdict did not choose.


def test_the_alternative_is_allowed_where_both_modes_met_the_slo(router: Router) -> None:
    local = router.route(Query(turn=2, n_in=128, n_out=128, n_ctx=1000, qps=4.0))
    assert (local.local, local.alternative_allowed) == (True, True)
    flipped = router.route(
        Query(turn=2, n_in=1024, n_out=32, n_ctx=1000, qps=0.5, weights=Weights(0.01, 100.0))
    )
    assert (flipped.local, flipped.reason, flipped.alternative_allowed) == (False, Reason.WEIGHTS, True)


def test_never_into_a_mode_that_failed_the_slo_in_its_cell(router: Router) -> None:
    # PD failed here: the verdict is LOCAL and its alternative, PD, is not allowed, whatever the weights.
    for weights in (None, Weights(0.0, 1000.0)):
        v = router.route(Query(turn=2, n_in=128, n_out=128, n_ctx=1000, qps=25.0, weights=weights))
        assert (v.local, v.reason, v.alternative_allowed) == (True, Reason.PD_FAILED_IN_CELL, False)
    spec = synthetic_spec(holes=False)
    fig = spec.figures.copy()
    fig[1, 5, :, Figure.LOCAL_SUCCESS] = 0.5  # in (large, mid_bal)
    lo_failed = Router(Table.from_bytes(encode_table(dataclasses.replace(spec, figures=fig))))
    v = lo_failed.route(Query(turn=2, n_in=128, n_out=128, n_ctx=1000, qps=4.0))
    assert (v.local, v.reason, v.alternative_allowed) == (False, Reason.LOCAL_FAILED_IN_CELL, False)


def test_both_modes_failing_the_slo_allow_no_alternative() -> None:
    spec = synthetic_spec(holes=False)
    fig = spec.figures.copy()
    fig[1, 5, :, Figure.LOCAL_SUCCESS] = 0.5
    fig[1, 5, :, Figure.PD_SUCCESS] = 0.5  # equal: no mode is forced, the score decides
    router = Router(Table.from_bytes(encode_table(dataclasses.replace(spec, figures=fig))))
    for weights in (None, Weights(1.0, 0.0), Weights(0.0, 1.0)):
        v = router.route(Query(turn=2, n_in=128, n_out=128, n_ctx=1000, qps=4.0, weights=weights))
        assert v.alternative_allowed is False


def test_turn_one_and_cells_without_data_allow_no_alternative(router: Router) -> None:
    assert router.route(Query(turn=1, n_in=128, n_out=128, n_ctx=0, qps=4.0)).alternative_allowed is False
    v = router.route(Query(turn=2, n_in=32, n_out=256, n_ctx=100, qps=4.0))
    assert (v.reason, v.alternative_allowed) == (Reason.DEFAULT, False)
    nearest = router.route(Query(turn=2, n_in=8, n_out=64, n_ctx=100, qps=10.0))
    assert (nearest.reason, nearest.alternative_allowed) == (Reason.NEAREST_CELL, True)


def test_a_live_signal_forbids_exploring_into_local(guarded: Router) -> None:
    # LOCAL turned into PD by the guard: its alternative, LOCAL, is what the guard forbids.
    moved = guarded.route(local_cell(running=193, queue=0))
    assert (moved.reason, moved.alternative_allowed) == (Reason.LIVE_SIGNAL, False)
    # A PD verdict on a loaded decode worker: exploring into LOCAL is forbidden too.
    w = Weights(0.01, 100.0)
    calm = guarded.route(dataclasses.replace(local_cell(running=0, queue=0), weights=w))
    assert (calm.local, calm.alternative_allowed) == (False, True)
    busy = guarded.route(dataclasses.replace(local_cell(running=193, queue=0), weights=w))
    assert (busy.local, busy.reason, busy.alternative_allowed) == (False, Reason.WEIGHTS, False)
    kv = guarded.route(
        dataclasses.replace(local_cell(running=None, queue=None), weights=w, decode_kv_usage=0.99)
    )
    assert (kv.local, kv.alternative_allowed) == (False, False)
