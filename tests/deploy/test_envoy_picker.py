"""The picker scenario (deploy/envoy/picker): the real Envoy in front of the simulated 1P1D cluster,
`ppd-gateway picker` as its ext_proc endpoint picker, driven by the official `openai` client. Envoy
carries D's leg and streams the answer; the picker runs the P leg and says where D's leg goes.

The gateway runs in static `local` mode (Turn 1 through P, Turn 2+ on the session's D): these tests
are about the front door, not the decision (the DecisionService is not asked in that mode); one
test runs `ppd` mode with the real DecisionService.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.deploy.envoy_harness import SCENARIOS
from tests.deploy.picker_stack import (
    MODEL,
    TABLE_REASONS,
    PickerStack,
    decision_service,
    http,
    picker_stack,
    turn,
)
from tests.support.metrics import total

pytestmark = pytest.mark.integration

SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerStack]:
    with picker_stack(tmp_path_factory.mktemp("picker"), mode="local") as running:
        yield running


@pytest.mark.parametrize("stream", [True, False])
def test_turn_one_goes_through_p_and_turn_two_stays_on_the_sessions_d(
    stack: PickerStack, stream: bool
) -> None:
    with stack.client() as client:
        _two_turns(stack, client, stream=stream)


def _two_turns(stack: PickerStack, client: openai.OpenAI, *, stream: bool) -> None:
    messages = [{"role": "user", "content": f"Tell me about Envoy (stream={stream})."}]
    p_before = stack.prompt_tokens("P0")
    pulled_before = stack.prompt_tokens("D0", "external_kv_transfer")
    answer, first = turn(client, messages, stream=stream)
    assert answer
    assert (first["x-ppd-path"], first["x-ppd-reason"], first["x-ppd-turn"]) == ("pd", "turn_one", "1")
    assert (first["x-ppd-prefill-worker"], first["x-ppd-decode-worker"]) == ("P0", "D0")
    assert first["x-request-id"]
    p_after_one = stack.prompt_tokens("P0")
    assert p_after_one > p_before  # the picker ran the P leg
    # D got P's kv_transfer_params in the body Envoy carried (the picker's body, Content-Length fixed).
    assert stack.prompt_tokens("D0", "external_kv_transfer") > pulled_before

    # The next turn carries the answer the picker never saw: found by the longest stored prefix.
    messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "And then?"}]
    answer2, second = turn(client, messages, stream=stream)
    assert answer2
    assert (second["x-ppd-path"], second["x-ppd-turn"]) == ("local", "2")
    assert second["x-ppd-session-id"] == first["x-ppd-session-id"]
    assert second["x-ppd-decode-worker"] == "D0"
    assert "x-ppd-prefill-worker" not in second
    assert stack.prompt_tokens("P0") == p_after_one  # Turn 2 never reached P


def test_a_clients_routing_headers_are_stripped_and_never_trusted(stack: PickerStack) -> None:
    """A Turn 2 (local: D only) that names P as its destination still reaches D alone."""
    messages = [{"role": "user", "content": "Where does this go?"}]
    p_url = stack.workers["P0"].removeprefix("http://")
    forged = {"x-gateway-destination-endpoint": p_url, "x-prefiller-host-port": p_url}
    with stack.client() as client:
        answer, first = turn(client, messages, stream=False)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Again?"}]
        p_before = stack.prompt_tokens("P0")
        _, second = turn(client, messages, stream=True, headers=forged)
    assert (second["x-ppd-path"], second["x-ppd-decode-worker"]) == ("local", "D0")
    assert second["x-ppd-session-id"] == first["x-ppd-session-id"]
    assert stack.prompt_tokens("P0") == p_before


def test_a_malformed_body_is_the_gateways_openai_400(stack: PickerStack) -> None:
    status, body = http(
        stack.url + "/v1/chat/completions", b'{"model": ', {"Content-Type": "application/json"}
    )
    assert status == 400
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("BadRequestError", 400)
    with stack.client() as client, pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)


def test_other_routes_pass_through_to_a_worker(stack: PickerStack) -> None:
    status, body = http(stack.url + "/v1/models")
    assert status == 200
    assert json.loads(body)["data"][0]["id"] == MODEL


def test_the_pickers_health_is_serving(stack: PickerStack) -> None:
    with grpc.insecure_channel(f"127.0.0.1:{stack.picker.info['grpc']}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        for name in ("", "liveness", "readiness", SERVICE):
            reply = health.Check(health_pb2.HealthCheckRequest(service=name), timeout=10)
            assert reply.status == health_pb2.HealthCheckResponse.SERVING, name
    assert stack.envoy.healthy_ports("picker") == {int(stack.picker.info["grpc"])}


def test_the_pickers_metrics_count_its_decisions(stack: PickerStack) -> None:
    with stack.client() as client:
        turn(client, [{"role": "user", "content": "count me"}], stream=False)
    status, body = http(f"http://127.0.0.1:{stack.picker.info['metrics']}/metrics")
    assert status == 200
    assert (total(body, "ppd_gateway_decisions_total", path="pd", reason="turn_one") or 0) >= 1


def test_verify_script_passes_against_the_live_scenario(stack: PickerStack) -> None:
    env = {
        **os.environ,
        "ENVOY": stack.url.removeprefix("http://"),
        "ADMIN": stack.envoy.admin.removeprefix("http://"),
    }
    result = subprocess.run(
        ["bash", str(SCENARIOS / "picker" / "verify.sh")],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "picker scenario verified" in result.stdout


def test_ppd_mode_asks_the_real_decision_service_from_turn_two(tmp_path: Path) -> None:
    """`ppd` mode: Turn 1 through P without asking, Turn 2+ as the DecisionService's table says, on
    the session's D when local; the table's version reaches the client through Envoy."""
    with ExitStack() as exits:
        decision = decision_service(tmp_path)
        exits.callback(decision.close)
        extra = ["", "[decision]", f'address = "127.0.0.1:{decision.info["grpc"]}"', "deadline_ms = 10000.0"]
        stack = exits.enter_context(picker_stack(tmp_path, mode="ppd", extra=extra))
        messages = [{"role": "user", "content": "Tell me about tables."}]
        with stack.client() as client:
            answer, first = turn(client, messages, stream=True)
            assert (first["x-ppd-path"], first["x-ppd-reason"]) == ("pd", "turn_one")
            for n in (2, 3):
                messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"turn {n}"},
                ]
                answer, headers = turn(client, messages, stream=True)
                assert headers["x-ppd-turn"] == str(n)
                assert headers["x-ppd-reason"] in TABLE_REASONS, headers["x-ppd-reason"]
                assert headers["x-ppd-table-version"]
                assert headers["x-ppd-session-id"] == first["x-ppd-session-id"]
                assert headers["x-ppd-decode-worker"] == "D0"
