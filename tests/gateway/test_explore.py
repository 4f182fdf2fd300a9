"""Exploration in the gateway (ppd/explore.py in gateway/forwarding.py): the header, the metric and the
request-log fields; each bound provoked; and with epsilon = 0 the request log exactly as without it."""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import pytest

from gateway.cli import _load
from gateway.deps import Deps
from gateway.forwarding import Forwarder
from gateway.ports import ClientRequest
from gateway.request_log import RequestLog
from gateway.routing import Decision
from gateway.settings import Settings, SettingsError
from ppd.explore import ExploreSettings, explore_draw
from ppd.records import FIELDS
from tests.gateway.conftest import StackFactory
from tests.gateway.fake_decision import FakeDecision
from tests.gateway.fakes import FakeClient, FakeDecisions, ManualClock, forwarder_on_fakes
from tests.support.metrics import sample

MODEL = "example-org/unknown-model"
ONE_D = [
    {"id": "P0", "role": "prefill", "url": "http://p0.test"},
    {"id": "D0", "role": "decode", "url": "http://d0.test"},
]
UNCAPPED = {"max_per_worker_per_s": 1e9}
ALLOWED_LOCAL = Decision("local", "table", table_version="v7", alternative_allowed=True)


def _config(explore: dict[str, Any] | None = None) -> dict[str, Any]:
    config: dict[str, Any] = {"mode": "ppd", "served_model": MODEL, "workers": ONE_D}
    if explore is not None:
        config["explore"] = explore
    return config


def _request(session: str, turn_two: bool) -> ClientRequest:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "tell me about the sea"}]
    if turn_two:
        messages += [
            {"role": "assistant", "content": "hello there"},
            {"role": "user", "content": "and rivers?"},
        ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 8}
    return ClientRequest("chat", json.dumps(body).encode(), {"X-Session-ID": session})


async def _conversation(forwarder: Forwarder, session: str) -> FakeClient:
    """Turn 1 then turn 2 of one conversation; the turn-2 answer."""
    await forwarder.handle(_request(session, False), FakeClient())
    client = FakeClient()
    await forwarder.handle(_request(session, True), client)
    return client


def _explorations(deps: Deps, path: str) -> float:
    return sample(deps.metrics.registry, "ppd_gateway_explorations_total", {"path": path}) or 0.0


async def _log_of(
    tmp_path: Path, name: str, explore: dict[str, Any] | None, decision: Decision = ALLOWED_LOCAL
) -> tuple[bytes, list[FakeClient], Deps]:
    path = tmp_path / f"{name}.jsonl"
    log = RequestLog(str(path))
    forwarder, deps = forwarder_on_fakes(
        _config(explore), decisions=FakeDecisions(decision), clock=ManualClock(), request_log=log
    )
    clients = [await _conversation(forwarder, f"s{i}") for i in range(6)]
    log.close()
    return path.read_bytes(), clients, deps


async def test_epsilon_zero_leaves_the_request_log_byte_for_byte_as_without_exploration(
    tmp_path: Path,
) -> None:
    without, clients, _ = await _log_of(tmp_path, "without", None)
    for i, explore in enumerate(({"epsilon": 0.0}, {"epsilon": 0.0, "seed": 9, **UNCAPPED})):
        off, off_clients, off_deps = await _log_of(tmp_path, f"off{i}", explore)
        assert off == without
        assert [c.headers for c in off_clients] == [c.headers for c in clients]
        assert _explorations(off_deps, "pd") == 0
    lines = [json.loads(line) for line in without.splitlines()]
    assert len(lines) == 12
    assert all(list(line) == list(FIELDS) for line in lines)  # today's schema, nothing added
    assert {line["path"] for line in lines if line["turn"] == 2} == {"local"}
    assert all("X-PPD-Explored" not in c.headers for c in clients)


async def test_an_explored_request_takes_the_other_path_and_is_marked(tmp_path: Path) -> None:
    log, clients, deps = await _log_of(tmp_path, "on", {"epsilon": 1.0, **UNCAPPED})
    for client in clients:
        assert (client.headers["X-PPD-Path"], client.headers["X-PPD-Reason"]) == ("pd", "explore")
        assert client.headers["X-PPD-Explored"] == "1"
        assert client.headers["X-PPD-Prefill-Worker"] == "P0"  # it really went through P
    assert _explorations(deps, "pd") == 6
    assert (
        sample(deps.metrics.registry, "ppd_gateway_decisions_total", {"path": "pd", "reason": "explore"}) == 6
    )
    lines = [json.loads(line) for line in log.splitlines()]
    assert [(line["turn"], line.get("explored"), line.get("propensity")) for line in lines] == [
        (1, None, None),
        (2, True, 1.0),
    ] * 6
    assert list(lines[1]) == [*FIELDS, "explored", "propensity"]


async def test_the_draw_is_seeded_per_session_and_turn_and_chosen_turns_carry_their_propensity(
    tmp_path: Path,
) -> None:
    log, clients, _ = await _log_of(tmp_path, "half", {"epsilon": 0.5, "seed": 3, **UNCAPPED})
    again, _, _ = await _log_of(tmp_path, "again", {"epsilon": 0.5, "seed": 3, **UNCAPPED})
    assert log == again
    later = [json.loads(line) for line in log.splitlines() if json.loads(line)["turn"] == 2]
    assert {line["propensity"] for line in later} == {0.5}
    explored = [line["explored"] for line in later]
    # Six draws at 0.5 under this seed: both outcomes.
    assert True in explored
    assert False in explored
    for line, client in zip(later, clients, strict=True):
        assert line["path"] == ("pd" if line["explored"] else "local")
        assert ("X-PPD-Explored" in client.headers) is line["explored"]


async def test_without_a_seed_each_gateway_draws_a_secret_one(caplog: pytest.LogCaptureFixture) -> None:
    """No explore.seed set: each gateway process draws a random one at start-up and logs that it did
    (never the value), so a client cannot compute from a session id whether its turns explore."""
    explore = {"epsilon": 0.5, **UNCAPPED}
    runs = []
    with caplog.at_level(logging.INFO, logger="gateway.core"):
        for _ in range(2):
            forwarder, _ = forwarder_on_fakes(_config(explore), decisions=FakeDecisions(ALLOWED_LOCAL))
            clients = [await _conversation(forwarder, f"s{i}") for i in range(32)]
            runs.append([c.headers.get("X-PPD-Explored") == "1" for c in clients])
    assert runs[0] != runs[1]  # two gateways disagree (equal by chance: 2**-32)
    assert [explore_draw(0, f"s{i}#2") < 0.5 for i in range(32)] not in runs  # not the seed-0 draw
    told = [r.getMessage() for r in caplog.records if "explore.seed" in r.getMessage()]
    assert len(told) == 2
    assert "random" in told[0]


@pytest.mark.parametrize(
    ("decision", "why"),
    [
        (Decision("local", "table", alternative_allowed=False), "the other path failed the cell's SLO"),
        (Decision("pd", "live_signal", alternative_allowed=True), "a live-signal guard is active"),
        (Decision("pd", "fallback_timeout", fallback=True), "no table answered: a fallback"),
    ],
)
async def test_no_exploration_outside_the_bounds(tmp_path: Path, decision: Decision, why: str) -> None:
    log, clients, deps = await _log_of(tmp_path, "bound", {"epsilon": 1.0, **UNCAPPED}, decision)
    assert all(c.headers["X-PPD-Path"] == decision.path for c in clients), why
    assert all("X-PPD-Explored" not in c.headers for c in clients), why
    assert _explorations(deps, "pd") + _explorations(deps, "local") == 0
    assert all(list(json.loads(line)) == list(FIELDS) for line in log.splitlines())  # propensity 1


async def test_the_cap_per_decode_worker_and_second() -> None:
    clock = ManualClock()
    forwarder, deps = forwarder_on_fakes(
        _config({"epsilon": 1.0, "max_per_worker_per_s": 1.0}),
        decisions=FakeDecisions(ALLOWED_LOCAL),
        clock=clock,
    )
    burst = [await _conversation(forwarder, f"a{i}") for i in range(4)]  # one decode worker, one instant
    assert [c.headers.get("X-PPD-Explored") for c in burst] == ["1", None, None, None]
    assert [c.headers["X-PPD-Path"] for c in burst] == ["pd", "local", "local", "local"]
    clock.advance(1.0)
    later = [await _conversation(forwarder, f"b{i}") for i in range(2)]
    assert [c.headers.get("X-PPD-Explored") for c in later] == ["1", None]
    assert _explorations(deps, "pd") == 2


def test_settings_and_flags() -> None:
    assert Settings().explore == ExploreSettings()
    assert Settings().explore.seed is None  # not set: a secret random seed per process
    s = Settings.from_mapping({"explore": {"epsilon": 0.05, "seed": 7, "max_per_worker_per_s": 2}})
    assert s.explore == ExploreSettings(epsilon=0.05, seed=7, max_per_worker_per_s=2.0)
    for bad, match in (
        ({"epsilon": 2.0}, "epsilon must be within 0..1"),
        ({"seed": -1}, "seed must be an integer"),
        ({"max_per_worker_per_s": -1}, "max_per_worker_per_s"),
        ({"epsilon": "0.1"}, "must be float"),
        ({"rate": 1.0}, "unknown setting 'rate' in \\[explore\\]"),
    ):
        with pytest.raises(SettingsError, match=match):
            Settings.from_mapping({"explore": bad})
    flagged = _load(None, "ppd", None, {"epsilon": 0.2, "seed": 4})
    assert flagged.explore == ExploreSettings(epsilon=0.2, seed=4)
    with pytest.raises(SettingsError, match="epsilon"):
        _load(None, None, None, {"epsilon": 1.5})


async def test_over_http_and_grpc_the_services_word_lets_a_request_explore(make_stack: StackFactory) -> None:
    decision = await FakeDecision(alternative_allowed=True).start()
    try:
        stack = await make_stack(
            mode="ppd",
            decision={"address": decision.address, "deadline_ms": 2000.0},
            explore={"epsilon": 1.0, "max_per_worker_per_s": 100.0},
        )
        messages: list[dict[str, Any]] = [{"role": "user", "content": "hello there"}]
        first = await stack.chat(messages, max_tokens=4)
        messages += [{"role": "assistant", "content": first.text}, {"role": "user", "content": "and then"}]
        second = await stack.chat(messages, max_tokens=4)
        assert (second.path, second.reason, second.headers["X-PPD-Explored"]) == ("pd", "explore", "1")
        decision.alternative_allowed = False
        messages += [{"role": "assistant", "content": second.text}, {"role": "user", "content": "more"}]
        third = await stack.chat(messages, max_tokens=4)
        assert (third.path, third.reason) == ("local", "table")
        assert "X-PPD-Explored" not in third.headers
        text = await (await stack.http.get(stack.url + "/metrics")).text()
        assert sample(text, "ppd_gateway_explorations_total", path="pd") == 1
    finally:
        await decision.stop()
