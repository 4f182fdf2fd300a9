"""Bad frames on a real server: garbage bytes, unary calls with 0 or 2 messages, a corrupt stream frame,
and RouteBatch's size limit. Raw channels with identity serializers send what no stub would."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any, cast

import grpc
import pytest

from decision_service.holder import TableHolder
from decision_service.metrics import DecisionMetrics
from decision_service.servicer import BATCH_SLICE, DecisionServicer
from ppd.decision.v1 import decision_pb2 as pb
from tests.decision_service.harness import Running, start_server, turn2
from tests.support.metrics import sample

SERVICE = "/ppd.decision.v1.DecisionService/"
GARBAGE = b"\xff" * 12  # field number 0x1fffffff... with a truncated varint: never a valid message


def _identity(raw: bytes) -> bytes:
    return raw


def unary(running: Running, method: str) -> grpc.aio.UnaryUnaryMultiCallable[bytes, bytes]:
    return running.channel.unary_unary(
        SERVICE + method, request_serializer=_identity, response_deserializer=_identity
    )


def client_stream(running: Running, method: str) -> grpc.aio.StreamUnaryMultiCallable[bytes, bytes]:
    return running.channel.stream_unary(
        SERVICE + method, request_serializer=_identity, response_deserializer=_identity
    )


async def refusal(call: Any) -> grpc.aio.AioRpcError:
    with pytest.raises(grpc.aio.AioRpcError) as caught:
        await call
    return caught.value


@pytest.mark.parametrize("method", ["Route", "RouteBatch", "DescribeTable"])
async def test_garbage_is_invalid_argument_with_one_short_line_not_a_traceback(
    running: Running, caplog: pytest.LogCaptureFixture, method: str
) -> None:
    with caplog.at_level(logging.DEBUG):
        for _ in range(20):
            error = await refusal(unary(running, method)(GARBAGE, timeout=20))
            assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "malformed ppd.decision.v1." in (error.details() or "")
    assert "Traceback" not in caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR or r.exc_info]
    lines = [r for r in caplog.records if "malformed" in r.getMessage()]
    assert 1 <= len(lines) < 20  # rate-limited: a client cannot flood the log
    assert "\n" not in lines[0].getMessage()
    assert sample(running.metrics.registry, "ppd_route_errors_total", code="INVALID_ARGUMENT") == 20


async def test_a_unary_call_with_two_messages_is_refused(running: Running) -> None:
    one = turn2().SerializeToString()
    error = await refusal(client_stream(running, "Route")(iter([one, one]), timeout=20))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "more than one message" in (error.details() or "")


async def test_a_unary_call_with_no_message_is_refused_not_left_hanging(running: Running) -> None:
    error = await refusal(client_stream(running, "Route")(iter([]), timeout=20))
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "no request message" in (error.details() or "")


async def test_one_message_through_a_raw_client_stream_is_answered(running: Running) -> None:
    raw = await client_stream(running, "Route")(iter([turn2(request_id="raw").SerializeToString()]))
    assert pb.RouteResponse.FromString(raw).request_id == "raw"


async def test_a_corrupt_frame_in_route_stream_gets_an_error_item_and_the_stream_stays_open(
    running: Running, caplog: pytest.LogCaptureFixture
) -> None:
    call = running.channel.stream_stream(
        SERVICE + "RouteStream", request_serializer=_identity, response_deserializer=_identity
    )()
    answers: list[pb.RouteResponse] = []
    with caplog.at_level(logging.DEBUG):
        for frame in (
            turn2(request_id="1").SerializeToString(),
            GARBAGE,
            turn2(request_id="3").SerializeToString(),
        ):
            await call.write(frame)
            raw = await call.read()
            assert isinstance(raw, bytes)
            answers.append(pb.RouteResponse.FromString(raw))
        await call.done_writing()
        assert await call.read() == grpc.aio.EOF
        assert await call.code() == grpc.StatusCode.OK
    first, bad, third = answers
    assert first.request_id == "1"
    assert not first.HasField("error")
    assert bad.error.code == grpc.StatusCode.INVALID_ARGUMENT.value[0]
    assert "malformed ppd.decision.v1.RouteRequest" in bad.error.message
    assert third.request_id == "3"
    assert not third.HasField("error")
    assert "Traceback" not in caplog.text


async def test_route_batch_beyond_its_limit_is_refused_whole(loaded_dir: Path) -> None:
    served = await start_server(loaded_dir, max_batch_items=8)
    try:
        full = await served.stub.RouteBatch(pb.RouteBatchRequest(requests=[turn2()] * 8))
        assert len(full.responses) == 8
        error = await refusal(served.stub.RouteBatch(pb.RouteBatchRequest(requests=[turn2()] * 9)))
        assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
        details = error.details() or ""
        assert "9 requests" in details
        assert "at most 8" in details
        assert "--max-batch-items" in details
    finally:
        await served.channel.close()
        await served.server.stop(None)


async def test_a_message_above_the_size_limit_is_resource_exhausted(loaded_dir: Path) -> None:
    served = await start_server(loaded_dir, max_message_bytes=4096)
    try:
        big = pb.RouteBatchRequest(requests=[turn2(request_id="x" * 100)] * 100)
        assert big.ByteSize() > 4096
        error = await refusal(served.stub.RouteBatch(big))
        assert error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    finally:
        await served.channel.close()
        await served.server.stop(None)


async def test_a_max_size_batch_hands_the_loop_back_between_slices(
    loaded_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    holder = TableHolder(loaded_dir)
    holder.scan()
    servicer = DecisionServicer(holder, DecisionMetrics(), max_batch_items=4 * BATCH_SLICE)
    turns = 0  # how often another task got the loop
    seen: list[int] = []
    decide = servicer._decide_item

    def observed(request: pb.RouteRequest, tables: Any) -> pb.RouteResponse:
        seen.append(turns)
        return decide(request, tables)

    monkeypatch.setattr(servicer, "_decide_item", observed)
    stop = asyncio.Event()

    async def other_task() -> None:
        nonlocal turns
        while not stop.is_set():
            turns += 1
            await asyncio.sleep(0)

    ticker = asyncio.create_task(other_task())
    await asyncio.sleep(0)
    request = pb.RouteBatchRequest(requests=[turn2(request_id=str(i)) for i in range(4 * BATCH_SLICE)])
    response = await servicer.RouteBatch(request, cast(Any, None))
    stop.set()
    await ticker
    assert [r.request_id for r in response.responses] == [str(i) for i in range(4 * BATCH_SLICE)]
    slices = [seen[i : i + BATCH_SLICE] for i in range(0, len(seen), BATCH_SLICE)]
    assert all(len(set(part)) == 1 for part in slices)  # one slice runs without a break
    assert len({part[0] for part in slices}) == 4  # and the other task ran between every two
