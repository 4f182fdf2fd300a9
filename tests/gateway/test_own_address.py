"""Whether a worker URL reaches the gateway itself or its DecisionService: resolved addresses, what a
connection to each reaches, and every spelling of a gRPC target (the admin API's end: test_admin.py)."""

from __future__ import annotations

import ipaddress

import pytest

from gateway.errors import BadRequestError
from gateway.own_address import Listener, canonical, grpc_endpoints, refuse_own_services

TEST_NET = "192.0.2.1"  # RFC 5737: never an address of this host


def _ip(text: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    return ipaddress.ip_address(text)


@pytest.mark.parametrize(
    ("target", "port", "bound", "expected"),
    [
        ("127.0.0.1", 8000, "127.0.0.1", True),
        ("127.0.0.1", 8001, "127.0.0.1", False),
        ("0.0.0.0", 8000, "127.0.0.1", True),  # connecting to 0.0.0.0 reaches loopback
        ("::ffff:127.0.0.1", 8000, "127.0.0.1", True),
        ("127.0.0.2", 8000, "127.0.0.1", False),  # another loopback address: another socket
        ("::1", 8000, "127.0.0.1", False),
        ("127.0.0.2", 8000, "0.0.0.0", True),  # a wildcard bind listens on every local address
        ("::1", 8000, "::", True),
        (TEST_NET, 8000, "0.0.0.0", False),
        (TEST_NET, 8000, TEST_NET, True),
    ],
)
def test_what_reaches_a_listener(target: str, port: int, bound: str, expected: bool) -> None:
    assert Listener(_ip(bound), 8000).reached_by(_ip(target), port) is expected


def test_canonical_addresses() -> None:
    assert canonical("::ffff:7f00:1") == _ip("127.0.0.1")
    assert canonical("0.0.0.0") == _ip("127.0.0.1")
    assert canonical("::") == _ip("::1")
    assert canonical("fe80::1%eth0") == _ip("fe80::1")


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("127.0.0.1:50051", [("127.0.0.1", 50051)]),
        ("decision:50051", [("decision", 50051)]),
        ("dns:///ppd-decision-headless:50051", [("ppd-decision-headless", 50051)]),
        ("dns://8.8.8.8/svc.example:7", [("svc.example", 7)]),
        ("dns:svc.example:7", [("svc.example", 7)]),
        ("ipv4:127.0.0.1:1,10.0.0.2:2", [("127.0.0.1", 1), ("10.0.0.2", 2)]),
        ("ipv6:[::1]:9", [("::1", 9)]),
        ("svc.example", [("svc.example", 443)]),
        ("unix:///tmp/decision.sock", []),
        ("", []),
    ],
)
def test_grpc_targets(target: str, expected: list[tuple[str, int]]) -> None:
    assert grpc_endpoints(target) == expected


async def test_the_scheme_gives_the_default_port() -> None:
    own = [("127.0.0.1", 443)]
    with pytest.raises(BadRequestError, match="own address"):
        await refuse_own_services("https://localhost/v1", own=own, decision_address="", timeout_s=2.0)
    await refuse_own_services("http://localhost", own=own, decision_address="", timeout_s=2.0)


async def test_a_name_idna_cannot_encode_does_not_resolve() -> None:
    with pytest.raises(BadRequestError, match="does not resolve"):
        await refuse_own_services(
            "http://" + "a" * 80 + ".example:9", own=[], decision_address="", timeout_s=2.0
        )
