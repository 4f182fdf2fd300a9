"""The gateway scenario with the real Envoy in front of two real `gateway serve` replicas (and the
simulated vLLM workers behind them): every turn of a conversation reaches the replica that holds
its session, and when that replica is killed the next turn succeeds on the other one, which
rebuilds the session through the PD path."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.envoy_harness import SCENARIOS, Envoy
from tests.deploy.processes import Announced
from tests.support.gateway_config import worker_tables
from tests.support.polling import wait_until

pytestmark = pytest.mark.integration

MODEL = "meta-llama/Llama-3.1-8B-Instruct"


@dataclass
class GatewayStack:
    envoy: Envoy
    gateways: dict[int, Announced]  # by port
    workers: list[dict[str, Any]]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy.listeners['gateway']}"

    def requests_per_replica(self) -> dict[int, int]:
        return {port: host.stats.get("rq_total", 0) for port, host in self.envoy.hosts("gateway").items()}


def gateway_config(workers: list[dict[str, Any]]) -> str:
    # Static `local` mode: Turn 2+ of a known session goes local, a session the replica has never
    # seen starts over through P -> D, so the path header shows where the session lived.
    lines = ['mode = "local"', f'served_model = "{MODEL}"', "", "[pool]", "health_interval_s = 0.5"]
    lines += worker_tables(workers)
    return "\n".join(lines) + "\n"


@contextmanager
def gateway_stack(tmp_path: Path) -> Iterator[GatewayStack]:
    with ExitStack() as exits:
        cluster = Announced.start(
            [sys.executable, "-m", "simulator", "cluster", "--topology", "1P2D", "--base-port", "0"],
            log=tmp_path / "cluster.log",
            deadline_s=60,
        )
        exits.callback(cluster.close)
        workers = list(cluster.info["workers"])
        config = tmp_path / "gateway.toml"
        config.write_text(gateway_config(workers))
        gateways = Announced.start_all(
            [
                ([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", "0"],
                 tmp_path / f"gateway{i}.log")
                for i in range(2)
            ],
            deadline_s=60,
        )  # fmt: skip
        for gateway in gateways:
            exits.callback(gateway.close)
        by_port = {int(g.info["http"]): g for g in gateways}
        envoy = Envoy.start("gateway", tmp_path / "envoy", cluster="gateway", upstream_ports=list(by_port))
        exits.callback(envoy.close)
        envoy.await_healthy("gateway", set(by_port))
        yield GatewayStack(envoy=envoy, gateways=by_port, workers=workers)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[GatewayStack]:
    """Shared by the tests that leave every replica running."""
    with gateway_stack(tmp_path_factory.mktemp("gateway")) as shared:
        yield shared


def chat(
    url: str, session: str, messages: list[dict[str, str]]
) -> tuple[int, dict[str, str], dict[str, Any]]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 16}
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json", "x-session-id": session},
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return int(resp.status), {k.lower(): v for k, v in resp.headers.items()}, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return int(err.code), {k.lower(): v for k, v in err.headers.items()}, json.loads(err.read() or b"{}")


class Conversation:
    """A multi-turn chat through Envoy that keeps its history and notes which replica answered."""

    def __init__(self, stack: GatewayStack, session: str) -> None:
        self.stack = stack
        self.session = session
        self.messages: list[dict[str, str]] = []

    def turn(self, text: str) -> tuple[dict[str, str], int]:
        """Send one user turn; return the provenance headers and the port of the replica that answered."""
        self.messages.append({"role": "user", "content": text})
        before = self.stack.requests_per_replica()
        status, headers, answer = chat(self.stack.url, self.session, self.messages)
        assert status == 200, answer
        self.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        after = self.stack.requests_per_replica()
        (replica,) = [port for port in after if after[port] != before.get(port, 0)]
        return headers, replica


def test_a_conversation_stays_on_one_replica(stack: GatewayStack) -> None:
    conversation = Conversation(stack, "sticky-1")
    headers, first = conversation.turn("Tell me about ring hashing.")
    assert headers["x-ppd-path"] == "pd"
    for i in range(3):
        headers, replica = conversation.turn(f"And then? ({i})")
        assert replica == first
        assert headers["x-ppd-path"] == "local"  # the replica knows the session and its decode worker


def test_killing_the_replica_that_holds_a_conversation_moves_its_next_turn(tmp_path: Path) -> None:
    with gateway_stack(tmp_path) as stack:
        kill_the_holder_mid_conversation(stack)


def kill_the_holder_mid_conversation(stack: GatewayStack) -> None:
    conversation = Conversation(stack, "moves-1")
    _, holder = conversation.turn("Hello there.")
    headers, again = conversation.turn("Still there?")
    assert (again, headers["x-ppd-path"]) == (holder, "local")

    stack.gateways[holder].kill()
    # Envoy has seen the holder's connections close: the next request to it must connect anew,
    # fail, and be retried on the next replica of the ring (or the ring no longer has it).
    wait_until(
        lambda: stack.envoy.hosts("gateway")[holder].stats.get("cx_active", 0) == 0,
        deadline_s=30,
        what="Envoy to notice the killed replica's connections closing",
    )
    headers, survivor = conversation.turn("Are you still with me?")
    assert survivor != holder
    # The survivor never saw this session: it rebuilds it through the PD path, with the whole history.
    assert headers["x-ppd-path"] == "pd"
    headers, again = conversation.turn("Good. One more thing.")
    assert (again, headers["x-ppd-path"]) == (survivor, "local")


def test_verify_script_passes_against_the_live_scenario(stack: GatewayStack) -> None:
    env = {
        **os.environ,
        "ENVOY": stack.url.removeprefix("http://"),
        "ADMIN": stack.envoy.admin.removeprefix("http://"),
        "MIN_HEALTHY": "2",
    }
    result = subprocess.run(
        ["bash", str(SCENARIOS / "gateway" / "verify.sh")],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gateway scenario verified" in result.stdout
