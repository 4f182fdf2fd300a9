"""ppd-up with the real services (simulator cluster, decision service, gateway) on 127.0.0.1."""

from __future__ import annotations

import asyncio
import signal
import sys
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from devstack.ready import parse_ready_line
from tests.support.ci import require_tool
from tests.support.metrics import sample

pytestmark = pytest.mark.integration

ROOT = Path(__file__).resolve().parents[2]
TABLES = ROOT / "tables" / "example"


async def _chat(http: aiohttp.ClientSession, url: str, messages: list[dict[str, str]]) -> tuple[Any, Any]:
    body = {"model": "meta-llama/Llama-3.1-8B-Instruct", "messages": messages, "max_tokens": 16}
    async with http.post(f"{url}/v1/chat/completions", json=body, headers={"X-Session-ID": "t1"}) as resp:
        assert resp.status == 200, await resp.text()
        return resp.headers, await resp.json()


async def test_ppd_up_serves_a_multi_turn_conversation_and_stops_everything_on_sigterm() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "devstack.stack", "--port", "0", "--tables", str(TABLES),
        "--log-level", "WARNING", "--ready-timeout", "110",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        # A busy CI machine can be slow to start three services: wait generously, and if ppd-up gave
        # up, fail with what it said instead of a JSON error on an empty line.
        async with asyncio.timeout(150):
            line = await proc.stdout.readline()
        if not line:
            assert proc.stderr is not None
            err = await proc.stderr.read()
            pytest.fail(f"ppd-up exited before it was ready: {err.decode()[-2000:]}")
        ready = parse_ready_line(line)
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
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-2000:]
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
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "devstack.stack", "--port", "0", "--tables", str(TABLES), "--gateways", "3",
        "--log-level", "WARNING", "--ready-timeout", "110",
        cwd=ROOT, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    try:
        async with asyncio.timeout(240):
            line = await proc.stdout.readline()
        if not line:
            assert proc.stderr is not None
            err = await proc.stderr.read()
            pytest.fail(f"ppd-up exited before it was ready: {err.decode()[-2000:]}")
        ready = parse_ready_line(line)
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
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGTERM)
        async with asyncio.timeout(60):
            _, err = await proc.communicate()
    assert proc.returncode == 0, err.decode()[-2000:]
    socket_gone = await asyncio.to_thread(lambda: not Path(ready["redis"].removeprefix("unix://")).exists())
    assert socket_gone  # its scratch folder is gone
    async with aiohttp.ClientSession() as http:
        for url in [ready["gateway"], *gateways]:
            with pytest.raises(aiohttp.ClientConnectionError):
                async with http.get(url + "/health") as resp:
                    await resp.read()
