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
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc
import openai
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tests.deploy.envoy_harness import SCENARIOS, Envoy
from tests.deploy.processes import REPO, Announced
from tests.support.gateway_config import worker_tables
from tests.support.metrics import total
from tests.support.polling import wait_until

pytestmark = pytest.mark.integration

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"


@dataclass
class PickerStack:
    envoy: Envoy
    picker: Announced
    workers: dict[str, str]  # id -> url

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy.listeners['picker']}"

    def client(self) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key="unused", max_retries=0)

    def prompt_tokens(self, worker_id: str, source: str | None = None) -> float:
        """The prompt tokens a worker has computed so far, or those of one source (its /metrics:
        external_kv_transfer counts what D pulled from P with P's kv_transfer_params)."""
        with urllib.request.urlopen(self.workers[worker_id] + "/metrics", timeout=10) as resp:
            metrics = resp.read()
        if source is None:
            return total(metrics, "vllm:prompt_tokens_total") or 0.0
        return total(metrics, "vllm:prompt_tokens_by_source_total", source=source) or 0.0


def _http(url: str, body: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(url, data=body, headers=headers or {})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return int(resp.status), bytes(resp.read())
    except urllib.error.HTTPError as err:
        return int(err.code), bytes(err.read())


@contextmanager
def _picker_stack(tmp: Path, *, mode: str, extra: list[str] | None = None) -> Iterator[PickerStack]:
    """The simulated 1P1D cluster, `ppd-gateway picker` on it (in `mode`, plus `extra` config lines)
    and the real Envoy in front, each waited on until ready."""
    with ExitStack() as exits:
        cluster = Announced.start(
            [sys.executable, "-m", "simulator", "cluster", "--topology", "1P1D", "--base-port", "0"],
            log=tmp / "cluster.log",
            deadline_s=60,
        )
        exits.callback(cluster.close)
        workers = list(cluster.info["workers"])
        config = tmp / "gateway.toml"
        lines = [f'mode = "{mode}"', f'served_model = "{MODEL}"', "", "[pool]", "health_interval_s = 0.5"]
        config.write_text("\n".join(lines + worker_tables(workers) + (extra or [])) + "\n")
        picker = Announced.start(
            [sys.executable, "-m", "gateway", "picker", "--config", str(config), "--grpc-port", "0"],
            log=tmp / "picker.log",
            deadline_s=60,
        )
        exits.callback(picker.close)
        metrics = f"http://127.0.0.1:{picker.info['metrics']}"
        wait_until(
            lambda: _http(metrics + "/health")[0] == 200, deadline_s=30, what="the picker to see a live D"
        )
        envoy = Envoy.start(
            "picker",
            tmp / "envoy",
            cluster="unused",
            upstream_ports=[],
            extra={"PICKER_PORT": str(picker.info["grpc"])},
        )
        exits.callback(envoy.close)
        envoy.await_healthy("picker", {int(picker.info["grpc"])})
        yield PickerStack(envoy=envoy, picker=picker, workers={w["id"]: w["url"] for w in workers})


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PickerStack]:
    with _picker_stack(tmp_path_factory.mktemp("picker"), mode="local") as running:
        yield running


def _turn(
    client: openai.OpenAI,
    messages: list[dict[str, str]],
    *,
    stream: bool,
    headers: dict[str, str] | None = None,
) -> tuple[str, dict[str, str]]:
    """One turn; the answer's text and its response headers (lower-case names)."""
    if stream:
        with client.chat.completions.with_streaming_response.create(
            model=MODEL,
            messages=messages,  # type: ignore[arg-type]
            max_tokens=8,
            stream=True,
            extra_headers=headers,
        ) as response:
            text = ""
            for line in response.iter_lines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    for choice in json.loads(line[6:]).get("choices", []):
                        text += choice.get("delta", {}).get("content") or ""
            return text, {k.lower(): v for k, v in response.headers.items()}
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=messages,  # type: ignore[arg-type]
        max_tokens=8,
        extra_headers=headers,
    )
    answer = raw.parse().choices[0].message.content or ""
    return answer, {k.lower(): v for k, v in raw.headers.items()}


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
    answer, first = _turn(client, messages, stream=stream)
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
    answer2, second = _turn(client, messages, stream=stream)
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
        answer, first = _turn(client, messages, stream=False)
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": "Again?"}]
        p_before = stack.prompt_tokens("P0")
        _, second = _turn(client, messages, stream=True, headers=forged)
    assert (second["x-ppd-path"], second["x-ppd-decode-worker"]) == ("local", "D0")
    assert second["x-ppd-session-id"] == first["x-ppd-session-id"]
    assert stack.prompt_tokens("P0") == p_before


def test_a_malformed_body_is_the_gateways_openai_400(stack: PickerStack) -> None:
    status, body = _http(
        stack.url + "/v1/chat/completions", b'{"model": ', {"Content-Type": "application/json"}
    )
    assert status == 400
    error = json.loads(body)["error"]
    assert (error["type"], error["code"]) == ("BadRequestError", 400)
    with stack.client() as client, pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=4)


def test_other_routes_pass_through_to_a_worker(stack: PickerStack) -> None:
    status, body = _http(stack.url + "/v1/models")
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
        _turn(client, [{"role": "user", "content": "count me"}], stream=False)
    status, body = _http(f"http://127.0.0.1:{stack.picker.info['metrics']}/metrics")
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


TABLE = REPO / "tests" / "testdata" / "tables" / "good.ppdt"
TABLE_REASONS = {
    "table",
    "weights",
    "nearest_cell",
    "default",
    "live_signal",
    "pd_failed_in_cell",
    "local_failed_in_cell",
}


def test_ppd_mode_asks_the_real_decision_service_from_turn_two(tmp_path: Path) -> None:
    """`ppd` mode: Turn 1 through P without asking, Turn 2+ as the DecisionService's table says, on
    the session's D when local; the table's version reaches the client through Envoy."""
    tables = tmp_path / "tables"
    tables.mkdir()
    shutil.copy(TABLE, tables / TABLE.name)
    with ExitStack() as exits:
        decision = Announced.start(
            [sys.executable, "-m", "decision_service", "serve", "--tables", str(tables), "--port", "0",
             "--metrics-port", "0"],
            log=tmp_path / "decision.log",
            deadline_s=60,
        )  # fmt: skip
        exits.callback(decision.close)
        extra = ["", "[decision]", f'address = "127.0.0.1:{decision.info["grpc"]}"', "deadline_ms = 10000.0"]
        stack = exits.enter_context(_picker_stack(tmp_path, mode="ppd", extra=extra))
        messages = [{"role": "user", "content": "Tell me about tables."}]
        with stack.client() as client:
            answer, first = _turn(client, messages, stream=True)
            assert (first["x-ppd-path"], first["x-ppd-reason"]) == ("pd", "turn_one")
            for turn in (2, 3):
                messages += [
                    {"role": "assistant", "content": answer},
                    {"role": "user", "content": f"turn {turn}"},
                ]
                answer, headers = _turn(client, messages, stream=True)
                assert headers["x-ppd-turn"] == str(turn)
                assert headers["x-ppd-reason"] in TABLE_REASONS, headers["x-ppd-reason"]
                assert headers["x-ppd-table-version"]
                assert headers["x-ppd-session-id"] == first["x-ppd-session-id"]
                assert headers["x-ppd-decode-worker"] == "D0"
