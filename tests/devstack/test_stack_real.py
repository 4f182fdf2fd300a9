"""ppd-up with the real services (simulator cluster, decision service, gateway) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import signal
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from devstack.ready import parse_ready_line
from tests.support.ci import require_tool
from tests.support.metrics import sample, total
from tests.support.otlp_receiver import ReceivedSpan, otlp_receiver
from tests.support.polling import eventually

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TABLES = ROOT / "tables" / "example"


async def _chat(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]) -> tuple[Any, Any]:
    body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": messages, "max_tokens": 16}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers={"X-Session-ID": "t1"}) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers, await resp.json()


@contextlib.asynccontextmanager
async def _ppd_up(
    *args: str, ready_s: float = 150.0, env: dict[str, str] | None = None
) -> AsyncIterator[dict[str, Any]]:
    """ppd-up with the example tables and ``args`` (and ``env`` added to its environment, which every
    child inherits); yields its ready line, then stops it with SIGTERM and checks it exited 0."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "devstack.stack", "--port", "0", "--tables", str(TABLES),
        "--log-level", "WARNING", "--ready-timeout", "110", *args,
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        env=None if env is None else {**os.environ, **env},
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        # A busy CI machine can be slow to start three services: wait generously, and if ppd-up gave
        # up, fail with what it said instead of a JSON error on an empty line.
        async with asyncio.timeout(ready_s):
            line = await proc.stdout.readline()
        if not line:
            assert proc.stderr is not None
            err = await proc.stderr.read()
            pytest.fail(f"ppd-up exited before it was ready: {err.decode()[-2000:]}")
        yield parse_ready_line(line)
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-2000:]


async def test_ppd_up_serves_a_multi_turn_conversation_and_stops_everything_on_sigterm() -> None:
    async with _ppd_up() as ready:
        url = ready["gateway"]
        assert [w["role"] for w in ready["workers"]] == ["prefill", "decode", "decode", "decode"]
        async with aiohttp.ClientSession() as http:
            messages = [{"role": "user", "content": "Tell me about the sea."}]
            headers, answer = await _chat(http, url, messages)
            assert headers["X-PPD-Path"] == "pd"
            assert headers["X-PPD-Reason"]
            messages += [answer["choices"][0]["message"], {"role": "user", "content": "And the rivers?"}]
            headers, _ = await _chat(http, url, messages)
            assert headers["X-PPD-Path"] in ("pd", "local")
            assert headers["X-PPD-Reason"]
    async with aiohttp.ClientSession() as http:
        for worker in ready["workers"]:
            with pytest.raises(aiohttp.ClientConnectionError):
                async with http.get(worker["url"] + "/health") as resp:
                    await resp.read()


async def test_ppd_up_names_the_child_that_failed() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "devstack.stack", "--port", "0", "--topology", "9Z", cwd=ROOT,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    async with asyncio.timeout(120):
        out, err = await proc.communicate()
    assert proc.returncode == 1
    assert out == b""
    assert "simulator cluster: exited with code" in err.decode()
    assert "bad topology" in err.decode()


async def _served(http: aiohttp.ClientSession, gateways: list[str]) -> dict[str, float]:
    """Chat completions each replica answered, from its own /metrics."""
    counts: dict[str, float] = {}
    for url in gateways:
        async with http.get(url + "/metrics") as resp:
            text = await resp.text()
        labels = {"endpoint": "/v1/chat/completions", "status": "200"}
        counts[url] = sample(text, "ppd_gateway_requests_total", labels) or 0.0
    return counts


async def test_ppd_up_with_three_gateways_shares_sessions_behind_envoy_round_robin() -> None:
    require_tool("redis-server", "ppd-up --gateways N starts one (make run installs it)")
    async with _ppd_up("--gateways", "3", ready_s=240.0) as ready:
        gateways = ready["gateways"]
        assert len(gateways) == 3
        assert ready["gateway"] not in gateways  # Envoy's listener
        assert ready["redis"].startswith("unix://")
        async with aiohttp.ClientSession() as http:
            messages = [{"role": "user", "content": "Tell me about the sea."}]
            answered_by = []
            for turn in (1, 2, 3):
                before = await _served(http, gateways)
                body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": messages, "max_tokens": 16}
                async with http.post(f"{ready['gateway']}/v1/chat/completions", json=body) as resp:
                    assert resp.status == 200, await resp.text()
                    headers, answer = resp.headers, await resp.json()
                after = await _served(http, gateways)
                (replica,) = [url for url in gateways if after[url] != before[url]]
                answered_by.append(replica)
                # No session header: the turn count shows the replica found the conversation in Redis.
                assert headers["X-PPD-Turn"] == str(turn)
                messages += [answer["choices"][0]["message"], {"role": "user", "content": "And then?"}]
            assert len(set(answered_by)) == 3
    socket_gone = await asyncio.to_thread(lambda: not Path(ready["redis"].removeprefix("unix://")).exists())
    assert socket_gone  # its scratch folder is gone
    async with aiohttp.ClientSession() as http:
        for url in [ready["gateway"], *gateways]:
            with pytest.raises(aiohttp.ClientConnectionError):
                async with http.get(url + "/health") as resp:
                    await resp.read()


async def _gauge_is(
    http: aiohttp.ClientSession,
    url: str,
    name: str,
    worker: str,
    equal: float | None = None,
    *,
    above: float | None = None,
) -> bool:
    """Whether the gateway's gauge ``name`` for ``worker`` equals ``equal`` (or exceeds ``above``)."""
    async with http.get(url + "/metrics") as resp:
        value = sample(await resp.text(), name, {"worker": worker})
    if value is None:
        return False
    return value == equal if above is None else value > above


async def test_ppd_up_with_kv_events_has_the_gateway_follow_every_workers_kv_cache() -> None:
    async with _ppd_up("--kv-events", "--bidir", "--topology", "1P1D") as ready:
        url = ready["gateway"]
        assert all(w["kv_events"].startswith("tcp://") for w in ready["workers"])
        async with aiohttp.ClientSession() as http:
            for worker in ("P0", "D0"):  # each stream complete once its replay answered
                synced = functools.partial(_gauge_is, http, url, "ppd_gateway_kv_events_synced", worker, 1.0)
                await eventually(
                    synced,
                    timeout_s=60.0,
                    what=f"{worker}'s KV event stream synced",
                )
            messages = [{"role": "user", "content": "Tell me about the sea. " * 40}]
            headers, answer = await _chat(http, url, messages)
            assert headers["X-PPD-Path"] == "pd"
            # D0 holds the conversation's blocks now, and the gateway saw them stored.
            await eventually(
                lambda: _gauge_is(http, url, "ppd_gateway_kv_tracked_blocks", "D0", above=0.0),
                timeout_s=60.0,
                what="blocks tracked on D0",
            )
            messages += [answer["choices"][0]["message"], {"role": "user", "content": "And the rivers?"}]
            headers, _ = await _chat(http, url, messages)
            assert headers["X-PPD-Path"] in ("pd", "local", "bidir")
            assert headers["X-PPD-Reason"] != "kv_evicted"


async def test_ppd_up_with_the_envoy_data_plane_holds_a_conversation_through_envoy() -> None:
    """`--data-plane envoy`: the client URL is Envoy's listener, the picker routes (Turn 1 through P,
    Turn 2 on the session's D in `local` mode), Envoy streams; SIGTERM stops every child."""
    import openai

    async with _ppd_up("--data-plane", "envoy", "--topology", "1P1D", "--mode", "local") as ready:
        url, picker = ready["gateway"], ready["picker"]
        assert ready["data_plane"] == "envoy"
        assert isinstance(picker["grpc"], int)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        async with client:
            messages: list[dict[str, str]] = [{"role": "user", "content": "Tell me about the sea."}]
            paths = []
            for follow_up in ("And the rivers?", None):
                raw = await client.chat.completions.with_raw_response.create(
                    model="meta-llama/Llama-3.1-8B-Instruct",
                    messages=messages,  # type: ignore[arg-type]
                    max_tokens=16,
                )
                paths.append((raw.headers["x-ppd-path"], raw.headers["x-ppd-turn"]))
                answer = raw.parse().choices[0].message.content or ""
                assert answer
                if follow_up:
                    messages += [
                        {"role": "assistant", "content": answer},
                        {"role": "user", "content": follow_up},
                    ]
        assert paths == [("pd", "1"), ("local", "2")]
        # No gateway in this stack: the picker's metrics counted both decisions.
        metrics = f"http://127.0.0.1:{picker['metrics']}/metrics"
        async with aiohttp.ClientSession() as http, http.get(metrics) as resp:
            text = await resp.text()
        assert (total(text, "ppd_gateway_decisions_total", path="local") or 0) >= 1
    async with aiohttp.ClientSession() as http:
        for down in [url, f"http://127.0.0.1:{picker['metrics']}", *(w["url"] for w in ready["workers"])]:
            with pytest.raises(aiohttp.ClientConnectionError):
                async with http.get(down + "/health") as resp:
                    await resp.read()


#: Each front door's span for the whole request, and its service (the picker reads the same [tracing]).
_FRONT_DOORS = {
    "python": ("ppd.gateway.request", "ppd-gateway"),
    "envoy": ("ppd.picker.request", "ppd-picker"),
}


def _trace_of(spans: list[ReceivedSpan], root: str, request_id: str) -> dict[str, list[ReceivedSpan]]:
    """The spans of the trace whose front door's span ``root`` answered ``request_id``, by name (empty:
    none yet)."""
    roots = [s for s in spans if s.name == root and s.attributes.get("ppd.request_id") == request_id]
    if not roots:
        return {}
    trace: dict[str, list[ReceivedSpan]] = {}
    for span in spans:
        if span.trace_id == roots[0].trace_id:
            trace.setdefault(span.name, []).append(span)
    return trace


@pytest.mark.parametrize("data_plane", list(_FRONT_DOORS))
async def test_ppd_up_with_a_tracing_endpoint_traces_each_request_across_every_process(
    data_plane: str,
) -> None:
    """`--tracing-endpoint`, behind each front door: Turn 1's trace holds the front door's span and P's
    and D's `llm_request`; Turn 2's (a decision in ppd mode) the decision service's `ppd.decision.Route`
    and its worker's."""
    root, service = _FRONT_DOORS[data_plane]
    # The batch processors of every child (they inherit ppd-up's environment) export within 0.2 s.
    with otlp_receiver() as otlp:
        async with _ppd_up(
            "--data-plane", data_plane, "--tracing-endpoint", otlp.endpoint,
            env={"OTEL_BSP_SCHEDULE_DELAY": "200"},
        ) as ready:  # fmt: skip
            async with aiohttp.ClientSession() as http:
                messages = [{"role": "user", "content": "Trace me across the stack."}]
                turn1, answer = await _chat(http, ready["gateway"], messages)
                messages += [answer["choices"][0]["message"], {"role": "user", "content": "And again?"}]
                turn2, _ = await _chat(http, ready["gateway"], messages)
            assert (turn1["X-PPD-Path"], turn2["X-PPD-Turn"]) == ("pd", "2")
            # A pd turn has a P and a D leg, each with its worker's span; any other path one worker.
            expected = {
                turn1["X-Request-Id"]: 2,
                turn2["X-Request-Id"]: 2 if turn2["X-PPD-Path"] == "pd" else 1,
            }

            async def exported() -> bool:
                spans = otlp.spans()
                traces = [_trace_of(spans, root, request_id) for request_id in expected]
                return all(
                    len(trace.get("llm_request", [])) == workers
                    for trace, workers in zip(traces, expected.values(), strict=True)
                ) and bool(traces[1].get("ppd.decision.Route"))

            await eventually(exported, timeout_s=60.0, what="both turns' spans from every process")
    spans = otlp.spans()
    first, second = (_trace_of(spans, root, request_id) for request_id in expected)
    assert {s.service for s in first[root] + second[root]} == {service}
    assert {s.service for s in first["llm_request"] + second["llm_request"]} == {"vllm"}
    workers_of = [
        {s.parent_span_id for s in trace["llm_request"]}
        <= {s.span_id for s in trace.get("ppd.prefill", []) + trace["ppd.decode"]}
        for trace in (first, second)
    ]
    assert workers_of == [True, True]  # each worker's span is the child of the front door's leg to it
    (route,) = second["ppd.decision.Route"]
    assert route.service == "ppd-decision"
    assert route.parent_span_id in {s.span_id for s in second["ppd.decision"]}
    assert "ppd.decision.Route" not in first  # Turn 1 always goes P then D: no decision asked
