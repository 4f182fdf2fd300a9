"""The gateway-shared scenario: the real Envoy, round robin, in front of three real `gateway serve`
replicas sharing their sessions on a real redis-server (simulated vLLM workers behind them). The turns
of one conversation land on three different replicas (each turn is seen in exactly one replica's own
request counter) and still go local from Turn 2; with Redis killed mid-conversation no turn fails,
every replica that notices says so once and sets its degraded gauge, and sharing resumes when Redis
is back."""

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
from tests.support.metrics import sample
from tests.support.polling import wait_until
from tests.support.redis_server import RedisServer

pytestmark = pytest.mark.integration

MODEL = "meta-llama/Llama-3.1-8B-Instruct"
REPLICAS = 3
FAILED = "session store: Redis failed"
BACK = "session store: Redis answers again"


@dataclass
class SharedStack:
    envoy: Envoy
    redis: RedisServer
    gateways: dict[int, Announced]  # by port

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.envoy.listeners['gateway']}"

    def metrics(self, port: int) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=30) as resp:
            return str(resp.read().decode())

    def served(self) -> dict[int, float]:
        """Chat completions each replica has answered, from its own /metrics."""
        return {
            port: sample(
                self.metrics(port),
                "ppd_gateway_requests_total",
                {"endpoint": "/v1/chat/completions", "status": "200"},
            )
            or 0.0
            for port in self.gateways
        }

    def degraded(self, port: int) -> float | None:
        return sample(self.metrics(port), "ppd_gateway_session_store_degraded")

    def log_lines(self, port: int, text: str) -> int:
        return sum(text in line for line in self.gateways[port].log.read_text(errors="replace").splitlines())


def gateway_config(workers: list[dict[str, Any]], redis_url: str) -> str:
    # Static `local` mode: Turn 2+ of a session the replica finds goes local; one it cannot find
    # starts over through P -> D. So the path header shows whether the answering replica knew it.
    lines = [
        'mode = "local"', f'served_model = "{MODEL}"', "",
        "[pool]", "health_interval_s = 0.5", "",
        "[sessions]", f'redis_url = "{redis_url}"', "redis_timeout_s = 1.0", "redis_retry_s = 0.2",
    ]  # fmt: skip
    lines += worker_tables(workers)
    return "\n".join(lines) + "\n"


@contextmanager
def shared_stack(tmp_path: Path) -> Iterator[SharedStack]:
    with ExitStack() as exits:
        redis = RedisServer.start()
        exits.callback(redis.close)
        cluster = Announced.start(
            [sys.executable, "-m", "simulator", "cluster", "--topology", "1P2D", "--base-port", "0"],
            log=tmp_path / "cluster.log",
            deadline_s=60,
        )
        exits.callback(cluster.close)
        config = tmp_path / "gateway.toml"
        config.write_text(gateway_config(list(cluster.info["workers"]), redis.url))
        gateways = Announced.start_all(
            [
                ([sys.executable, "-m", "gateway", "serve", "--config", str(config), "--port", "0"],
                 tmp_path / f"gateway{i}.log")
                for i in range(REPLICAS)
            ],
            deadline_s=60,
        )  # fmt: skip
        for gateway in gateways:
            exits.callback(gateway.close)
        by_port = {int(g.info["http"]): g for g in gateways}
        envoy = Envoy.start(
            "gateway-shared", tmp_path / "envoy", cluster="gateway", upstream_ports=list(by_port)
        )
        exits.callback(envoy.close)
        envoy.await_healthy("gateway", set(by_port))
        yield SharedStack(envoy=envoy, redis=redis, gateways=by_port)


def chat(url: str, messages: list[dict[str, str]]) -> tuple[int, dict[str, str], dict[str, Any]]:
    body = {"model": MODEL, "messages": messages, "max_tokens": 16}
    request = urllib.request.Request(
        url + "/v1/chat/completions",
        data=json.dumps(body).encode(),
        headers={"content-type": "application/json"},  # no session header: content-addressed
        method="POST",
    )
    try:
        with urllib.request.urlopen(request, timeout=60) as resp:
            return int(resp.status), {k.lower(): v for k, v in resp.headers.items()}, json.loads(resp.read())
    except urllib.error.HTTPError as err:
        return int(err.code), {k.lower(): v for k, v in err.headers.items()}, json.loads(err.read() or b"{}")


class Conversation:
    """A multi-turn chat through Envoy; each turn notes the one replica whose counter moved."""

    def __init__(self, stack: SharedStack, opening: str) -> None:
        self.stack = stack
        self.messages: list[dict[str, str]] = [{"role": "user", "content": opening}]

    def turn(self, text: str | None = None) -> tuple[dict[str, str], int]:
        if text is not None:
            self.messages.append({"role": "user", "content": text})
        before = self.stack.served()
        status, headers, answer = chat(self.stack.url, self.messages)
        assert status == 200, answer
        self.messages.append({"role": "assistant", "content": answer["choices"][0]["message"]["content"]})
        after = self.stack.served()
        (replica,) = [port for port in after if after[port] != before[port]]
        return headers, replica


def three_turns_on_three_replicas(stack: SharedStack, opening: str) -> None:
    conversation = Conversation(stack, opening)
    first, a = conversation.turn()
    second, b = conversation.turn("And then?")
    third, c = conversation.turn("And after that?")
    assert len({a, b, c}) == 3, "round robin should put each turn on another replica"
    assert first["x-ppd-path"] == "pd"
    # Replicas b and c never served this conversation before: they found its session in Redis,
    # with the decode worker that holds its KV.
    assert (second["x-ppd-path"], second["x-ppd-turn"]) == ("local", "2")
    assert (third["x-ppd-path"], third["x-ppd-turn"]) == ("local", "3")
    assert second["x-ppd-decode-worker"] == first["x-ppd-decode-worker"] == third["x-ppd-decode-worker"]
    assert first["x-ppd-session-id"] == second["x-ppd-session-id"] == third["x-ppd-session-id"]


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SharedStack]:
    with shared_stack(tmp_path_factory.mktemp("gateway-shared")) as shared:
        yield shared


def test_a_conversation_over_three_replicas_goes_local_from_turn_2(stack: SharedStack) -> None:
    three_turns_on_three_replicas(stack, "Tell me about round robin.")
    assert all(stack.degraded(port) == 0 for port in stack.gateways)


def test_verify_script_passes_against_the_live_scenario(stack: SharedStack) -> None:
    env = {
        **os.environ,
        "ENVOY": stack.url.removeprefix("http://"),
        "ADMIN": stack.envoy.admin.removeprefix("http://"),
        "MIN_HEALTHY": str(REPLICAS),
    }
    result = subprocess.run(
        ["bash", str(SCENARIOS / "gateway-shared" / "verify.sh")],
        env=env, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "gateway-shared scenario verified" in result.stdout


def test_redis_killed_mid_conversation_fails_no_turn_and_sharing_resumes(tmp_path: Path) -> None:
    with shared_stack(tmp_path) as stack:
        conversation = Conversation(stack, "Tell me about failures.")
        conversation.turn()
        headers, _ = conversation.turn("Go on.")
        assert headers["x-ppd-path"] == "local"

        stack.redis.kill()
        noticed: set[int] = set()
        for i in range(REPLICAS):
            # Every turn answered (200, asserted in turn()); the replica keeps it in its own memory.
            headers, replica = conversation.turn(f"Still there? ({i})")
            assert headers["x-ppd-path"] in ("pd", "local")
            noticed.add(replica)
        assert noticed == set(stack.gateways)
        for port in stack.gateways:
            assert stack.degraded(port) == 1
            assert stack.log_lines(port, FAILED) == 1  # one line, however many calls failed

        stack.redis.restart()
        wait_until(
            lambda: all(stack.degraded(port) == 0 for port in stack.gateways),
            deadline_s=60,
            what="every replica to share sessions again",
        )
        for port in stack.gateways:
            assert stack.log_lines(port, BACK) == 1
            assert stack.log_lines(port, FAILED) == 1
        three_turns_on_three_replicas(stack, "A new conversation after the outage.")
