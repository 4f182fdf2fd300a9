"""The DecisionService over a real grpc.aio server on 127.0.0.1:0: answers, and every error code."""

from __future__ import annotations

import json
import math
from pathlib import Path

import grpc
import pytest

from decision_service.table import write_table
from ppd.decision.v1 import decision_pb2 as pb
from ppd.decision.v1.status import UNAVAILABLE_CAUSE_KEY, UNAVAILABLE_NO_TABLE
from tests.decision_service.harness import Running, start_server, turn2
from tests.decision_service.tables import DEFAULT_KEY, OTHER_KEY, version_of, write_table_file
from tests.support.metrics import sample
from tests.support.tables import synthetic_spec, with_header


async def route_error(running: Running, request: pb.RouteRequest) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await running.stub.Route(request)
    return caught.value


async def test_route_answers_with_provenance(running: Running) -> None:
    response = await running.stub.Route(turn2(request_id="abc"))
    assert response.decision in (pb.DECISION_PD, pb.DECISION_LOCAL)
    assert response.reason != pb.REASON_UNSPECIFIED
    assert response.default_decision in (pb.DECISION_PD, pb.DECISION_LOCAL)
    assert response.request_id == "abc"
    assert response.table_key == DEFAULT_KEY
    assert response.table_version == version_of(DEFAULT_KEY)
    assert response.cell.context_class
    assert response.cell.workload_class
    assert not response.HasField("error")


async def test_turn_one_is_always_pd(running: Running) -> None:
    response = await running.stub.Route(turn2(turn=1, context_tokens=0))
    assert response.decision == pb.DECISION_PD
    assert response.reason == pb.REASON_TURN_ONE


async def test_explicit_table_key_selects_that_table(running: Running) -> None:
    other = write_table_file(running.tables_dir / "2p2d.ppdt", key=OTHER_KEY, seed=11)
    await running.holder.refresh()
    response = await running.stub.Route(turn2(table_key=OTHER_KEY))
    assert (response.table_key, response.table_version) == (OTHER_KEY, other)
    default = await running.stub.Route(turn2())
    assert default.table_key == DEFAULT_KEY


INVALID = {
    "turn_zero": ({"turn": 0}, "turn"),
    "turn_negative": ({"turn": -3}, "turn"),
    "negative_input_tokens": ({"new_input_tokens": -1}, "input"),
    "negative_output_tokens": ({"expected_output_tokens": -5}, "output"),
    "negative_context_tokens": ({"context_tokens": -10}, "context"),
    "absurd_input_tokens": ({"new_input_tokens": 10**12}, "input"),
    "absurd_output_tokens": ({"expected_output_tokens": 10**12}, "output"),
    "absurd_context_tokens": ({"context_tokens": 10**15}, "context"),
    "nan_qps": ({"qps": math.nan}, "qps"),
    "inf_qps": ({"qps": math.inf}, "qps"),
    "negative_qps": ({"qps": -1.0}, "qps"),
    "negative_weight": ({"weights": pb.Weights(w_ttft=-1.0, w_tpot=1.0)}, "weight"),
    "both_weights_zero": ({"weights": pb.Weights(w_ttft=0.0, w_tpot=0.0)}, "weight"),
    "nan_weight": ({"weights": pb.Weights(w_ttft=math.nan, w_tpot=1.0)}, "weight"),
    "unknown_weights_profile": ({"weights_profile": "no-such-profile"}, "no-such-profile"),
}


@pytest.mark.parametrize(("fields", "mentions"), INVALID.values(), ids=list(INVALID))
async def test_bad_input_is_invalid_argument(
    running: Running, fields: dict[str, object], mentions: str
) -> None:
    error = await route_error(running, turn2(**fields))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert mentions in (error.details() or "").lower()


async def test_unknown_table_key_is_not_found_and_names_the_served_keys(running: Running) -> None:
    error = await route_error(running, turn2(table_key="9P9D/nope"))
    assert error.code() == grpc.StatusCode.NOT_FOUND
    details = error.details() or ""
    assert "9P9D/nope" in details
    assert DEFAULT_KEY in details


def _says_no_table(error: grpc.aio.AioRpcError) -> bool:
    trailing = error.trailing_metadata() or ()
    return (UNAVAILABLE_CAUSE_KEY, UNAVAILABLE_NO_TABLE) in [(k, v) for k, v in trailing]


async def test_no_table_loaded_is_unavailable(empty_server: Running) -> None:
    error = await route_error(empty_server, turn2())
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert "no table" in (error.details() or "")
    # The structured signal a gateway acts on (ppd/decision/v1/status.py), beside the message.
    assert _says_no_table(error)
    error = await route_error(empty_server, turn2(table_key=DEFAULT_KEY))
    assert error.code() == grpc.StatusCode.UNAVAILABLE
    assert _says_no_table(error)


async def test_an_unknown_table_key_does_not_say_no_table(running: Running) -> None:
    error = await route_error(running, turn2(table_key="9P9D/nope"))
    assert not _says_no_table(error)


async def test_configured_default_key_missing_is_unavailable(loaded_dir: Path) -> None:
    served = await start_server(loaded_dir, default_key="3P1D/other")
    try:
        error = await route_error(served, turn2())
        assert error.code() == grpc.StatusCode.UNAVAILABLE
        assert "3P1D/other" in (error.details() or "")
        assert _says_no_table(error)
        ok = await served.stub.Route(turn2(table_key=DEFAULT_KEY))
        assert ok.table_key == DEFAULT_KEY
    finally:
        await served.channel.close()
        await served.server.stop(None)


async def test_batch_answers_every_item_in_order_with_per_item_errors(running: Running) -> None:
    request = pb.RouteBatchRequest(
        requests=[
            turn2(request_id="a"),
            turn2(request_id="b", turn=0),
            turn2(request_id="c", table_key="9P9D/nope"),
            turn2(request_id="d", turn=1),
        ]
    )
    response = await running.stub.RouteBatch(request)
    assert [item.request_id for item in response.responses] == ["a", "b", "c", "d"]
    ok, bad, unknown, first = response.responses
    assert not ok.HasField("error")
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "turn" in bad.error.message
    assert unknown.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert first.reason == pb.REASON_TURN_ONE


async def test_empty_batch_is_an_empty_answer(running: Running) -> None:
    response = await running.stub.RouteBatch(pb.RouteBatchRequest())
    assert list(response.responses) == []


async def test_stream_answers_in_order_and_survives_a_bad_message(running: Running) -> None:
    call = running.stub.RouteStream()
    await call.write(turn2(request_id="1"))
    first = await call.read()
    await call.write(turn2(request_id="2", qps=math.nan))
    second = await call.read()
    await call.write(turn2(request_id="3", table_key="9P9D/nope"))
    third = await call.read()
    await call.write(turn2(request_id="4"))
    fourth = await call.read()
    await call.done_writing()
    assert await call.read() == grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    assert isinstance(first, pb.RouteResponse)
    assert isinstance(second, pb.RouteResponse)
    assert isinstance(third, pb.RouteResponse)
    assert isinstance(fourth, pb.RouteResponse)
    assert [m.request_id for m in (first, second, third, fourth)] == ["1", "2", "3", "4"]
    assert not first.HasField("error")
    assert second.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "qps" in second.error.message
    assert third.error.code == grpc.StatusCode.NOT_FOUND.value[0]
    assert not fourth.HasField("error")


async def test_stream_without_tables_answers_unavailable_per_message(empty_server: Running) -> None:
    call = empty_server.stub.RouteStream()
    await call.write(turn2())
    response = await call.read()
    await call.done_writing()
    assert isinstance(response, pb.RouteResponse)
    assert response.error.code == grpc.StatusCode.UNAVAILABLE.value[0]


async def test_describe_table_reports_the_served_keys(running: Running) -> None:
    response = await running.stub.DescribeTable(pb.DescribeTableRequest())
    assert response.table_key == DEFAULT_KEY
    assert response.table_version == version_of(DEFAULT_KEY)
    assert list(response.table_keys) == [DEFAULT_KEY]
    assert response.default_table_key == DEFAULT_KEY
    assert json.loads(response.header_json)


async def test_describe_unknown_key_is_not_found(running: Running) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await running.stub.DescribeTable(pb.DescribeTableRequest(table_key="9P9D/nope"))
    assert caught.value.code() == grpc.StatusCode.NOT_FOUND


async def test_describe_without_tables_is_unavailable(empty_server: Running) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await empty_server.stub.DescribeTable(pb.DescribeTableRequest())
    assert caught.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_describe_table_lists_axes_every_cell_and_profiles(running: Running) -> None:
    response = await running.stub.DescribeTable(pb.DescribeTableRequest(table_key=DEFAULT_KEY))
    assert list(response.context_edges) == [512, 4096]
    assert list(response.context_classes) == ["small", "large", "huge"]
    assert [w.name for w in response.workload_classes][:2] == ["tiny", "short_gen"]
    assert response.workload_classes[0].bench_input_tokens == 16
    assert len(response.qps_levels) == 10
    assert len(response.cells) == 3 * 9 * 10
    assert set(response.weights_profiles) == {"ttft", "tpot", "balanced"}
    assert response.default_weights.w_ttft > 0
    assert 0 < response.success_slo <= 1
    assert response.format_version == 1  # the synthetic table has no BIDIR figures: a version-1 file
    measured = [cell for cell in response.cells if cell.measured]
    unmeasured = [cell for cell in response.cells if not cell.measured]
    assert measured
    assert unmeasured  # the synthetic table has holes (huge contexts were never measured)
    assert all(cell.pd_samples > 0 and cell.pd_ttft_ms > 0 for cell in measured)
    assert all(cell.pd_samples == 0 or cell.local_samples == 0 for cell in unmeasured)
    assert {cell.default_reason for cell in unmeasured} <= {pb.REASON_NEAREST_CELL, pb.REASON_DEFAULT}
    header = json.loads(response.header_json)
    assert header["key"] == DEFAULT_KEY


async def test_describe_agrees_with_route_on_a_cell(running: Running) -> None:
    described = await running.stub.DescribeTable(pb.DescribeTableRequest())
    answer = await running.stub.Route(turn2())
    [cell] = [
        c
        for c in described.cells
        if (c.cell.context_class, c.cell.workload_class, c.cell.qps_level)
        == (answer.cell.context_class, answer.cell.workload_class, answer.cell.qps_level)
    ]
    assert cell.default_decision == answer.default_decision


async def test_weights_profile_and_explicit_weights_are_applied(running: Running) -> None:
    profile = await running.stub.Route(turn2(weights_profile="tpot"))
    explicit = await running.stub.Route(turn2(weights=pb.Weights(w_ttft=0.2, w_tpot=1.0)))
    assert profile.decision == explicit.decision
    assert profile.score == pytest.approx(explicit.score)
    assert profile.reason in (pb.REASON_WEIGHTS, pb.REASON_TABLE)


async def test_live_kv_usage_above_the_limit_turns_local_into_pd(running: Running) -> None:
    local = await running.stub.Route(turn2(weights=pb.Weights(w_ttft=1.0, w_tpot=0.0)))
    assert local.decision == pb.DECISION_LOCAL
    full = await running.stub.Route(
        turn2(weights=pb.Weights(w_ttft=1.0, w_tpot=0.0), live=pb.LiveSignals(decode_kv_usage=0.99))
    )
    assert full.decision == pb.DECISION_PD
    assert full.reason == pb.REASON_LIVE_SIGNAL


async def test_the_answer_says_whether_the_other_path_may_be_explored(running: Running) -> None:
    local = await running.stub.Route(turn2(weights=pb.Weights(w_ttft=1.0, w_tpot=0.0)))
    assert (local.decision, local.alternative_allowed) == (pb.DECISION_LOCAL, True)
    full = await running.stub.Route(
        turn2(weights=pb.Weights(w_ttft=1.0, w_tpot=0.0), live=pb.LiveSignals(decode_kv_usage=0.99))
    )
    assert (full.reason, full.alternative_allowed) == (pb.REASON_LIVE_SIGNAL, False)
    first = await running.stub.Route(turn2(turn=1, context_tokens=0))
    assert first.alternative_allowed is False


async def test_live_decode_load_above_the_tables_limit_turns_local_into_pd(running: Running) -> None:
    spec = with_header(synthetic_spec(shape="3P1D"), max_decode_running=100, max_prefill_queue_depth=4)
    write_table(running.tables_dir / "guarded.ppdt", spec)
    await running.holder.refresh()
    local_weights = pb.Weights(w_ttft=1.0, w_tpot=0.0)

    def ask(live: pb.LiveSignals) -> pb.RouteRequest:
        return turn2(table_key=spec.header.key, weights=local_weights, live=live)

    quiet = await running.stub.Route(ask(pb.LiveSignals(decode_running_requests=100, prefill_queue_depth=0)))
    assert quiet.decision == pb.DECISION_LOCAL
    busy = await running.stub.Route(ask(pb.LiveSignals(decode_running_requests=101, prefill_queue_depth=0)))
    assert (busy.decision, busy.reason) == (pb.DECISION_PD, pb.REASON_LIVE_SIGNAL)
    assert "101" in busy.detail
    p_busier = await running.stub.Route(
        ask(pb.LiveSignals(decode_running_requests=101, prefill_queue_depth=5))
    )
    assert p_busier.decision == pb.DECISION_LOCAL


@pytest.mark.parametrize(
    "live",
    [
        pb.LiveSignals(decode_kv_usage=1.5),
        pb.LiveSignals(prefill_queue_depth=-1),
        pb.LiveSignals(decode_running_requests=-2),
    ],
    ids=["kv_usage_over_1", "negative_queue", "negative_running"],
)
async def test_bad_live_signals_are_invalid_argument(running: Running, live: pb.LiveSignals) -> None:
    error = await route_error(running, turn2(live=live))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT


async def test_an_unexpected_failure_is_internal_and_logged_never_raised(
    running: Running, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    router = running.holder.current.default
    assert router is not None

    def broken(query: object) -> object:
        raise RuntimeError("boom")

    monkeypatch.setattr(type(router), "route", lambda self, query: broken(query))
    error = await route_error(running, turn2(request_id="x1"))
    assert error.code() == grpc.StatusCode.INTERNAL
    batch = await running.stub.RouteBatch(pb.RouteBatchRequest(requests=[turn2(request_id="x2")]))
    assert batch.responses[0].error.code == grpc.StatusCode.INTERNAL.value[0]
    call = running.stub.RouteStream()
    await call.write(turn2(request_id="x3"))
    streamed = await call.read()
    await call.done_writing()
    assert isinstance(streamed, pb.RouteResponse)
    assert streamed.error.code == grpc.StatusCode.INTERNAL.value[0]
    assert "boom" in caplog.text
    assert "x1" in caplog.text


async def test_decisions_and_errors_are_counted(running: Running) -> None:
    await running.stub.Route(turn2(turn=1))
    await route_error(running, turn2(turn=0))
    registry = running.metrics.registry
    assert sample(registry, "ppd_decisions_total", decision="pd", reason="turn_one") == 1
    assert sample(registry, "ppd_route_errors_total", code="INVALID_ARGUMENT") == 1
    assert sample(registry, "ppd_route_latency_seconds_count") == 1


# --- the third path over the wire (issue 17) -------------------------------------------------------

BIDIR_KEY = "1P1D/llama-3.1-8b"


def _write_bidir_table(folder: Path) -> None:
    """A format-2 table where BIDIR halves PD's TTFT at PD's TPOT in (large, mid_bal, 4 QPS) only."""
    from decision_service.table import Figure, TableSpec

    spec = synthetic_spec(shape="1P1D")
    fig = spec.figures.copy()
    fig[1, 5, 3, Figure.BIDIR_TTFT_MS] = fig[1, 5, 3, Figure.LOCAL_TTFT_MS] / 2
    fig[1, 5, 3, Figure.BIDIR_TPOT_MS] = fig[1, 5, 3, Figure.PD_TPOT_MS]
    fig[1, 5, 3, Figure.BIDIR_SUCCESS] = 1.0
    fig[1, 5, 3, Figure.BIDIR_SAMPLES] = 40
    write_table(folder / "1p1d.ppdt", TableSpec(spec.header, fig))


async def test_bidir_only_for_a_request_that_carries_the_capability(running: Running) -> None:
    _write_bidir_table(running.tables_dir)
    await running.holder.refresh()
    plain = await running.stub.Route(
        turn2(table_key=BIDIR_KEY, new_input_tokens=128, expected_output_tokens=128, context_tokens=1000)
    )
    assert plain.decision == pb.DECISION_LOCAL
    capable = turn2(
        table_key=BIDIR_KEY, new_input_tokens=128, expected_output_tokens=128, context_tokens=1000
    )
    capable.capabilities.append(pb.CAPABILITY_BIDIR)
    answer = await running.stub.Route(capable)
    assert (answer.decision, answer.reason, answer.default_decision) == (
        pb.DECISION_BIDIR,
        pb.REASON_TABLE,
        pb.DECISION_BIDIR,
    )
    assert answer.score > plain.score > 0
    assert not answer.alternative_allowed
    assert sample(running.metrics.registry, "ppd_decisions_total", decision="bidir", reason="table") == 1
    # A capability the service does not know (a newer caller) is ignored, not refused.
    capable.capabilities[:] = [pb.CAPABILITY_BIDIR, 7]  # type: ignore[list-item]
    assert (await running.stub.Route(capable)).decision == pb.DECISION_BIDIR


async def test_describe_table_shows_the_bidir_figures(running: Running) -> None:
    _write_bidir_table(running.tables_dir)
    await running.holder.refresh()
    response = await running.stub.DescribeTable(pb.DescribeTableRequest(table_key=BIDIR_KEY))
    assert response.format_version == 2
    assert "bidir_samples" in json.loads(response.header_json)["figures"]
    with_bidir = [c for c in response.cells if c.bidir_samples]
    assert len(with_bidir) == 1
    cell = with_bidir[0]
    assert (cell.cell.context_class, cell.cell.workload_class, cell.cell.qps_level) == (
        "large",
        "mid_bal",
        4.0,
    )
    assert cell.bidir_ttft_ms == cell.local_ttft_ms / 2
    assert cell.bidir_delta_ttft == (cell.pd_ttft_ms - cell.bidir_ttft_ms) / cell.pd_ttft_ms
    assert cell.bidir_delta_tpot == 0.0
    assert (cell.default_decision, cell.bidir_default_decision) == (pb.DECISION_LOCAL, pb.DECISION_BIDIR)
    assert cell.bidir_default_reason == pb.REASON_TABLE
    others = [c for c in response.cells if not c.bidir_samples]
    assert all(c.bidir_default_decision == pb.DECISION_UNSPECIFIED for c in others)
