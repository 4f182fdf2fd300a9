"""Failover of the picker scenario through the real Envoy binary (issue 25 item 4, the rest): fail-open
as a setting, a decode worker gone before its first byte retried on the fallback the picker named, P
timing out or refusing connections, and Envoy's idle health check of the picker. Each case is provoked
here; the failure table is in gateway/README.md ("Failure policy").

A worker "stopped" is the simulator's `down` fault: its port closes and refuses connections, as a
crashed process's would (the simulated cluster is one process). Every stack here is the test's own:
a downed port does not reopen.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import threading
from http.client import HTTPConnection, HTTPException
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.deploy.picker_stack import MODEL, PickerStack, http, picker_stack, turn
from tests.support.metrics import total
from tests.support.polling import wait_until

pytestmark = pytest.mark.integration


def _picker_metric(stack: PickerStack, name: str, **labels: str) -> float:
    status, body = http(stack.picker_metrics + "/metrics")
    assert status == 200
    return total(body, name, **labels) or 0.0


def _refuses(url: str) -> bool:
    """Whether a worker's port refuses connections (closed, as a stopped process's)."""
    parts = urlsplit(url)
    try:
        socket.create_connection((parts.hostname, parts.port), timeout=5).close()
    except ConnectionRefusedError:
        return True
    return False


def _post(stack: PickerStack, content: str, *, stream: bool) -> tuple[int, bytes]:
    body = {"model": MODEL, "messages": [{"role": "user", "content": content}], "stream": stream}
    return http(
        stack.url + "/v1/chat/completions", json.dumps(body).encode(), {"Content-Type": "application/json"}
    )


# ---------------------------------------------------------------- 1. fail-open / fail-closed


@pytest.mark.parametrize("failure_mode", ["closed", "open"])
def test_the_picker_stopped_fails_closed_by_default_and_open_when_set(
    tmp_path: Path, failure_mode: str
) -> None:
    """The picker's process gone: fail-closed (the default) answers 500 and routes nothing; fail-open
    sends the client's body unchanged to a decode worker, which prefills it locally (no P leg, no
    kv_transfer_params: D pulls nothing)."""
    with picker_stack(tmp_path, mode="local", failure_mode=failure_mode) as stack:
        stack.picker.close()
        p_before, d_before = stack.prompt_tokens("P0"), stack.prompt_tokens("D0")
        pulled = stack.prompt_tokens("D0", "external_kv_transfer")
        for stream in (True, False):
            status, answer = _post(stack, f"anyone there? stream={stream}", stream=stream)
            if failure_mode == "closed":
                assert status == 500, answer
                continue
            assert status == 200, answer
            text = answer.decode()
            assert ("data: " in text) if stream else json.loads(text)["choices"][0]["message"]["content"]
        assert stack.prompt_tokens("P0") == p_before
        assert stack.prompt_tokens("D0", "external_kv_transfer") == pulled
        if failure_mode == "closed":
            assert stack.prompt_tokens("D0") == d_before
        else:
            assert stack.prompt_tokens("D0") > d_before


def test_fail_open_carries_a_request_whose_picker_stream_broke_mid_p_leg(tmp_path: Path) -> None:
    """The picker killed while it waits on the P leg (its answer to the body never sent, so nothing
    of it half-applied): with fail-open Envoy sends the original body to D and the client gets D's
    answer, not an error."""
    with picker_stack(tmp_path, mode="local", failure_mode="open") as stack:
        stack.faults("P0", added_latency_ms=600_000)
        d_before = stack.prompt_tokens("D0")
        pulled = stack.prompt_tokens("D0", "external_kv_transfer")
        with stack.client() as client:
            in_p_leg = False

            def kill_in_p_leg() -> bool:
                nonlocal in_p_leg
                if _picker_metric(stack, "ppd_gateway_requests_in_flight") == 1:
                    stack.picker.proc.send_signal(signal.SIGKILL)
                    in_p_leg = True
                return in_p_leg

            killer = threading.Thread(
                target=lambda: wait_until(kill_in_p_leg, deadline_s=30, what="the picker in the P leg")
            )
            killer.start()
            try:
                answer, headers = turn(client, [{"role": "user", "content": "stay with me"}], stream=True)
            finally:
                killer.join()
        assert in_p_leg
        assert answer
        assert "x-ppd-path" not in headers  # nobody routed it: no provenance
        assert stack.prompt_tokens("D0") > d_before
        assert stack.prompt_tokens("D0", "external_kv_transfer") == pulled


# ---------------------------------------------------------------- 2. the session's D gone


def test_the_sessions_d_gone_before_its_first_byte_is_retried_on_the_other_d(tmp_path: Path) -> None:
    """Turn 1 binds a D; that D's port closes, and the picker's pool has not noticed (its health
    checks are an hour apart). Turn 2 (local) is sent by Envoy to the bound D, refused, and retried
    on the fallback D the picker named, which prefills the whole history; the picker rebinds the
    session to it, reports the dead D to its pool, and the provenance headers name the D that
    answered. Turn 3 goes local on the new D."""
    with picker_stack(tmp_path, mode="local", topology="1P2D", health_interval_s=3600) as stack:
        with stack.client() as client:
            messages = [{"role": "user", "content": "Which D am I on?"}]
            answer, first = turn(client, messages, stream=False)
            bound = first["x-ppd-decode-worker"]
            (other,) = {"D0", "D1"} - {bound}
            stack.faults(bound, down=True)
            wait_until(lambda: _refuses(stack.workers[bound]), deadline_s=30, what=f"{bound}'s port to close")
            computed = stack.prompt_tokens(other)
            rebinds = _picker_metric(stack, "ppd_gateway_session_rebinds_total")
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Still?"}]
            answer, second = turn(client, messages, stream=True)
            assert answer
            assert (second["x-ppd-decode-worker"], second["x-ppd-path"]) == (other, "local")
            assert second["x-ppd-reason"] == "decode_unreachable"
            assert (second["x-ppd-turn"], second["x-ppd-session-id"]) == ("2", first["x-ppd-session-id"])
            assert stack.prompt_tokens(other) > computed  # the fallback D prefilled the history
            assert _picker_metric(stack, "ppd_gateway_session_rebinds_total") == rebinds + 1
            assert _picker_metric(stack, "ppd_gateway_upstream_errors_total", worker=bound) >= 1
            messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And now?"}]
            answer, third = turn(client, messages, stream=False)
            assert answer
            assert (third["x-ppd-decode-worker"], third["x-ppd-path"], third["x-ppd-turn"]) == (
                other,
                "local",
                "3",
            )
            assert third["x-ppd-session-id"] == first["x-ppd-session-id"]
        retried = stack.envoy.hosts("workers")
        assert sum(h.stats.get("rq_error", 0) + h.stats.get("cx_connect_fail", 0) for h in retried.values())


def test_a_d_that_drops_the_request_before_answering_is_retried_on_the_other_d(tmp_path: Path) -> None:
    """The session's D reads Turn 2 and drops the connection before answering (the simulator's
    `down_after_requests`; a killed vLLM whose engine process still holds the listening socket does
    the same): nothing reached the client, so Envoy retries on the picker's fallback (retry_on
    `reset`), which answers, and the session is rebound there, as the standalone re-plans."""
    with picker_stack(tmp_path, mode="local", topology="1P2D", health_interval_s=3600) as stack:
        with stack.client() as client:
            messages = [{"role": "user", "content": "Cut me off."}]
            answer, first = turn(client, messages, stream=False)
        bound = first["x-ppd-decode-worker"]
        (other,) = {"D0", "D1"} - {bound}
        stack.faults(bound, down_after_requests=0)
        prompts = stack.prompt_tokens(other)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Hello?"}]
        body = {"model": MODEL, "messages": messages, "max_tokens": 8}
        status, reply = http(
            stack.url + "/v1/chat/completions",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        assert status == 200, reply
        assert stack.prompt_tokens(other) > prompts


def test_a_d_gone_after_its_answer_started_is_never_retried(tmp_path: Path) -> None:
    """D's port closes (open connections dropped) while it streams: no retry once the answer has
    started; the other D never gets the request, and the client's stream ends early."""
    with picker_stack(tmp_path, mode="local", topology="1P2D", health_interval_s=3600) as stack:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "long"}], "stream": True}
        body["max_tokens"] = 20000
        conn = HTTPConnection("127.0.0.1", stack.envoy.listeners["picker"], timeout=30)
        try:
            conn.request(
                "POST", "/v1/chat/completions", json.dumps(body), {"Content-Type": "application/json"}
            )
            response = conn.getresponse()
            assert response.status == 200
            serving = response.getheader("x-ppd-decode-worker")
            assert serving in ("D0", "D1")
            (other,) = {"D0", "D1"} - {serving}
            prompts = stack.prompt_tokens(other)
            assert response.read1(65536)  # the answer has started
            stack.faults(serving, down=True)
            with contextlib.suppress(HTTPException, OSError):
                while response.read1(65536):
                    pass
        finally:
            conn.close()
        assert stack.prompt_tokens(other) == prompts
        assert stack.metric(other, "vllm:num_requests_running") == 0


# ---------------------------------------------------------------- 3. P timing out or refusing


def test_a_p_timing_out_is_retried_on_the_other_then_prefilled_on_d(tmp_path: Path) -> None:
    """`[timeouts] prefill_s` small and P0 stalling: the P leg times out and is retried on P1; both
    stalling, D prefills locally (X-PPD-Reason: prefill_failed), all through Envoy."""
    extra = ["", "[timeouts]", "prefill_s = 5.0"]  # far past a simulated P's answer, even on a busy CI box
    with picker_stack(tmp_path, mode="local", topology="2P1D", extra=extra) as stack:
        stack.faults("P0", added_latency_ms=600_000)
        with stack.client() as client:
            answer, h = turn(client, [{"role": "user", "content": "P0 stalls"}], stream=False)
            assert answer
            assert (h["x-ppd-path"], h["x-ppd-prefill-worker"], h["x-ppd-decode-worker"]) == (
                "pd",
                "P1",
                "D0",
            )
            stack.faults("P1", added_latency_ms=600_000)
            answer, h = turn(client, [{"role": "user", "content": "both stall"}], stream=True)
            assert answer
            assert (h["x-ppd-path"], h["x-ppd-reason"], h["x-ppd-decode-worker"]) == (
                "local",
                "prefill_failed",
                "D0",
            )
        assert _picker_metric(stack, "ppd_gateway_upstream_errors_total", worker="P0", kind="timeout") >= 1


def test_a_p_refusing_connections_is_retried_on_the_other_then_prefilled_on_d(tmp_path: Path) -> None:
    """P0's port closed (its process gone, as far as a client can tell): the P leg goes to P1; both
    closed, D prefills locally (X-PPD-Reason: prefill_failed)."""
    with picker_stack(tmp_path, mode="local", topology="2P1D", health_interval_s=3600) as stack:
        stack.faults("P0", down=True)
        with stack.client() as client:
            answer, h = turn(client, [{"role": "user", "content": "P0 gone"}], stream=False)
            assert answer
            assert (h["x-ppd-path"], h["x-ppd-prefill-worker"]) == ("pd", "P1")
            stack.faults("P1", down=True)
            answer, h = turn(client, [{"role": "user", "content": "both gone"}], stream=True)
            assert answer
            assert (h["x-ppd-path"], h["x-ppd-reason"], h["x-ppd-decode-worker"]) == (
                "local",
                "prefill_failed",
                "D0",
            )


# ---------------------------------------------------------------- 4. Envoy's idle health check


def test_a_stopped_picker_is_marked_unhealthy_by_envoy_without_traffic(tmp_path: Path) -> None:
    """With no requests, Envoy health-checks the picker at `no_traffic_interval` (2 s here, 60 s by
    default): a stopped picker shows unhealthy in admin /clusters within seconds, long before the
    default's two failed checks (two minutes) could."""
    with picker_stack(tmp_path, mode="local") as stack:
        port = int(stack.picker.info["grpc"])
        assert stack.envoy.healthy_ports("picker") == {port}
        stack.picker.close()
        wait_until(
            lambda: stack.envoy.healthy_ports("picker") == set(),
            deadline_s=30,
            what="Envoy to mark the stopped picker unhealthy",
        )
