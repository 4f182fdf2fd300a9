"""Failure behaviour of the picker scenario through the real Envoy binary (issue 25 item 4, a first
set): each case provoked here, the table of what happens in gateway/README.md ("Failure behaviour").

The module's stack runs the simulated 2P1D cluster in static `local` mode (Turn 1 through P, Turn 2+
on the session's D); the DecisionService and picker-down cases start stacks of their own.
"""

from __future__ import annotations

import json
import socket
from collections.abc import Iterator
from contextlib import ExitStack, closing
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.picker_stack import MODEL, PickerStack, decision_service, http, picker_stack, turn
from tests.deploy.processes import Announced
from tests.support.metrics import total
from tests.support.polling import wait_until

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerStack]:
    with picker_stack(tmp_path_factory.mktemp("picker-failures"), mode="local", topology="2P1D") as running:
        yield running


def _in_flight(stack: PickerStack) -> float:
    status, body = http(stack.picker_metrics + "/metrics")
    assert status == 200
    return total(body, "ppd_gateway_requests_in_flight") or 0.0


def _retries(stack: PickerStack) -> float:
    status, body = http(stack.picker_metrics + "/metrics")
    assert status == 200
    return total(body, "ppd_gateway_prefill_retries_total") or 0.0


def _open_request(stack: PickerStack, body: dict[str, Any]) -> socket.socket:
    """A completion sent through Envoy on a raw socket, so that the test can hang up mid-request."""
    data = json.dumps(body).encode()
    client = socket.create_connection(("127.0.0.1", stack.envoy.listeners["picker"]), timeout=30)
    client.sendall(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: envoy\r\nContent-Type: application/json\r\n"
        b"Content-Length: %d\r\n\r\n%b" % (len(data), data)
    )
    return client


# ---------------------------------------------------------------- 1. the DecisionService down or absent


@pytest.mark.parametrize("service", ["stopped", "absent"])
def test_decision_service_down_or_absent_serves_turn_two_on_the_fallback(
    tmp_path: Path, service: str
) -> None:
    """`ppd` mode: Turn 2 is served on `[decision] fallback` (pd) with X-PPD-Fallback: 1, as by the
    standalone gateway (tests/gateway/test_e2e.py::test_decision_service_stopped_falls_back)."""
    with ExitStack() as exits:
        extra = ["", "[decision]", 'fallback = "pd"', "deadline_ms = 2000.0"]
        decision: Announced | None = None
        if service == "stopped":
            decision = decision_service(tmp_path)
            exits.callback(decision.close)
            extra.append(f'address = "127.0.0.1:{decision.info["grpc"]}"')
        stack = exits.enter_context(picker_stack(tmp_path, mode="ppd", extra=extra))
        if decision is not None:
            decision.close()  # down after the picker connected to it
        messages = [{"role": "user", "content": f"No oracle ({service})."}]
        with stack.client() as client:
            answer, first = turn(client, messages, stream=True)
            assert (first["x-ppd-path"], first["x-ppd-reason"]) == ("pd", "turn_one")
            for n in (2, 3):
                messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"turn {n}"},
                ]
                answer, headers = turn(client, messages, stream=n == 2)
                assert answer
                assert headers["x-ppd-turn"] == str(n)
                assert headers["x-ppd-path"] == "pd"
                assert headers["x-ppd-reason"].startswith("fallback_"), headers["x-ppd-reason"]
                assert headers["x-ppd-fallback"] == "1"
                assert headers["x-ppd-session-id"] == first["x-ppd-session-id"]


# ---------------------------------------------------------------- 2. P failing


def test_a_failing_p_is_retried_on_the_other_then_prefilled_on_d(stack: PickerStack) -> None:
    """A P answering 500: the P leg is retried on the other P; both failing, D prefills locally
    (`policy.prefill_failure = "local"`, X-PPD-Reason: prefill_failed), all through Envoy."""
    try:
        stack.faults("P0", error_rate=1.0)
        with stack.client() as client:
            for i in range(3):
                answer, h = turn(client, [{"role": "user", "content": f"retry {i}"}], stream=i % 2 == 0)
                assert answer
                assert (h["x-ppd-path"], h["x-ppd-prefill-worker"], h["x-ppd-decode-worker"]) == (
                    "pd",
                    "P1",
                    "D0",
                )
            stack.faults("P1", error_rate=1.0)
            for stream in (True, False):
                answer, h = turn(
                    client, [{"role": "user", "content": f"both P down {stream}"}], stream=stream
                )
                assert answer
                assert (h["x-ppd-path"], h["x-ppd-reason"], h["x-ppd-decode-worker"]) == (
                    "local",
                    "prefill_failed",
                    "D0",
                )
                assert "x-ppd-prefill-worker" not in h
    finally:
        stack.faults("P0", error_rate=0.0)
        stack.faults("P1", error_rate=0.0)


# ---------------------------------------------------------------- 3. the client disconnecting


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_disconnecting_while_d_answers_aborts_ds_request(stack: PickerStack, stream: bool) -> None:
    """Envoy carries D's leg: the client hanging up resets Envoy's upstream request, and the worker
    aborts it (as tests/gateway/test_e2e.py::test_client_disconnect_aborts_the_workers_request)."""
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"long, stream={stream}"}],
        "stream": stream,
        "max_tokens": 20000,
    }
    generated = stack.metric("D0", "vllm:generation_tokens_total")
    assert stack.metric("D0", "vllm:num_requests_running") == 0
    with closing(_open_request(stack, body)):
        wait_until(
            lambda: stack.metric("D0", "vllm:num_requests_running") == 1,
            deadline_s=60,
            what="D0 to run the request",
        )
    # The client went away mid-answer; the worker would need minutes to finish 20000 tokens alone.
    wait_until(
        lambda: stack.metric("D0", "vllm:num_requests_running") == 0,
        deadline_s=60,
        what="D0 to abort the request",
    )
    assert stack.metric("D0", "vllm:generation_tokens_total") - generated < 20000


def test_a_client_disconnecting_during_the_p_leg_cancels_it(stack: PickerStack) -> None:
    """Both P slow (added latency far past every deadline here): the picker is in the P leg when the
    client hangs up; Envoy closes the ext_proc stream, gRPC cancels `Process`, and the core's turn
    ends (the picker's in-flight gauge back to 0) long before P could answer or the leg time out."""
    assert _in_flight(stack) == 0
    retries = _retries(stack)
    try:
        stack.faults("P0", added_latency_ms=600_000)
        stack.faults("P1", added_latency_ms=600_000)
        body = {"model": MODEL, "messages": [{"role": "user", "content": "slow P"}], "max_tokens": 8}
        with closing(_open_request(stack, body)):
            wait_until(lambda: _in_flight(stack) == 1, deadline_s=30, what="the picker to be in the P leg")
        wait_until(lambda: _in_flight(stack) == 0, deadline_s=30, what="the picker to cancel the P leg")
    finally:
        stack.faults("P0", added_latency_ms=0)
        stack.faults("P1", added_latency_ms=0)
    assert _retries(stack) == retries  # cancelled, not retried on the other P


# ---------------------------------------------------------------- 4. the picker down


def test_the_picker_down_is_an_immediate_5xx_not_a_hang(tmp_path: Path) -> None:
    """ext_proc fails closed (`failure_mode_allow: false`): with the picker gone, Envoy answers a
    completion at once with 500 (the client's own 30 s timeout would fail a hang) and routes nothing."""
    with picker_stack(tmp_path, mode="local") as stack:
        stack.picker.close()
        p_before = stack.prompt_tokens("P0")
        d_before = stack.prompt_tokens("D0")
        for stream in (True, False):
            body = {"model": MODEL, "messages": [{"role": "user", "content": "anyone?"}], "stream": stream}
            status, _ = http(
                stack.url + "/v1/chat/completions",
                json.dumps(body).encode(),
                {"Content-Type": "application/json"},
            )
            assert status == 500
        assert (stack.prompt_tokens("P0"), stack.prompt_tokens("D0")) == (p_before, d_before)


# ---------------------------------------------------------------- 5. no route timeout


def _find_routes(node: Any) -> Iterator[dict[str, Any]]:
    if isinstance(node, dict):
        if "match" in node and "route" in node:
            yield node
        for value in node.values():
            yield from _find_routes(value)
    elif isinstance(node, list):
        for value in node:
            yield from _find_routes(value)


def test_the_rendered_route_has_no_timeout(stack: PickerStack) -> None:
    """Envoy's default route timeout (15 s) would cut a long answer: the running Envoy's route says 0s
    (no timeout), read back through its admin /config_dump rather than waited out."""
    status, body = stack.envoy.get("/config_dump?resource=static_route_configs")
    assert status == 200
    routes = list(_find_routes(json.loads(body)))
    assert routes
    for route in routes:
        assert route["route"].get("timeout") == "0s", route
