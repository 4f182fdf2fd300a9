"""Whether a worker URL reaches this gateway's own listener or its DecisionService: the admin API refuses
such a registration (the gateway would call itself in a loop, or speak HTTP/1 to a gRPC port).

Rule 1 (addresses, not names): the URL's host is resolved with the event loop's getaddrinfo, bounded by
a timeout, and every address it resolves to is compared, so each spelling that reaches the same socket
is caught (`127.1`, `2130706433`, `0x7f000001`, `[::ffff:127.0.0.1]`, `localhost.`, ...). A host that
does not resolve is refused: the gateway could not reach that worker either.
Rule 2 (what reaches a listener): an IPv4-mapped IPv6 address is its IPv4 address, and connecting to
an unspecified address (`0.0.0.0`, `::`) reaches the loopback address of its family. A listener bound
to one address is reached through that address; a wildcard listener (`0.0.0.0`, `::`) through every
address of this host (a loopback one, or one this host can bind). The DecisionService is known only by
the address the gateway dials, so when that address is on this host, every address of this host on its
port counts as the DecisionService.
"""

from __future__ import annotations

import asyncio
import ipaddress
import socket
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlsplit

from gateway.errors import BadRequestError

__all__ = ["Address", "Listener", "canonical", "grpc_endpoints", "is_local", "refuse_own_services", "resolve"]

Address = ipaddress.IPv4Address | ipaddress.IPv6Address
_GRPC_DEFAULT_PORT = 443
_LOOPBACK = {4: ipaddress.ip_address("127.0.0.1"), 6: ipaddress.ip_address("::1")}


def canonical(text: str) -> Address:
    """The address a connection to `text` actually reaches (rule 2); ValueError if it is none."""
    address = ipaddress.ip_address(text.partition("%")[0])  # no IPv6 scope id
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    return _LOOPBACK[address.version] if address.is_unspecified else address


def is_local(address: Address) -> bool:
    """Whether `address` belongs to this host: loopback, unspecified, or one it can bind."""
    if address.is_loopback or address.is_unspecified:
        return True
    family = socket.AF_INET if address.version == 4 else socket.AF_INET6
    try:
        with socket.socket(family, socket.SOCK_DGRAM) as probe:
            probe.bind((str(address), 0))
    except OSError:
        return False
    return True


@dataclass(frozen=True, slots=True)
class Listener:
    """A socket the gateway listens on, as bound (an unspecified address is a wildcard bind)."""

    address: Address
    port: int

    def reached_by(self, target: Address, port: int) -> bool:
        """Whether connecting to (`target`, `port`) reaches this listener (rule 2)."""
        if port != self.port:
            return False
        if self.address.is_unspecified:
            return is_local(target)
        return canonical(str(target)) == canonical(str(self.address))


async def resolve(host: str, port: int, *, timeout_s: float) -> list[Address]:
    """Every address `host` resolves to (the event loop's getaddrinfo, at most `timeout_s`);
    OSError, TimeoutError or UnicodeError (a name IDNA cannot encode) when it resolves to none."""
    loop = asyncio.get_running_loop()
    infos = await asyncio.wait_for(
        loop.getaddrinfo(host, port, type=socket.SOCK_STREAM, proto=socket.IPPROTO_TCP), timeout_s
    )
    addresses: list[Address] = []
    for info in infos:
        try:
            addresses.append(ipaddress.ip_address(str(info[4][0]).partition("%")[0]))
        except ValueError:
            continue
    if not addresses:
        raise OSError(f"no IP address for {host!r}")
    return addresses


def grpc_endpoints(target: str) -> list[tuple[str, int]]:
    """(host, port) of each address a gRPC target names: `host:port`, `dns:[//authority/]host[:port]`,
    `ipv4:a:p,b:p`, `ipv6:[a]:p`; none for `unix:` targets (443 when no port is given, as gRPC does)."""
    scheme, sep, rest = target.partition(":")
    if scheme in ("unix", "unix-abstract", "vsock"):
        return []
    if scheme in ("ipv4", "ipv6"):
        names = rest.split(",")
    elif scheme == "dns" and sep:
        names = [rest.split("/", 3)[3] if rest.startswith("//") and rest.count("/") >= 3 else rest]
    else:
        names = [target]
    endpoints: list[tuple[str, int]] = []
    for name in names:
        try:
            parts = urlsplit("//" + name)
            port = parts.port
        except ValueError:
            continue
        if parts.hostname:
            endpoints.append((parts.hostname, port or _GRPC_DEFAULT_PORT))
    return endpoints


async def refuse_own_services(
    url: str,
    *,
    own: Iterable[tuple[str, int]],
    decision_address: str,
    timeout_s: float,
) -> None:
    """BadRequestError (param `url`) when the worker `url` does not resolve, or reaches one of the
    gateway's own listeners (`own`: bound host and port, e.g. the configured host and the socket the
    registration arrived on) or the DecisionService at `decision_address` (a gRPC target)."""
    parts = urlsplit(url)
    host = parts.hostname or ""
    port = parts.port or (443 if parts.scheme == "https" else 80)
    try:
        targets = await resolve(host, port, timeout_s=timeout_s)
    except (OSError, TimeoutError, UnicodeError) as exc:
        why = "timed out" if isinstance(exc, TimeoutError) else str(exc) or type(exc).__name__
        raise BadRequestError(f"worker url host {host!r} does not resolve ({why})", param="url") from None
    listeners = await _listeners(own, timeout_s)
    if any(listener.reached_by(target, port) for listener in listeners for target in targets):
        raise BadRequestError("worker url names this gateway's own address", param="url")
    for ds_host, ds_port in grpc_endpoints(decision_address):
        if ds_port != port:
            continue
        try:
            service = await resolve(ds_host, ds_port, timeout_s=timeout_s)
        except (OSError, TimeoutError, UnicodeError):
            continue  # the gateway cannot reach it either: nothing to protect
        if _same_service(targets, service):
            raise BadRequestError("worker url names the DecisionService's gRPC address", param="url")


async def _listeners(own: Iterable[tuple[str, int]], timeout_s: float) -> list[Listener]:
    listeners: list[Listener] = []
    for host, port in own:
        if not host:  # bound to every interface
            listeners += [Listener(ipaddress.IPv4Address(0), port), Listener(ipaddress.IPv6Address(0), port)]
            continue
        try:
            listeners += [Listener(a, port) for a in await resolve(host, port, timeout_s=timeout_s)]
        except (OSError, TimeoutError, UnicodeError):
            continue
    return listeners


def _same_service(targets: Sequence[Address], service: Sequence[Address]) -> bool:
    """Rule 2 for the DecisionService: the same address, or both on this host."""
    reached = {canonical(str(a)) for a in targets}
    if reached & {canonical(str(a)) for a in service}:
        return True
    return any(is_local(a) for a in service) and any(is_local(a) for a in reached)
