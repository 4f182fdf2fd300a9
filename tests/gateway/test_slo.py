"""The gateway's SLO controllers (gateway/slo.py): settings, one controller per table key, finished turns
as observations, the weights on every Route request (fakes, then over gRPC), /metrics and /health."""

from __future__ import annotations

import json
import math
from typing import Any

import pytest

from gateway.decision_client import request_from_query
from gateway.metrics import GatewayMetrics
from gateway.ports import ClientRequest, RouteQuery
from gateway.psi import Psi, TokenCount
from gateway.settings import Settings, SettingsError, SloConfig
from gateway.slo import SloControl
from ppd.slo import SloSettings
from tests.gateway.conftest import StackFactory, follow_up
from tests.gateway.fake_decision import FakeDecision
from tests.gateway.fakes import FakeClient, FakeDecisions, ManualClock, forwarder_on_fakes
from tests.support.metrics import sample
from tests.support.polling import eventually

MODEL = "example-org/unknown-model"
WORKERS = [
    {"id": "P0", "role": "prefill", "url": "http://p0.test"},
    {"id": "D0", "role": "decode", "url": "http://d0.test"},
]
# A tick a second, 5 samples make a P99, ×2 steps between 0.25 and 4.
FAST = {
    "ttft_p99_ms": 100.0,
    "interval_s": 1.0,
    "min_samples": 5,
    "step": 1.0,
    "w_tpot_min": 0.25,
    "w_tpot_max": 4.0,
}


# ---------------------------------------------------------------- settings


def test_slo_is_off_by_default() -> None:
    settings = Settings.from_mapping({})
    assert settings.slo == SloConfig()
    assert not settings.slo.controller.enabled
    assert SloControl.from_config(settings.slo, GatewayMetrics(), ManualClock()) is None


def test_the_slo_section_is_read() -> None:
    settings = Settings.from_mapping(
        {"slo": {"tpot_p99_ms": 50, "ttft_p99_ms": 400.5, "window_s": 60, "base_w_tpot": 2, "min_samples": 7}}
    )
    slo = settings.slo
    assert slo.controller == SloSettings(tpot_p99_ms=50.0, ttft_p99_ms=400.5, window_s=60.0, min_samples=7)
    assert isinstance(slo.controller.tpot_p99_ms, float)
    assert (slo.base_w_ttft, slo.base_w_tpot) == (1.0, 2.0)


@pytest.mark.parametrize(
    ("slo", "extra", "match"),
    [
        ({"tpot_p99_ms": "fast"}, {}, "tpot_p99_ms"),
        ({"tpot_p99_ms": True}, {}, "tpot_p99_ms"),
        ({"tpot_p99_ms": -5.0}, {}, "tpot_p99_ms"),
        ({"tpot_p99_ms": 50.0, "window_s": 0.0}, {}, "window_s"),
        ({"tpot_p99_ms": 50.0, "w_tpot_min": 3.0, "w_tpot_max": 2.0}, {}, "w_tpot_min"),
        ({"tpot_p99_ms": 50.0, "hysteresis": 2.0}, {}, "hysteresis"),
        ({"tpot_p99_ms": 50.0, "min_samples": 1.5}, {}, "min_samples"),
        ({"tpot_p99_ms": 50.0, "base_w_tpot": 0.0}, {}, "base_w_tpot"),
        ({"tpot_p99_ms": 50.0, "target": 1.0}, {}, "unknown setting 'target'"),
        ({"tpot_p99_ms": 50.0}, {"decision": {"weights_profile": "ttft"}}, "weights_profile"),
    ],
)
def test_bad_slo_settings_are_refused(slo: dict[str, Any], extra: dict[str, Any], match: str) -> None:
    with pytest.raises(SettingsError, match=match):
        Settings.from_mapping({"slo": slo, **extra})


def test_a_profile_without_slo_targets_is_fine() -> None:
    settings = Settings.from_mapping({"slo": {"window_s": 10.0}, "decision": {"weights_profile": "ttft"}})
    assert settings.decision.weights_profile == "ttft"


# ---------------------------------------------------------------- SloControl


def _control(clock: ManualClock, **slo: Any) -> tuple[SloControl, GatewayMetrics]:
    metrics = GatewayMetrics()
    config = Settings.from_mapping({"slo": {**FAST, **slo}}).slo
    control = SloControl.from_config(config, metrics, clock)
    assert control is not None
    return control, metrics


def _press(control: SloControl, clock: ManualClock, key: str, *, ttft_s: float, seconds: int) -> None:
    for _ in range(seconds * 10):
        clock.advance(0.1)
        control.observe(key, ttft_s=ttft_s, tpot_s=0.01)
        control.weights(key)


def test_one_controller_per_table_key() -> None:
    clock = ManualClock()
    control, _ = _control(clock)
    _press(control, clock, "1P3D/llama", ttft_s=1.0, seconds=3)  # TTFT 10x over: w_tpot down
    states = control.states()
    assert states["1P3D/llama"].w_tpot < 1.0, states
    assert control.weights("2P2D/llama") == (1.0, 1.0), control.states()
    assert list(control.states()) == ["1P3D/llama", "2P2D/llama"]


def test_the_state_is_in_metrics_with_prometheus_names() -> None:
    clock = ManualClock()
    control, metrics = _control(clock, base_w_ttft=0.5)
    r = metrics.registry
    assert sample(r, "ppd_gateway_slo_w_tpot", table_key="default") is None  # no series before use
    _press(control, clock, "", ttft_s=1.0, seconds=3)
    state = control.states()["default"]
    assert sample(r, "ppd_gateway_slo_w_tpot", table_key="default") == state.w_tpot < 1.0, state
    assert sample(r, "ppd_gateway_slo_w_ttft", table_key="default") == 0.5
    assert sample(r, "ppd_gateway_slo_direction", table_key="default") == -1.0, state
    assert sample(r, "ppd_gateway_slo_ttft_p99_seconds", table_key="default") == 1.0
    assert sample(r, "ppd_gateway_slo_tpot_p99_seconds", table_key="default") == 0.01
    clock.advance(3600.0)  # every sample aged out: too few for a P99
    assert math.isnan(sample(r, "ppd_gateway_slo_ttft_p99_seconds", table_key="default") or 0.0)


def test_health_names_the_targets_and_each_tables_state() -> None:
    clock = ManualClock()
    control, _ = _control(clock, tpot_p99_ms=40.0)
    control.weights("")
    doc = control.health()
    assert (doc["tpot_p99_ms"], doc["ttft_p99_ms"]) == (40.0, 100.0)
    assert doc["tables"]["default"]["w_tpot"] == 1.0
    assert doc["tables"]["default"]["reason"] == "too_few_samples"
    json.dumps(doc)


# ---------------------------------------------------------------- the request path (fakes)


def _request(messages: list[dict[str, Any]]) -> ClientRequest:
    body = {"model": MODEL, "messages": messages, "stream": True, "max_tokens": 8}
    return ClientRequest("chat", json.dumps(body).encode(), {})


async def _conversation(forwarder: Any, turns: int) -> None:
    messages: list[dict[str, Any]] = [{"role": "user", "content": "tell me about the sea"}]
    for i in range(turns):
        client = FakeClient()
        await forwarder.handle(_request(messages), client)
        answer = "".join(json.loads(e)["choices"][0]["delta"].get("content", "") for e in client.events[:-1])
        messages += [{"role": "assistant", "content": answer}, {"role": "user", "content": f"more {i}"}]


async def test_route_queries_carry_the_controllers_weights_and_finished_turns_feed_it() -> None:
    clock = ManualClock()
    decisions = FakeDecisions()
    config = {"mode": "ppd", "served_model": MODEL, "workers": WORKERS, "slo": {**FAST, "base_w_tpot": 2.0}}
    forwarder, deps = forwarder_on_fakes(config, decisions=decisions, clock=clock)
    await _conversation(forwarder, 3)
    assert [q.weights for q in decisions.queries] == [(1.0, 2.0), (1.0, 2.0)]
    assert deps.slo is not None
    state = deps.slo.states()["default"]
    assert (state.ttft_samples, state.tpot_samples) == (2, 2), state  # turns 2 and 3 (routed)
    # TTFT far over its target, TPOT room: the next Route request carries a lower w_tpot.
    _press(deps.slo, clock, "", ttft_s=1.0, seconds=2)
    await _conversation(forwarder, 2)
    w_ttft, w_tpot = decisions.queries[-1].weights or (0.0, 0.0)
    assert (w_ttft, w_tpot) == (1.0, deps.slo.states()["default"].w_tpot), deps.slo.states()
    assert w_tpot < 2.0, deps.slo.states()


async def test_without_targets_route_queries_carry_no_weights() -> None:
    decisions = FakeDecisions()
    config = {
        "mode": "ppd",
        "served_model": MODEL,
        "workers": WORKERS,
        "decision": {"weights_profile": "ttft"},
    }
    forwarder, deps = forwarder_on_fakes(config, decisions=decisions)
    await _conversation(forwarder, 2)
    assert deps.slo is None
    assert [(q.weights, q.weights_profile) for q in decisions.queries] == [(None, "ttft")]


def test_the_route_request_has_weights_only_when_the_query_does() -> None:
    psi = Psi(n_in=TokenCount(10, "exact"), n_out=5, n_ctx=100)
    plain = request_from_query(RouteQuery(request_id="r", turn=2, psi=psi, qps=1.0))
    assert not plain.HasField("weights")
    weighted = request_from_query(RouteQuery(request_id="r", turn=2, psi=psi, qps=1.0, weights=(0.5, 3.0)))
    assert (weighted.weights.w_ttft, weighted.weights.w_tpot) == (0.5, 3.0)


# ---------------------------------------------------------------- the app, over gRPC


async def test_the_app_sends_the_weights_and_shows_the_state(
    make_stack: StackFactory, decision: FakeDecision
) -> None:
    # Any real TTFT is over a 1 ns target and TPOT has no target: w_tpot falls each tick.
    slo = {"ttft_p99_ms": 1e-6, "min_samples": 1, "interval_s": 1e-9, "window_s": 3600.0, "base_w_tpot": 2.0}
    stack = await make_stack(
        mode="ppd", decision={"address": decision.address, "deadline_ms": 2000.0}, slo=slo
    )
    control = stack.deps.slo
    assert control is not None

    async def observed(adjustments: int, samples: int) -> None:
        # The turn's report runs once its answer has ended: wait for it, not for the client's read.
        async def seen() -> bool:
            state = control.states().get("default")
            return state is not None and (state.adjustments, state.ttft_samples) == (adjustments, samples)

        await eventually(seen, what=f"{adjustments} moves and {samples} samples")

    # Turn 1 is no sample (always P/D: the weights do not route it; gateway/slo.py rule 4). Turn 2's
    # Route finds no sample (no move); turn 2 is one. Turn 3's Route moves w_tpot (one step down) and
    # empties the window; turn 3 arrived before that move, so it is no sample (ppd/slo.py rule 4).
    # Turn 4's Route finds no sample (no move); turn 4 arrived after the move: one sample.
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello there"}]
    reply = await stack.chat(messages, stream=True, max_tokens=6)
    for moves, samples, then in ((0, 1, "and then"), (1, 0, "and after"), (1, 1, "and last")):
        follow_up(messages, reply, then)
        reply = await stack.chat(messages, stream=True, max_tokens=6)
        await observed(moves, samples)
    weights = [(q.weights.w_ttft, q.weights.w_tpot) for q in decision.seen]
    assert weights == [(1.0, 2.0), (1.0, 2.0 / 1.25), (1.0, 2.0 / 1.25)], weights
    health = await (await stack.http.get(stack.url + "/health")).json()
    table = health["slo"]["tables"]["default"]
    assert (table["ttft_samples"], table["adjustments"], table["reason"]) == (1, 1, "too_few_samples"), health
    assert health["slo"]["ttft_p99_ms"] == 1e-6
    text = await (await stack.http.get(stack.url + "/metrics")).text()
    assert sample(text, "ppd_gateway_slo_w_tpot", table_key="default") == table["w_tpot"]
    assert (sample(text, "ppd_gateway_slo_ttft_p99_seconds", table_key="default") or 0.0) > 0


async def test_the_app_without_targets_sends_no_weights_and_has_no_slo_in_health(
    make_stack: StackFactory, decision: FakeDecision
) -> None:
    stack = await make_stack(mode="ppd", decision={"address": decision.address, "deadline_ms": 2000.0})
    messages: list[dict[str, Any]] = [{"role": "user", "content": "hello there"}]
    reply = await stack.chat(messages)
    follow_up(messages, reply, "and then")
    await stack.chat(messages)
    assert [q.HasField("weights") for q in decision.seen] == [False]
    assert "slo" not in await (await stack.http.get(stack.url + "/health")).json()
