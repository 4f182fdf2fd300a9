"""The request path (gateway/forwarding.py) on fakes of its seams: no sockets, no clocks of its own.
The same paths through HTTP and real fake workers: test_app_*.py."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import pytest

from gateway.deps import Deps
from gateway.errors import UpstreamStatusError, UpstreamUnreachableError
from gateway.forwarding import Forwarder
from gateway.ports import ClientRequest, JsonReply
from gateway.request_log import RequestLog
from gateway.routing import Decision
from tests.gateway.fakes import (
    KV_PARAMS,
    FakeClient,
    FakeDecisions,
    FakeUpstream,
    ManualClock,
    chunk,
    forwarder_on_fakes,
    sse,
)
from tests.support.metrics import sample

# No exact tokenizer knows this model: n_in is an estimate (or a worker's count).
MODEL = "example-org/unknown-model"
WORKERS = [
    {"id": "P0", "role": "prefill", "url": "http://p0.test"},
    {"id": "D0", "role": "decode", "url": "http://d0.test"},
    {"id": "D1", "role": "decode", "url": "http://d1.test"},
]


def _config(mode: str, **extra: Any) -> dict[str, Any]:
    return {"mode": mode, "served_model": MODEL, "workers": WORKERS, **extra}


def _request(
    messages: list[dict[str, Any]], *, stream: bool = False, headers: dict[str, str] | None = None
) -> ClientRequest:
    body = {"model": MODEL, "messages": messages, "stream": stream, "max_tokens": 8}
    return ClientRequest("chat", json.dumps(body).encode(), headers or {})


FIRST = [{"role": "user", "content": "tell me about the sea"}]


def _second(answer: str) -> list[dict[str, Any]]:
    return [*FIRST, {"role": "assistant", "content": answer}, {"role": "user", "content": "and rivers?"}]


async def _turn(forwarder: Forwarder, request: ClientRequest) -> FakeClient:
    client = FakeClient()
    await forwarder.handle(request, client)
    return client


def _sample(deps: Deps, name: str, **labels: str) -> float:
    value = sample(deps.metrics.registry, name, labels)
    return value if value is not None else 0.0


async def test_turn_one_goes_through_p_then_d_with_ps_kv_params() -> None:
    upstream = FakeUpstream()
    forwarder, deps = forwarder_on_fakes(_config("local"), upstream=upstream)
    client = await _turn(forwarder, _request(FIRST))
    assert client.headers["X-PPD-Path"] == "pd"
    assert client.headers["X-PPD-Reason"] == "turn_one"
    assert client.headers["X-PPD-Prefill-Worker"] == "P0"
    p_call, d_call = upstream.calls
    assert (p_call.worker, p_call.body["max_tokens"], p_call.body["stream"]) == ("P0", 1, False)
    assert d_call.body["kv_transfer_params"] == KV_PARAMS
    assert dict(p_call.headers)["X-Request-Id"] == dict(d_call.headers)["X-Request-Id"]
    assert client.json["choices"][0]["message"]["content"] == "hello there"
    assert _sample(deps, "ppd_gateway_decisions_total", path="pd", reason="turn_one") == 1


async def test_local_mode_sends_turn_two_to_the_sessions_decode_worker_only() -> None:
    upstream = FakeUpstream()
    forwarder, _ = forwarder_on_fakes(_config("local"), upstream=upstream)
    first = await _turn(forwarder, _request(FIRST))
    upstream.calls.clear()
    second = await _turn(forwarder, _request(_second("hello there")))
    assert (second.headers["X-PPD-Path"], second.headers["X-PPD-Reason"]) == ("local", "mode_local")
    assert second.headers["X-PPD-Turn"] == "2"
    assert second.headers["X-PPD-Session-Id"] == first.headers["X-PPD-Session-Id"]
    assert [c.worker for c in upstream.calls] == [first.headers["X-PPD-Decode-Worker"]]
    assert "X-PPD-Prefill-Worker" not in second.headers


async def test_ppd_mode_asks_the_decision_client_with_psi_measured_once() -> None:
    decisions = FakeDecisions(Decision("local", "table", table_version="v7"))
    upstream = FakeUpstream(tokenize_count=42)
    forwarder, deps = forwarder_on_fakes(_config("ppd"), upstream=upstream, decisions=decisions)
    await _turn(forwarder, _request(FIRST))
    assert decisions.queries == []  # turn 1 needs no question
    client = await _turn(
        forwarder, _request(_second("hello there"), headers={"X-PPD-Expected-Output-Tokens": "33"})
    )
    (query,) = decisions.queries
    # n_in from the worker's /tokenize (no exact tokenizer for this model), n_out from the hint,
    # n_ctx from the first turn's usage (10 prompt + 2 completion tokens).
    assert (query.turn, query.psi.n_in.tokens, query.psi.n_in.source) == (2, 42, "worker")
    assert (query.psi.n_out, query.psi.n_ctx) == (33, 12)
    assert [url for url, _ in upstream.posts] == [
        f"http://{client.headers['X-PPD-Decode-Worker'].lower()}.test/tokenize"
    ]
    assert (client.headers["X-PPD-Path"], client.headers["X-PPD-Reason"]) == ("local", "table")
    assert client.headers["X-PPD-Table-Version"] == "v7"
    assert "X-PPD-Fallback" not in client.headers
    assert _sample(deps, "ppd_gateway_token_counts_total", source="worker") == 1


async def test_the_qps_asked_with_counts_conversations_started_not_turns() -> None:
    # Tables index QPS by conversations arriving per second (the benchmark's unit); counting every
    # turn would read this 2-turn traffic at twice its level and pick the wrong column.
    decisions = FakeDecisions(Decision("local", "table", table_version="v7"))
    clock = ManualClock()
    forwarder, _ = forwarder_on_fakes(_config("ppd"), decisions=decisions, clock=clock)
    other = [{"role": "user", "content": "tell me about mountains"}]
    for first in (FIRST, other):
        clock.advance(1.0)
        await _turn(forwarder, _request(first))
    for first in (FIRST, other):
        clock.advance(1.0)
        await _turn(
            forwarder,
            _request(
                [
                    *first,
                    {"role": "assistant", "content": "hello there"},
                    {"role": "user", "content": "and rivers?"},
                ]
            ),
        )
    assert [q.turn for q in decisions.queries] == [2, 2]
    # 2 conversations in the 4 s observed so far (4 requests would read 1.0).
    assert decisions.queries[-1].qps == pytest.approx(2 / 4.0)


async def test_a_fallback_decision_is_marked_in_the_headers() -> None:
    decisions = FakeDecisions(fallback_cause="timeout")
    forwarder, _ = forwarder_on_fakes(_config("ppd", decision={"fallback": "pd"}), decisions=decisions)
    await _turn(forwarder, _request(FIRST))
    client = await _turn(forwarder, _request(_second("hello there")))
    assert (client.headers["X-PPD-Path"], client.headers["X-PPD-Reason"]) == ("pd", "fallback_timeout")
    assert client.headers["X-PPD-Fallback"] == "1"
    assert "X-PPD-Table-Version" not in client.headers


async def test_decode_gone_goes_through_p_to_a_live_d_without_asking_the_service() -> None:
    decisions = FakeDecisions(Decision("local", "table", table_version="v7"))
    upstream = FakeUpstream()
    forwarder, deps = forwarder_on_fakes(_config("ppd"), upstream=upstream, decisions=decisions)
    first = await _turn(forwarder, _request(FIRST))
    gone = first.headers["X-PPD-Decode-Worker"]
    deps.pool.mark_failed(gone)
    upstream.calls.clear()
    client = await _turn(forwarder, _request(_second("hello there")))
    assert decisions.queries == []
    assert (client.headers["X-PPD-Path"], client.headers["X-PPD-Reason"]) == ("pd", "decode_gone")
    assert "X-PPD-Table-Version" not in client.headers
    other = client.headers["X-PPD-Decode-Worker"]
    assert other != gone
    assert [c.worker for c in upstream.calls] == ["P0", other]
    assert _sample(deps, "ppd_gateway_session_rebinds_total") == 1
    # The session now lives on the new D: the next turn goes local there.
    third = await _turn(
        forwarder,
        _request(
            [
                *_second("hello there"),
                {"role": "assistant", "content": "hello there"},
                {"role": "user", "content": "more"},
            ]
        ),
    )
    assert (third.headers["X-PPD-Path"], third.headers["X-PPD-Decode-Worker"]) == ("local", other)


async def test_an_unreachable_decode_worker_is_replanned_once_without_it() -> None:
    upstream = FakeUpstream(unreachable={"D0"})
    forwarder, deps = forwarder_on_fakes(_config("local"), upstream=upstream)
    client = await _turn(forwarder, _request(FIRST))
    reply = (
        client.headers["X-PPD-Path"],
        client.headers["X-PPD-Reason"],
        client.headers["X-PPD-Decode-Worker"],
    )
    assert reply == ("pd", "decode_unreachable", "D1")
    assert [c.worker for c in upstream.calls] == ["P0", "D0", "P0", "D1"]
    assert not deps.pool.is_live("D0")
    errors = _sample(
        deps, "ppd_gateway_upstream_errors_total", worker="D0", role="decode", kind="unreachable"
    )
    assert errors == 1
    assert _sample(deps, "ppd_gateway_retries_total", reason="decode_unreachable") == 1


_NO_RETRIES = {"retry_budget": {"ratio": 0.0, "min_per_s": 0.0}}


async def test_a_replan_past_the_retry_budget_is_the_unreachable_workers_error() -> None:
    upstream = FakeUpstream(unreachable={"D0"})
    forwarder, deps = forwarder_on_fakes(_config("local", **_NO_RETRIES), upstream=upstream)
    with pytest.raises(UpstreamUnreachableError):
        await forwarder.handle(_request(FIRST), FakeClient())
    assert [c.worker for c in upstream.calls] == ["P0", "D0"]  # no re-plan
    assert _sample(deps, "ppd_gateway_retry_budget_exhausted_total", reason="decode_unreachable") == 1
    assert _sample(deps, "ppd_gateway_retries_total", reason="decode_unreachable") == 0


async def test_a_local_prefill_past_the_retry_budget_is_ps_error() -> None:
    upstream = FakeUpstream(failing={"P0"})
    forwarder, deps = forwarder_on_fakes(_config("pd", **_NO_RETRIES), upstream=upstream)
    with pytest.raises(UpstreamStatusError):
        await forwarder.handle(_request(FIRST), FakeClient())
    assert [c.worker for c in upstream.calls] == ["P0"]  # never sent to D
    assert _sample(deps, "ppd_gateway_retry_budget_exhausted_total", reason="prefill_failed") == 1


async def test_a_decode_worker_failing_every_request_is_ejected_and_the_other_serves() -> None:
    upstream = FakeUpstream(failing={"D1"})
    forwarder, deps = forwarder_on_fakes(_config("pd"), upstream=upstream)
    served = []
    for i in range(14):
        client = FakeClient()
        try:
            await forwarder.handle(_request([{"role": "user", "content": f"q{i}"}]), client)
            served.append(client.headers["X-PPD-Decode-Worker"])
        except UpstreamStatusError:
            served.append("error")
    assert served.count("error") == 5  # D1 every other request until its 5th error in a row
    assert served[-4:] == ["D0"] * 4
    reason = "consecutive_errors"
    assert _sample(deps, "ppd_gateway_worker_ejections_total", worker="D1", role="decode", reason=reason) == 1


async def test_a_sessions_unreachable_decode_worker_is_gone_for_the_replan() -> None:
    upstream = FakeUpstream()
    forwarder, _ = forwarder_on_fakes(_config("local"), upstream=upstream)
    first = await _turn(forwarder, _request(FIRST))
    bound = first.headers["X-PPD-Decode-Worker"]
    upstream.unreachable.add(bound)
    client = await _turn(forwarder, _request(_second("hello there")))
    assert (client.headers["X-PPD-Path"], client.headers["X-PPD-Reason"]) == ("pd", "decode_gone")
    assert client.headers["X-PPD-Decode-Worker"] != bound


async def test_every_prefill_failing_prefills_on_the_decode_worker() -> None:
    upstream = FakeUpstream(failing={"P0"})
    forwarder, _ = forwarder_on_fakes(_config("pd"), upstream=upstream)
    client = await _turn(forwarder, _request(FIRST))
    assert (client.headers["X-PPD-Path"], client.headers["X-PPD-Reason"]) == ("local", "prefill_failed")
    assert "kv_transfer_params" not in upstream.calls[-1].body


async def test_a_decode_worker_error_status_is_raised_before_the_answer_starts() -> None:
    upstream = FakeUpstream(failing={"D0", "D1"})
    forwarder, deps = forwarder_on_fakes(_config("local"), upstream=upstream)
    client = FakeClient()
    with pytest.raises(UpstreamStatusError):
        await forwarder.handle(_request(FIRST), client)
    assert client.status is None
    assert _sample(deps, "ppd_gateway_requests_in_flight") == 0


async def test_a_stream_is_relayed_and_timed_on_the_injected_clock() -> None:
    clock = ManualClock()
    upstream = FakeUpstream()
    forwarder, deps = forwarder_on_fakes(_config("local"), upstream=upstream, clock=clock)
    client = await _turn(forwarder, _request(FIRST, stream=True))
    assert client.streamed
    assert client.ended
    assert client.headers["Content-Type"] == "text/event-stream"
    assert client.headers["X-PPD-Path"] == "pd"
    assert client.events[-1] == "[DONE]"
    assert "".join(json.loads(e)["choices"][0]["delta"]["content"] for e in client.events[:-1]) == "hello"
    # The clock never moved: every latency is exactly 0.
    assert _sample(deps, "ppd_gateway_time_to_first_token_seconds_sum", path="pd", turn_class="first") == 0.0
    assert _sample(deps, "ppd_gateway_time_to_first_token_seconds_count", path="pd", turn_class="first") == 1


async def test_a_stream_that_breaks_ends_with_an_error_event() -> None:
    upstream = FakeUpstream(stream_parts=sse(chunk("hel"), done=False), stream_broken_by="ClientPayloadError")
    forwarder, deps = forwarder_on_fakes(_config("local"), upstream=upstream)
    client = await _turn(forwarder, _request(FIRST, stream=True))
    error = json.loads(client.events[-2])["error"]
    assert error["message"].endswith("failed mid-stream: ClientPayloadError")
    assert client.events[-1] == "[DONE]"
    assert _sample(deps, "ppd_gateway_stream_errors_total", cause="upstream") == 1


async def test_a_client_gone_mid_stream_closes_the_upstream() -> None:
    upstream = FakeUpstream(stream_parts=sse(chunk("a"), chunk("b"), chunk("c")))
    forwarder, deps = forwarder_on_fakes(_config("local"), upstream=upstream)
    client = FakeClient(gone_after_writes=1)
    await forwarder.handle(_request(FIRST, stream=True), client)
    assert _sample(deps, "ppd_gateway_stream_errors_total", cause="client_disconnected") == 1
    assert _sample(deps, "ppd_gateway_requests_in_flight") == 0


async def test_a_client_that_leaves_after_the_whole_answer_is_no_disconnect(tmp_path: Path) -> None:
    # The client read [DONE] and closed its connection while the worker had not yet ended its
    # response (aiohttp then cancels the handler): the turn was served in full, and is logged so.
    held = asyncio.Event()
    upstream = FakeUpstream(stream_parts=sse(chunk("a"), chunk("b")), stream_held=held)
    log_path = tmp_path / "requests.jsonl"
    log = RequestLog(str(log_path))
    forwarder, deps = forwarder_on_fakes(_config("local"), upstream=upstream, request_log=log)
    client = FakeClient()
    handler = asyncio.ensure_future(forwarder.handle(_request(FIRST, stream=True), client))
    await held.wait()
    assert client.events[-1] == "[DONE]"
    handler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handler
    log.close()
    (line,) = [json.loads(x) for x in log_path.read_text().splitlines()]
    assert (line["ok"], line["error"]) == (True, None)
    assert _sample(deps, "ppd_gateway_stream_errors_total", cause="client_disconnected") == 0
    assert _sample(deps, "ppd_gateway_requests_in_flight") == 0


class _SlowTokenizer(FakeUpstream):
    """A worker whose /tokenize answers only when `release` is set."""

    def __init__(self) -> None:
        super().__init__(tokenize_count=42)
        self.asked = asyncio.Event()
        self.release = asyncio.Event()

    async def post(self, url: str, body: Mapping[str, Any], headers: Mapping[str, str]) -> JsonReply:
        self.asked.set()
        await self.release.wait()
        return await super().post(url, body, headers)


async def test_a_client_gone_while_a_worker_counts_its_tokens_still_gets_its_request_log_line(
    tmp_path: Path,
) -> None:
    # ppd mode, turn 2, no exact tokenizer: n_in comes from the session's worker's /tokenize, and
    # the client disconnects (aiohttp cancels the handler) while the gateway waits for it.
    upstream = _SlowTokenizer()
    upstream.release.set()
    log_path = tmp_path / "requests.jsonl"
    log = RequestLog(str(log_path))
    forwarder, deps = forwarder_on_fakes(_config("ppd"), upstream=upstream, request_log=log)
    await _turn(forwarder, _request(FIRST))
    upstream.release.clear()
    upstream.calls.clear()
    handler = asyncio.ensure_future(forwarder.handle(_request(_second("hello there")), FakeClient()))
    await upstream.asked.wait()
    handler.cancel()
    with pytest.raises(asyncio.CancelledError):
        await handler
    log.close()
    first, second = [json.loads(line) for line in log_path.read_text().splitlines()]
    assert (first["turn"], first["ok"]) == (1, True)
    assert (second["turn"], second["ok"], second["error"]) == (2, False, "client disconnected")
    assert second["conversation_id"] == first["conversation_id"]
    assert upstream.calls == []  # no worker was asked to serve it
    assert _sample(deps, "ppd_gateway_requests_in_flight") == 0
