"""The worker pool: which P, D and R workers exist, whether they are alive, and how loaded they are.

Rule 1: workers come from the static config or from authenticated registration; nothing in a client
request can add an address. Registered workers expire when no heartbeat arrived for
`heartbeat_expiry_s` (paper: heartbeat every 10 s, removed after 30 s); static ones never expire.
Rule 2: a worker is *live* until `unhealthy_after` health checks in a row failed, or a request could
not connect to it (that marks it down at once); the next passing health check brings it back. A
failed check does not count while real requests to the worker keep succeeding (a slow probe on a
busy machine is not a dead worker).
Rule 3: planning reads an immutable `PoolView` snapshot, never this mutable object, so the planner
stays pure and one request sees one consistent pool: the forwarder takes one view per request (a
re-plan after a worker refused the connection uses that view less the worker).
Rule 4: a worker id is 1-128 of `A-Z a-z 0-9 . _ : -` (it appears in URL paths, log lines and metric
labels); a worker URL is http(s)://host[:port][/path], with no credentials (they would be printed in
logs and listings: workers get `worker_api_key` instead), query or fragment. Error messages never
echo a URL's credentials.
Rule 5: the served models' `max_model_len`, read from each worker's `/v1/models`, is kept per worker;
a request is checked against the smallest one any worker serving its model declares.
Rule 6: at most `max_registered` workers are registered at once (static ones not counted): every one
costs a health probe per interval, so the admin API cannot make the gateway probe without bound.
Rule 7: a view may be narrowed to the workers one request may be sent to (`within`: a GIE gateway's
endpoint subset, named by the Envoy picker); a role left empty in a narrowed view is a NoWorkerError
that says where it looked (`scope`).
Rule 8: passive outlier detection (outliers.py): the request path reports each call's outcome
(`note_success`, `note_failure`); an ejected worker is left out of every view until its backoff is over,
then admitted for one probe (the first `acquire` or `note_pick` after claims it). A worker is never
ejected while it is the last live, admitted worker of its role (outliers.py rule 5), and a view whose
role would be left empty by ejections (the others went down since) keeps that role's ejected workers:
requests keep going. The extra work per view is one dict lookup per worker, none while no worker is
ejected.
Concurrency: owned by one event loop; no locks.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import get_args
from urllib.parse import SplitResult, urlsplit

from gateway.errors import BadRequestError, ConflictError, NoWorkerError
from gateway.outliers import Ejection, Held, OutlierDetector, OutlierSettings, Restoration
from gateway.types import Clock, Role

_PASSTHROUGH_ROLES: tuple[Role, ...] = ("decode", "replica", "prefill")

__all__ = [
    "MAX_WORKER_URL_LENGTH",
    "Load",
    "PoolView",
    "WorkerPool",
    "WorkerSpec",
    "WorkerView",
    "is_worker_id",
    "redact_url",
]

_WORKER_ID = re.compile(r"[A-Za-z0-9._:-]{1,128}")
MAX_WORKER_URL_LENGTH = 2048


@dataclass(frozen=True, slots=True)
class Load:
    """Scraped from the worker's /metrics (vLLM names)."""

    running: float = 0.0
    waiting: float = 0.0
    kv_usage: float = 0.0


@dataclass(frozen=True, slots=True)
class WorkerSpec:
    id: str
    role: Role
    url: str

    def __post_init__(self) -> None:
        if not is_worker_id(self.id):
            raise BadRequestError("worker id must be 1-128 characters of A-Z a-z 0-9 . _ : -", param="id")
        if self.role not in get_args(Role):
            raise BadRequestError(
                f"worker role must be one of {get_args(Role)}, got {self.role!r}", param="role"
            )
        _check_url(self.url)


def is_worker_id(value: object) -> bool:
    """Rule 4's worker id: 1-128 of A-Z a-z 0-9 . _ : -"""
    return isinstance(value, str) and _WORKER_ID.fullmatch(value) is not None


def _split(url: str) -> SplitResult | None:
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 (raises ValueError on a bad port)
    except ValueError:
        return None
    return parts


def redact_url(url: str) -> str:
    """The URL with any user:password@ replaced by ***@ (for messages; workers never carry one)."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url if "@" not in url else "***@" + url.rsplit("@", 1)[1]
    authority_end = min(
        (i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest)
    )
    authority = rest[:authority_end]
    if "@" in authority:
        authority = "***@" + authority.rsplit("@", 1)[1]
    return f"{scheme}://{authority}{rest[authority_end:]}"


def _check_url(url: str) -> None:
    shown = redact_url(url)[:200]  # redacted before it is cut: a cut could keep half a password
    if len(url) > MAX_WORKER_URL_LENGTH:
        raise BadRequestError(f"worker url is longer than {MAX_WORKER_URL_LENGTH} characters", param="url")
    if any(c.isspace() or not c.isprintable() for c in url):
        raise BadRequestError("worker url must not hold spaces or control characters", param="url")
    parts = _split(url)
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise BadRequestError(f"worker url must be http(s)://host[:port][/path], got {shown!r}", param="url")
    if parts.username is not None or parts.password is not None:
        raise BadRequestError(
            f"worker url must not carry credentials (user:password@), got {shown!r}; "
            "workers are sent worker_api_key instead",
            param="url",
        )
    if parts.query or parts.fragment or url.endswith(("?", "#")):
        raise BadRequestError(f"worker url must not have a query or fragment, got {shown!r}", param="url")


@dataclass(frozen=True, slots=True)
class WorkerView:
    id: str
    role: Role
    url: str
    load: Load = field(default_factory=Load)
    inflight: int = 0
    last_pick: int = 0

    @property
    def busy(self) -> float:
        """Requests on the worker: what it reports running and waiting, or this gateway's in flight."""
        return max(self.load.running + self.load.waiting, float(self.inflight))

    def rank(self) -> tuple[float, float, int, str]:
        return (self.busy, self.load.kv_usage, self.last_pick, self.id)


@dataclass(frozen=True, slots=True)
class PoolView:
    """An immutable snapshot of the live workers."""

    workers: tuple[WorkerView, ...] = ()
    # Rule 7: what narrowed this view ("" the whole pool), for the NoWorkerError's message.
    scope: str = ""

    def get(self, worker_id: str | None) -> WorkerView | None:
        for w in self.workers:
            if w.id == worker_id:
                return w
        return None

    def ranked(self, role: Role, *, exclude: Iterable[str] = ()) -> list[WorkerView]:
        """Live workers of a role, least loaded first."""
        skip = set(exclude)
        return sorted((w for w in self.workers if w.role == role and w.id not in skip), key=WorkerView.rank)

    def without(self, worker_id: str) -> PoolView:
        """This snapshot less one worker (one found down while a request was being served)."""
        return PoolView(tuple(w for w in self.workers if w.id != worker_id), self.scope)

    def within(self, allowed: Collection[str], *, roles: Collection[Role], scope: str) -> PoolView:
        """Rule 7: this snapshot with the workers of `roles` narrowed to the ids in `allowed` (the
        other roles untouched); `scope` names the narrowing in a NoWorkerError."""
        kept = tuple(w for w in self.workers if w.role not in roles or w.id in allowed)
        return PoolView(kept, scope)

    def passthrough(self) -> WorkerView:
        """The worker a request outside the routing goes to (`/v1/models`, `/tokenize`, ...): the least
        loaded live decode worker, else replica, else prefill (both front doors' pass-through rule)."""
        for role in _PASSTHROUGH_ROLES:
            ranked = self.ranked(role)
            if ranked:
                return ranked[0]
        raise NoWorkerError("decode", scope=self.scope)

    def least_loaded(self, role: Role, *, exclude: Iterable[str] = ()) -> WorkerView:
        ranked = self.ranked(role, exclude=exclude)
        if not ranked:
            raise NoWorkerError(role, scope=self.scope)
        return ranked[0]


class _State:
    __slots__ = (
        "failed_checks",
        "healthy",
        "inflight",
        "last_heartbeat",
        "last_ok",
        "last_pick",
        "load",
        "models",
        "spec",
        "static",
    )

    def __init__(self, spec: WorkerSpec, *, static: bool, now: float) -> None:
        self.spec = spec
        self.static = static
        self.healthy = True
        self.failed_checks = 0
        self.last_ok = float("-inf")
        self.load = Load()
        self.inflight = 0
        self.last_pick = 0
        self.last_heartbeat = now
        # Served model id -> max_model_len, from /v1/models; None until read.
        self.models: Mapping[str, int] | None = None


class WorkerPool:
    def __init__(
        self,
        static: Sequence[WorkerSpec],
        *,
        heartbeat_expiry_s: float,
        clock: Clock,
        max_registered: int = 256,
        outliers: OutlierSettings | None = None,
    ) -> None:
        self._clock = clock
        self._outliers = OutlierDetector(outliers or OutlierSettings())
        self._expiry = heartbeat_expiry_s
        self._max_registered = max_registered
        self._workers: dict[str, _State] = {}
        self._picks = 0
        self._max_model_len: dict[str, int] = {}
        now = clock()
        for spec in static:
            if spec.id in self._workers:
                raise BadRequestError(f"duplicate worker id {spec.id!r}")
            self._workers[spec.id] = _State(spec, static=True, now=now)

    def register(self, spec: WorkerSpec) -> bool:
        """Add a worker or renew its heartbeat; True when it is new. ConflictError when it is new and
        `max_registered` workers are registered already (rule 6)."""
        state = self._workers.get(spec.id)
        now = self._clock()
        if state is not None:
            if state.static:
                raise BadRequestError(f"worker {spec.id!r} is statically configured")
            if state.spec != spec:
                state.spec = spec
                self.set_models(spec.id, None)
            state.last_heartbeat = now
            return False
        registered = sum(not s.static for s in self._workers.values())
        if registered >= self._max_registered:
            raise ConflictError(
                f"{registered} workers are registered, the most this gateway accepts "
                f"(pool.max_registered_workers); deregister one or wait for one to expire"
            )
        self._workers[spec.id] = _State(spec, static=False, now=now)
        return True

    def deregister(self, worker_id: str) -> bool:
        state = self._workers.get(worker_id)
        if state is None or state.static:
            return False
        del self._workers[worker_id]
        self._outliers.forget(worker_id)
        self._index_models()
        return True

    def expire(self) -> list[str]:
        """Remove registered workers whose heartbeat is older than the expiry; returns their ids."""
        deadline = self._clock() - self._expiry
        gone = [w for w, s in self._workers.items() if not s.static and s.last_heartbeat < deadline]
        for worker_id in gone:
            del self._workers[worker_id]
            self._outliers.forget(worker_id)
        if gone:
            self._index_models()
        return gone

    def needs_models(self, worker_id: str) -> bool:
        state = self._workers.get(worker_id)
        return state is not None and state.models is None

    def set_models(self, worker_id: str, models: Mapping[str, int] | None) -> None:
        """What the worker's /v1/models said (model id -> max_model_len); None: read it again."""
        state = self._workers.get(worker_id)
        if state is not None:
            state.models = dict(models) if models is not None else None
            self._index_models()

    def max_model_len(self, model: str) -> int | None:
        """The smallest max_model_len a worker serving `model` declared; None when none did."""
        return self._max_model_len.get(model)

    def _index_models(self) -> None:
        smallest: dict[str, int] = {}
        for state in self._workers.values():
            for model, length in (state.models or {}).items():
                smallest[model] = min(length, smallest.get(model, length))
        self._max_model_len = smallest

    def specs(self) -> list[WorkerSpec]:
        return [s.spec for s in self._workers.values()]

    def set_health(self, worker_id: str, healthy: bool) -> None:
        state = self._workers.get(worker_id)
        if state is not None:
            state.healthy = healthy

    def note_success(self, worker_id: str) -> Restoration | None:
        """A request to the worker was answered (a 4xx included: outliers.py rule 1); a Restoration
        when it was the probe of an ejected worker (rule 8)."""
        state = self._workers.get(worker_id)
        if state is None:
            return None
        state.last_ok = now = self._clock()
        return self._outliers.success(worker_id, now)

    def note_failure(self, worker_id: str) -> Ejection | Held | None:
        """A request to the worker failed before its first byte (connection, timeout, 5xx): rule 8's
        Ejection, a Held (the last live worker of its role), or None."""
        state = self._workers.get(worker_id)
        if state is None:
            return None
        now = self._clock()
        return self._outliers.failure(worker_id, now, may_eject=self._has_other(state, now))

    def _has_other(self, state: _State, now: float) -> bool:
        """Another live worker of the worker's role that is in rotation (outliers.py rule 5)."""
        role, me, outliers = state.spec.role, state.spec.id, self._outliers
        return any(
            s.healthy and s.spec.role == role and s.spec.id != me and not outliers.is_ejected(s.spec.id)
            for s in self._workers.values()
        )

    def is_ejected(self, worker_id: str) -> bool:
        return self._outliers.is_ejected(worker_id)

    def ejected(self, role: Role) -> int:
        """Workers of `role` ejected now (half-open ones included)."""
        if not self._outliers.any_ejected:
            return 0
        return sum(
            1 for s in self._workers.values() if s.spec.role == role and self._outliers.is_ejected(s.spec.id)
        )

    def record_check(
        self, worker_id: str, ok: bool, *, unhealthy_after: int = 1, served_within_s: float = 0.0
    ) -> None:
        """One active health check's result; a failure is forgiven when the worker answered a
        request within the last `served_within_s` seconds."""
        state = self._workers.get(worker_id)
        if state is None:
            return
        if ok:
            state.failed_checks = 0
            state.healthy = True
        elif state.healthy and self._clock() - state.last_ok < served_within_s:
            return
        else:
            state.failed_checks += 1
            if state.failed_checks >= unhealthy_after:
                state.healthy = False

    def set_load(self, worker_id: str, load: Load) -> None:
        state = self._workers.get(worker_id)
        if state is not None:
            state.load = load

    def mark_failed(self, worker_id: str) -> None:
        self.set_health(worker_id, False)

    def is_live(self, worker_id: str) -> bool:
        state = self._workers.get(worker_id)
        return state is not None and state.healthy

    def acquire(self, worker_id: str) -> None:
        state = self._workers.get(worker_id)
        if state is not None:
            state.inflight += 1
            if self._outliers.any_ejected:
                self._outliers.claim(worker_id, self._clock())

    def release(self, worker_id: str) -> None:
        state = self._workers.get(worker_id)
        if state is not None and state.inflight > 0:
            state.inflight -= 1

    def note_pick(self, worker_id: str) -> None:
        """Remember when a worker was chosen, so equally loaded workers take turns."""
        state = self._workers.get(worker_id)
        if state is not None:
            self._picks += 1
            state.last_pick = self._picks
            if self._outliers.any_ejected:
                self._outliers.claim(worker_id, self._clock())

    def view(self) -> PoolView:
        live = [s for s in self._workers.values() if s.healthy]
        if self._outliers.any_ejected:
            live = self._admitted(live)
        return PoolView(
            tuple(
                WorkerView(s.spec.id, s.spec.role, s.spec.url, s.load, s.inflight, s.last_pick) for s in live
            )
        )

    def _admitted(self, live: list[_State]) -> list[_State]:
        """Rule 8: the live workers less the ejected ones, except in a role that would be left empty."""
        now, outliers = self._clock(), self._outliers
        admitted = [s for s in live if outliers.admits(s.spec.id, now)]
        if len(admitted) == len(live):
            return live
        roles = {s.spec.role for s in admitted}
        return [s for s in live if s.spec.role not in roles or outliers.admits(s.spec.id, now)]

    def describe(self) -> list[dict[str, object]]:
        now = self._clock()
        return [
            {
                "id": s.spec.id,
                "role": s.spec.role,
                "url": s.spec.url,
                "static": s.static,
                "healthy": s.healthy,
                "inflight": s.inflight,
                "running": s.load.running,
                "waiting": s.load.waiting,
                "kv_usage": s.load.kv_usage,
                "max_model_len": dict(s.models) if s.models is not None else None,
                "outlier": self._outliers.describe(s.spec.id, now),
            }
            for s in self._workers.values()
        ]

    def count(self, role: Role, *, live: bool) -> int:
        return sum(1 for s in self._workers.values() if s.spec.role == role and (s.healthy or not live))
