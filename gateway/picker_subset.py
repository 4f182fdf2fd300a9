"""The Gateway API Inference Extension's *subset hint*: a gateway may tell the endpoint picker which
endpoints one request may go to (GIE's Endpoint Picker protocol, "Endpoint Subset";
docs/envoy-extproc.md "Subset hints").

Rule 1 (where): `ProcessingRequest.metadata_context.filter_metadata`, namespace
`envoy.lb.subset_hint`, key `x-gateway-destination-endpoint-subset`, read from the request headers
message (Envoy forwards it when the filter's `metadata_options.forwarding_namespaces` lists the
namespace). No such key: no hint, the whole pool.
Rule 2 (the value): a list of strings, or one string; each string may hold a comma list (a
header-to-metadata rule writes one flat string, as GIE's reference picker accepts too). An entry is
`ip:port` (`[v6]:port` for IPv6), or a bare `ip`, which admits every port of that address. An entry
that is neither, or a value of another type, admits nothing and is logged: the hint still binds
(a picker must never route outside a hint it cannot read).
Rule 3 (the match): a worker is inside when the `ip:port` the picker would name for it
(destinations.py, a worker configured by name resolved first) is admitted; a worker whose name does
not resolve is outside. The picker hands the ids inside to the core (core.py rule 4), which chooses
D or R (for a pass-through: any worker) among them only; none live inside is a 503, as the protocol
requires ("none of the endpoints in the list is eligible or the list is empty").
"""

from __future__ import annotations

import ipaddress
import logging
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from typing import Final

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2

from gateway.destinations import Destinations
from gateway.errors import UpstreamUnreachableError
from gateway.pool import WorkerSpec
from gateway.types import Role

__all__ = ["SUBSET_KEY", "SUBSET_NAMESPACE", "SUBSET_SCOPE", "Subset", "subset_hint"]

log = logging.getLogger(__name__)

SUBSET_NAMESPACE: Final = "envoy.lb.subset_hint"
SUBSET_KEY: Final = "x-gateway-destination-endpoint-subset"
#: How a NoWorkerError names a pool narrowed by a hint.
SUBSET_SCOPE: Final = "the gateway's endpoint subset (envoy.lb.subset_hint)"

_Address = ipaddress.IPv4Address | ipaddress.IPv6Address


@dataclass(frozen=True, slots=True)
class Subset:
    """Rule 2: the endpoints a hint admits: exact `(ip, port)` pairs and whole addresses."""

    pairs: frozenset[tuple[_Address, int]]
    hosts: frozenset[_Address]
    text: str  # the hint as sent, for logs

    def admits(self, destination: str) -> bool:
        """Whether `ip:port` (as the picker names a worker) is inside."""
        parsed = _entry(destination)
        if parsed is None or parsed[1] is None:
            return False
        return parsed[0] in self.hosts or (parsed[0], parsed[1]) in self.pairs

    async def inside(
        self, workers: Iterable[WorkerSpec], destinations: Destinations, *, roles: Collection[Role]
    ) -> frozenset[str]:
        """Rule 3: the ids of `workers` of `roles` whose destination is admitted (logged when none)."""
        ids = set()
        for worker in (w for w in workers if w.role in roles):
            try:
                dest = await destinations.of(worker.url, worker=worker.id)
            except UpstreamUnreachableError:  # logged by Destinations; not provably inside
                continue
            if self.admits(dest):
                ids.add(worker.id)
        if not ids:
            log.warning("subset hint %r admits none of the pool's %s workers", self.text, "/".join(roles))
        return frozenset(ids)


def _entry(text: str) -> tuple[_Address, int | None] | None:
    """`ip`, `ip:port` or `[v6]:port` -> (address, port or None); None if it is none of those."""
    text = text.strip()
    try:
        return ipaddress.ip_address(text), None
    except ValueError:
        pass
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 < int(port) < 65536:
        return None
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    elif ":" in host:  # an IPv6 address with a port must be bracketed
        return None
    try:
        return ipaddress.ip_address(host), int(port)
    except ValueError:
        return None


def _strings(value: struct_pb2.Value) -> list[str] | None:
    kind = value.WhichOneof("kind")
    if kind == "string_value":
        return [value.string_value]
    if kind == "list_value" and all(v.WhichOneof("kind") == "string_value" for v in value.list_value.values):
        return [v.string_value for v in value.list_value.values]
    return None


def subset_hint(message: pb.ProcessingRequest) -> Subset | None:
    """Rules 1 and 2: the hint in this message's metadata, or None when it carries none."""
    namespace = message.metadata_context.filter_metadata.get(SUBSET_NAMESPACE)
    if namespace is None or SUBSET_KEY not in namespace.fields:
        return None
    value = namespace.fields[SUBSET_KEY]
    strings = _strings(value)
    if strings is None:
        log.warning("subset hint %s is not a string or a list of strings: it admits no endpoint", value)
        return Subset(frozenset(), frozenset(), str(value))
    pairs: set[tuple[_Address, int]] = set()
    hosts: set[_Address] = set()
    for item in (part for s in strings for part in s.split(",")):
        if not item.strip():
            continue
        parsed = _entry(item)
        if parsed is None:
            log.warning("subset hint entry %r is not ip, ip:port or [ipv6]:port: it admits nothing", item)
        elif parsed[1] is None:
            hosts.add(parsed[0])
        else:
            pairs.add((parsed[0], parsed[1]))
    return Subset(frozenset(pairs), frozenset(hosts), ",".join(strings))
