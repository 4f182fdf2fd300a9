"""The `ip:port` the picker names for a worker (gateway/destinations.py rules 1-4): IP literals as
they are, names resolved (for real: `localhost`, and a name under the reserved `.invalid` TLD that
never resolves) and kept for the TTL on an injected clock, one lookup shared by concurrent requests.
Through the real Envoy with workers named by host name: tests/deploy/test_envoy_picker_names.py."""

from __future__ import annotations

import asyncio
import ipaddress
import logging

import pytest

from gateway.destinations import Destinations
from gateway.errors import UpstreamUnreachableError
from gateway.own_address import Address


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class CountingResolver:
    """Answers from a table, counting lookups; `gate` holds every lookup until it is set."""

    def __init__(self, answers: dict[str, list[str]]) -> None:
        self.answers = answers
        self.calls: list[str] = []
        self.gate = asyncio.Event()
        self.gate.set()

    async def __call__(self, host: str, port: int) -> list[Address]:
        self.calls.append(host)
        await self.gate.wait()
        if host not in self.answers:
            raise OSError(f"no IP address for {host!r}")
        return [ipaddress.ip_address(a) for a in self.answers[host]]


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        ("http://10.0.0.5:8200", "10.0.0.5:8200"),
        ("http://[fd00::5]:8200/v1", "[fd00::5]:8200"),
        ("http://10.0.0.5", "10.0.0.5:80"),
        ("https://10.0.0.5", "10.0.0.5:443"),
    ],
)
async def test_an_ip_literal_is_its_own_destination_without_a_lookup(url: str, expected: str) -> None:
    resolver = CountingResolver({})
    assert await Destinations(timeout_s=1.0, resolver=resolver).of(url, worker="D0") == expected
    assert resolver.calls == []


async def test_a_name_is_resolved_for_real() -> None:
    dest = await Destinations(timeout_s=5.0).of("http://localhost:8200", worker="D0")
    assert dest == "127.0.0.1:8200"


async def test_a_name_that_does_not_resolve_is_a_502_naming_worker_and_host(
    caplog: pytest.LogCaptureFixture,
) -> None:
    destinations = Destinations(timeout_s=5.0)
    with pytest.raises(UpstreamUnreachableError) as caught:
        await destinations.of("http://vllm-decode-7.nowhere.invalid:8200", worker="D7")
    status, body = caught.value.to_openai_error()
    assert status == 502
    assert "worker D7's host 'vllm-decode-7.nowhere.invalid' does not resolve" in body["error"]["message"]
    assert any("does not resolve" in r.getMessage() for r in caplog.records if r.levelno == logging.WARNING)


async def test_ipv4_is_preferred_and_the_answer_is_kept_for_the_ttl() -> None:
    clock = Clock()
    resolver = CountingResolver({"vllm-decode-0.vllm-decode": ["fd00::7", "10.1.2.3"]})
    destinations = Destinations(timeout_s=1.0, ttl_s=5.0, resolver=resolver, clock=clock)
    url = "http://vllm-decode-0.vllm-decode:8200"
    assert await destinations.of(url, worker="D0") == "10.1.2.3:8200"
    clock.now += 4.9
    assert await destinations.of(url, worker="D0") == "10.1.2.3:8200"
    assert resolver.calls == ["vllm-decode-0.vllm-decode"]
    # The pod was recreated on a new IP: followed once the TTL is over.
    resolver.answers["vllm-decode-0.vllm-decode"] = ["10.1.9.9"]
    clock.now += 0.2
    assert await destinations.of(url, worker="D0") == "10.1.9.9:8200"
    assert len(resolver.calls) == 2


async def test_an_ipv6_only_name_is_bracketed() -> None:
    resolver = CountingResolver({"d6": ["fd00::7"]})
    assert await Destinations(timeout_s=1.0, resolver=resolver).of("http://d6:8200", worker="D0") == (
        "[fd00::7]:8200"
    )


async def test_a_failed_lookup_is_not_kept_and_warned_once_a_minute(caplog: pytest.LogCaptureFixture) -> None:
    clock = Clock()
    resolver = CountingResolver({})
    destinations = Destinations(timeout_s=1.0, resolver=resolver, clock=clock)
    for _ in range(3):
        with pytest.raises(UpstreamUnreachableError):
            await destinations.of("http://d0:8200", worker="D0")
    assert resolver.calls == ["d0"] * 3
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    clock.now += 61.0
    resolver.answers["d0"] = ["10.0.0.9"]
    assert await destinations.of("http://d0:8200", worker="D0") == "10.0.0.9:8200"


async def test_concurrent_requests_share_one_lookup_and_a_cancelled_one_does_not_cancel_it() -> None:
    resolver = CountingResolver({"d0": ["10.0.0.9"]})
    resolver.gate.clear()
    destinations = Destinations(timeout_s=1.0, resolver=resolver)
    waiting = [asyncio.ensure_future(destinations.of("http://d0:8200", worker="D0")) for _ in range(5)]
    await asyncio.sleep(0)
    waiting[0].cancel()  # a client that left while the name was being looked up
    await asyncio.sleep(0)
    resolver.gate.set()
    results = await asyncio.gather(*waiting[1:])
    assert results == ["10.0.0.9:8200"] * 4
    assert waiting[0].cancelled()
    assert resolver.calls == ["d0"]


def test_bad_settings_are_refused() -> None:
    with pytest.raises(ValueError, match="ttl_s"):
        Destinations(timeout_s=0.0)
