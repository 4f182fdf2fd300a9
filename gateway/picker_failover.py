"""The picker's answer to a worker gone before its first byte (issue 25 item 4): it names a fallback
worker after the chosen one, Envoy retries there, and the session follows the worker that answered.
Envoy's side (the override_host LB policy, the route's retry policy, the served-endpoint metadata) is
in deploy/envoy/picker/envoy.yaml; docs/envoy-extproc.md has the protocol facts.

Rule 1: the destination is the GIE protocol's ordered list `ip:port,ip:port`: the chosen worker, then
the least loaded other live worker of its role (a decode worker for pd, local and bidir, a replica for
replica), or the chosen worker alone when there is no other. Envoy's override_host policy takes them
in order, one per attempt; the route retries `connect-failure` and `reset` once: the connection
refused, or dropped before the worker answered (as the standalone re-plans), never after the answer
started.
Rule 2: the same body serves on the fallback: P's `kv_transfer_params` name P, not D (docs/vllm-protocol.md),
so a fallback D pulls from the same P; a local turn (no params) is prefilled on the fallback D from its
whole history.
Rule 3: Envoy reports the endpoint of its last attempt as `envoy.lb` dynamic metadata,
`x-gateway-destination-endpoint-served` (the policy's `selected_host_key`, forwarded to the picker with
the response headers). When it is the fallback, the chosen worker failed before its first byte: it is
counted unreachable and marked down in the pool (as the standalone gateway does, core.py rule 3).
Rule 4: when the fallback answered (a status below 500), the turn is remembered again on it (the
session rebound, `ppd_gateway_session_rebinds_total`) and the provenance headers name it, with reason
`decode_unreachable` (`replica_unreachable` for a replica). A 5xx (the fallback failed too, and Envoy's
own 503 reads the same) rebinds nothing: the turn stays as routed.
A session store failing to rebind is logged; the answer goes on.
Rule 4b: the answer's status is the outcome of the worker that served it (the chosen one when Envoy
names none): a 5xx counts as its failure, anything else as answered (core.py rule 9: passive outlier
detection ejects a worker that keeps failing, so the picker stops naming it).
Rule 5: no served metadata (an Envoy not configured to report it), or an address that is neither of the
two named, leaves the turn as it was routed.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Mapping
from dataclasses import dataclass
from typing import Final, Protocol

from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

from gateway.core import ROLE_OF, ActiveTurn, DecodeLeg, RequestCore
from gateway.errors import UpstreamUnreachableError
from gateway.turn_report import provenance_headers

__all__ = ["SERVED_KEY", "Address", "Failover", "answered", "served_endpoint"]

log = logging.getLogger(__name__)


class Address(Protocol):
    """A worker URL's `ip:port` (gateway/destinations.py `Destinations.of`)."""

    def __call__(self, url: str, *, worker: str) -> Awaitable[str]: ...


#: The `envoy.lb` metadata key where Envoy's override_host policy writes the endpoint it picked.
SERVED_KEY: Final = "x-gateway-destination-endpoint-served"
_NAMESPACE: Final = "envoy.lb"


def _status(headers: pb.HttpHeaders) -> int:
    """The response's `:status`; 0 (read as not served) when it is missing or not a number."""
    for header in headers.headers.headers:
        if header.key == ":status":
            raw = header.raw_value.decode("ascii", "replace") or header.value
            return int(raw) if raw.isdigit() else 0
    return 0


def served_endpoint(message: pb.ProcessingRequest) -> str | None:
    """Rule 3: the `ip:port` Envoy says answered, from a message's forwarded metadata; None if absent."""
    namespaces = message.metadata_context.filter_metadata
    if _NAMESPACE not in namespaces:
        return None
    value = namespaces[_NAMESPACE].fields.get(SERVED_KEY)
    if value is None or value.WhichOneof("kind") != "string_value":
        return None
    return value.string_value or None


@dataclass(slots=True)
class Failover:
    """One routed turn's destinations (rule 1) and what to do when the fallback answered (rule 3)."""

    core: RequestCore
    active: ActiveTurn
    leg: DecodeLeg
    # ip:port -> worker id, the chosen worker first.
    candidates: Mapping[str, str]
    provenance: Mapping[str, str]

    @classmethod
    async def plan(
        cls, core: RequestCore, active: ActiveTurn, leg: DecodeLeg, chosen: str, address: Address
    ) -> Failover:
        """Rule 1, from the request's pool view: `chosen` is the chosen worker's `ip:port`; `address`
        gives another worker's (destinations.py). A fallback whose name does not resolve is left out."""
        candidates = {chosen: leg.call.worker}
        for other in active.view.ranked(ROLE_OF[leg.plan.path], exclude=(leg.call.worker,))[:1]:
            try:
                candidates.setdefault(await address(other.url, worker=other.id), other.id)
            except UpstreamUnreachableError:
                log.warning(
                    "fallback %s left out of request %s: its name does not resolve",
                    other.id,
                    active.turn.request_id,
                )
        return cls(core, active, leg, candidates, provenance_headers(active.turn, active.outcome))

    @property
    def destination(self) -> str:
        """The ordered list, as the header and the `envoy.lb` metadata carry it."""
        return ",".join(self.candidates)

    async def answered(self, message: pb.ProcessingRequest) -> Mapping[str, str]:
        """Rules 3-5 on the response headers' message: the provenance headers for the response."""
        return await self.answered_by(served_endpoint(message), _status(message.response_headers))

    async def answered_by(self, served: str | None, status: int) -> Mapping[str, str]:
        """Rules 3-5: the provenance headers for a response with `status` from `served`'s attempt."""
        chosen = self.leg.call.worker
        worker = self.candidates.get(served or "")
        role = ROLE_OF[self.leg.plan.path]
        self.core.answer_status(worker or chosen, role, status)
        if worker is None or worker == chosen:
            return self.provenance
        t, outcome = self.active, self.active.outcome
        self.core.decode_unreachable(t, self.leg)
        if not 0 < status < 500:
            log.warning(
                "request %s: %s failed before its first byte and the fallback %s answered %d; "
                "%s marked down, session %s not rebound",
                t.turn.request_id, chosen, worker, status, chosen, t.turn.session_id,
            )  # fmt: skip
            return self.provenance
        log.warning(
            "request %s: %s failed before its first byte, Envoy's retry reached %s; %s marked down, "
            "session %s rebound to %s",
            t.turn.request_id, chosen, worker, chosen, t.turn.session_id, worker,
        )  # fmt: skip
        outcome.decode_worker = worker
        outcome.reason = "replica_unreachable" if self.leg.plan.path == "replica" else "decode_unreachable"
        outcome.rebound = True
        try:
            await self.core.remember(t.turn, outcome, None, None, completion_chunks=None)
        except Exception:  # the answer is on its way: a session store failing must not stop it
            log.exception("could not rebind session %s to %s", t.turn.session_id, worker)
        self.provenance = provenance_headers(t.turn, outcome)
        return self.provenance


async def answered(
    failover: Failover | None, message: pb.ProcessingRequest, routed: Mapping[str, str]
) -> Mapping[str, str]:
    """The provenance headers for the response headers' `message`: `routed` (those of the turn as
    routed), or rules 3-5's when the turn has a Failover."""
    return routed if failover is None else await failover.answered(message)
