"""The `ip:port` the endpoint picker names for a worker: what Envoy's ORIGINAL_DST cluster connects
to (the `x-gateway-destination-endpoint` header). That cluster resolves no names, but workers are
often configured by name: on Kubernetes the StatefulSet pods `vllm-decode-0.vllm-decode`, whose IP
changes whenever the pod is recreated (deploy/k8s/components/envoy-picker).

Rule 1: a URL whose host is an IP literal is its own destination (no lookup), `[v6]:port` for IPv6.
Rule 2: a host name is resolved with own_address.resolve (the event loop's getaddrinfo, at most
        `timeout_s`: the gateway's `timeouts.connect_s`); the first IPv4 address is used, else the
        first address (a dual-stack pod serves both; a worker bound to 127.0.0.1 is reached through
        `localhost`). The answer is kept for `ttl_s` (5 s), at the cost of one lookup per
        name per `ttl_s` on the request path: a pod recreated on a new IP is followed once the
        cluster DNS answers with it (Kubernetes' default CoreDNS config caches records for up to
        30 s: `ttl 30`, `cache 30`) plus at most `ttl_s`.
Rule 3: requests that need a name while it is being looked up share that one lookup; a request
        cancelled while it waits (its client left) does not cancel the lookup for the others.
Rule 4: a name that does not resolve (or not in time) is an UpstreamUnreachableError (502) naming
        the worker and its host, as a worker refusing connections is for the standalone gateway;
        it is logged (one WARNING per name a minute at most) and nothing is kept, so the next
        request looks again.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Final
from urllib.parse import urlsplit

from gateway.errors import UpstreamUnreachableError
from gateway.own_address import Address, resolve

__all__ = ["DEFAULT_TTL_S", "Destinations", "Resolver", "host_port", "joined"]

log = logging.getLogger(__name__)

DEFAULT_TTL_S: Final = 5.0
_WARN_EVERY_S: Final = 60.0

#: (host, port) -> every address of host, or OSError/TimeoutError/UnicodeError (own_address.resolve).
Resolver = Callable[[str, int], Awaitable[list[Address]]]


def host_port(url: str) -> tuple[str, int]:
    """The host (no brackets) and port of a worker URL (80/443 when the URL names none)."""
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def joined(address: Address | str, port: int) -> str:
    """`ip:port`, or `[ip]:port` for an IPv6 address, as ORIGINAL_DST reads it."""
    text = str(address)
    return f"[{text}]:{port}" if ":" in text else f"{text}:{port}"


def _preferred(addresses: list[Address]) -> Address:
    return next((a for a in addresses if a.version == 4), addresses[0])


class Destinations:
    """Rules 1-4 for one picker process (its cache lives as long as the picker)."""

    def __init__(
        self,
        *,
        timeout_s: float,
        ttl_s: float = DEFAULT_TTL_S,
        resolver: Resolver | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if ttl_s < 0 or timeout_s <= 0:
            raise ValueError(f"ttl_s must be >= 0 and timeout_s > 0, got {ttl_s} and {timeout_s}")
        self._ttl_s = ttl_s
        self._resolve: Resolver = resolver or (lambda host, port: resolve(host, port, timeout_s=timeout_s))
        self._clock = clock
        self._known: dict[str, tuple[float, Address]] = {}  # host -> (expires at, address)
        self._pending: dict[str, asyncio.Future[Address]] = {}
        self._warned: dict[str, float] = {}

    async def of(self, url: str, *, worker: str) -> str:
        """`ip:port` for `worker`'s URL (rules 1-4)."""
        host, port = host_port(url)
        try:
            return joined(ipaddress.ip_address(host), port)
        except ValueError:
            pass
        known = self._known.get(host)
        if known is not None and known[0] > self._clock():
            return joined(known[1], port)
        pending = self._pending.get(host)
        if pending is None:
            pending = asyncio.ensure_future(self._lookup(host, port))
            self._pending[host] = pending
            pending.add_done_callback(lambda done: self._settled(host, done))
        try:
            address = await asyncio.shield(pending)
        except (OSError, TimeoutError, UnicodeError) as exc:
            raise UpstreamUnreachableError(
                f"worker {worker}'s host {host!r} does not resolve to an IP address "
                f"({type(exc).__name__}: {exc})",
                worker=worker,
            ) from exc
        return joined(address, port)

    async def _lookup(self, host: str, port: int) -> Address:
        try:
            address = _preferred(await self._resolve(host, port))
        except (OSError, TimeoutError, UnicodeError) as exc:
            now = self._clock()
            if now - self._warned.get(host, -_WARN_EVERY_S) >= _WARN_EVERY_S:
                self._warned[host] = now
                log.warning("worker host %r does not resolve (%s: %s)", host, type(exc).__name__, exc)
            raise
        self._known[host] = (self._clock() + self._ttl_s, address)
        return address

    def _settled(self, host: str, done: asyncio.Future[Address]) -> None:
        """Rule 3: the lookup is over; its error is read here so that none goes unretrieved when
        every waiter was cancelled."""
        if self._pending.get(host) is done:
            del self._pending[host]
        if not done.cancelled():
            done.exception()
