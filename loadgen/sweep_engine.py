"""The ``endpoints`` sweep engine: grid points measured on a running deployment through its front door.

``ppd-table sweep --engine endpoints --url http://GATEWAY`` finds it in the entry-point group
``ppd_table.engines`` (pyproject.toml), beside ``sim`` and ``vllm-cpu``. It starts nothing: the front door
(our standalone gateway, or Envoy in front of the picker) and its vLLM workers already run. One point =
the load generator's synthetic two-turn workload at the point's QPS for ``duration_s`` seconds, sent
with the point's static mode asked for per request (``X-PPD-Mode``), so the records say what a client
saw, exactly as ``ppd-bench run`` records them.

Rule 1: what the deployment is, is read once, at ``make`` (GET requests only, nothing changed): the front
        door's ``/v1/models`` (the model id and its ``max_model_len``), the workers (the gateway's
        ``GET /admin/workers`` with its admin token, else the ``--worker`` flags), each worker's
        ``/v1/models`` and ``/version``. A front door or a worker that does not answer is an
        ``EngineError`` naming it, before any sweep folder is written. Without a worker list the sweep
        runs, and says once that points are then not isolated (no drain, no reset).
Rule 2: ``settings()`` is that deployment as a rerun against it finds it again: the model id, its
        length, the vLLM versions, the workers per role, with the run's duration, seed and timeout.
        Neither the front door's address nor the workers' (pods come back elsewhere) is in it, so a
        rerun through another address of the same deployment resumes.
Rule 3: ``check_grid`` refuses, before anything runs, a shape the gateway's worker list contradicts, and a
        workload whose Turn 2 (Turn-1 prompt and answer, Turn-2 prompt and answer, and
        ``TEMPLATE_MARGIN`` tokens of chat template and run marker) does not fit ``max_model_len``.
Rule 4: points are isolated: before each one, every worker's ``vllm:num_requests_running`` and
        ``vllm:num_requests_waiting`` must read 0 within ``settle_timeout_s`` (else a ``SweepError``
        naming the busy workers), then each worker's prefix cache is reset (``POST
        /reset_prefix_cache``, served by vLLM only with ``VLLM_SERVER_DEV_MODE=1``; ``{"success":
        false}``, blocks still held, is retried until the same deadline). A worker without the route
        is logged once and the sweep goes on: each run marks its own text anyway (``loadgen.load``
        rule 6), so no run hits a prefix another run computed.
Rule 5: the arrivals and the conversations' text of a point depend on (seed, workload, QPS) only, so
        the pd and local runs of a cell see the same traffic (as the ``vllm-cpu`` engine does).
Rule 6: a point is not kept (``SweepError``) when every request failed to connect (the front door went
        away, which says nothing about the mode), or when no Turn 2+ request took the path the point
        asked for (a gateway or picker whose ``allow_mode_header`` is off ignores ``X-PPD-Mode``: the
        records would carry a mode label the traffic never had). Points run one at a time
        (``max_jobs``): two points at once would measure each other.
Rule 7: the table says the placement the deployment ran (its header's ``placement``): what the
        standalone gateway's ``GET /admin/workers`` says it does (``prefix`` only where it follows
        KV events), else what ``--placement`` says (the picker's front door does not tell).

One module (about 460 lines): one plug-in, whose seven rules all act on the deployment rule 1 read.
"""

from __future__ import annotations

import asyncio
import logging
import zlib
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar, Final

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

from loadgen.load import LoadSettings, run_load
from loadgen.tokens import llama3_counter
from loadgen.workloads import SyntheticWorkload, single_token_words
from ppd.catalog import Workload
from ppd.placement import PLACEMENTS
from table_builder.analytic import parse_shape
from table_builder.engines import EngineError, EngineOptions
from table_builder.records import Record
from table_builder.sweep import GridPoint, SweepError

__all__ = [
    "QUEUE_METRICS",
    "TEMPLATE_MARGIN",
    "Deployment",
    "EndpointsEngine",
    "WorkerRef",
    "discover",
    "make",
    "parse_worker",
]

logger = logging.getLogger(__name__)

#: Tokens a Turn 2 takes beyond the workload's counts: the chat template (a few per message) and the
#: run's marker (``loadgen.load`` rule 6).
TEMPLATE_MARGIN: Final = 64
#: The queue gauges a drained worker shows at 0 (vLLM's names).
QUEUE_METRICS: Final = ("vllm:num_requests_running", "vllm:num_requests_waiting")
_ROLES: Final = ("prefill", "decode", "replica")
_POLL_S: Final = 0.25
#: Seconds for one discovery or metrics request.
_PROBE_TIMEOUT_S: Final = 10.0


@dataclass(frozen=True, slots=True)
class WorkerRef:
    """One worker to watch and reset: its address and role (``unknown`` when only its URL was given)."""

    url: str
    role: str = "unknown"
    id: str = ""

    @property
    def name(self) -> str:
        return f"{self.id or self.role} at {self.url}"


def parse_worker(text: str) -> WorkerRef:
    """``URL`` or ``ROLE=URL`` (role prefill, decode or replica) -> a worker; ValueError says the form."""
    role, sep, url = text.partition("=")
    if not sep or role.startswith(("http://", "https://")):
        role, url = "unknown", text
    elif role not in _ROLES:
        raise ValueError(f"--worker {text!r}: the role before '=' must be one of {', '.join(_ROLES)}")
    if not url.startswith(("http://", "https://")):
        raise ValueError(f"--worker {text!r}: expected URL or ROLE=URL, the URL starting with http://")
    return WorkerRef(url=url.rstrip("/"), role=role)


@dataclass(frozen=True, slots=True)
class Deployment:
    """What rule 1 read: the model, its length, the workers and their vLLM versions."""

    served_model: str
    max_model_len: int | None
    workers: tuple[WorkerRef, ...]
    versions: tuple[str, ...]
    #: Where the worker list came from: ``admin`` (the gateway), ``flags`` (``--worker``) or ``none``.
    source: str
    #: The placement the gateway says its legs get (``GET /admin/workers``), None when it does not say.
    placement: str | None = None

    def roles(self) -> dict[str, int]:
        counts: dict[str, int] = {}
        for worker in self.workers:
            counts[worker.role] = counts.get(worker.role, 0) + 1
        return dict(sorted(counts.items()))


@dataclass(slots=True)
class EndpointsEngine:
    url: str
    deployment: Deployment
    duration_s: float = 10.0
    seed: int = 0
    timeout_s: float = 30.0
    settle_timeout_s: float = 120.0
    #: Rule 7: how the deployment places P and the Turn-1 D, as the table's header will say.
    placement: str = "least_loaded"
    #: Workers found without the reset route: logged once, not asked again (rule 4).
    _told_no_reset: set[str] = field(default_factory=set, repr=False, compare=False)

    #: Points run one at a time on one deployment (``ppd-table sweep --jobs`` above this is refused).
    max_jobs: ClassVar[int] = 1

    @property
    def name(self) -> str:
        return "endpoints"

    def settings(self) -> Mapping[str, Any]:
        d = self.deployment
        return {
            "duration_s": self.duration_s,
            "max_model_len": d.max_model_len,
            "seed": self.seed,
            "served_model": d.served_model,
            "timeout_s": self.timeout_s,
            "vllm": ",".join(d.versions) or "unknown",
            "workers": ",".join(f"{role}={n}" for role, n in d.roles().items()) or "unknown",
        } | ({"placement": self.placement} if self.placement != "least_loaded" else {})

    def arrivals_seed(self, point: GridPoint) -> int:
        return zlib.crc32(f"{self.seed}/{point.workload.name}/{point.qps:g}".encode())

    def check_grid(self, shapes: Sequence[str], workloads: Iterable[Workload]) -> None:
        """Rule 3: ValueError naming every shape and workload this deployment cannot run."""
        problems: list[str] = []
        roles = self.deployment.roles()
        if self.deployment.source == "admin":  # the gateway's whole list (--worker flags may be a part)
            listed = (roles.get("prefill", 0), roles.get("decode", 0))
            for shape in shapes:
                if parse_shape(shape) != listed:
                    problems.append(
                        f"--shape {shape} but the deployment has {listed[0]} prefill and {listed[1]} "
                        "decode workers"
                    )
        limit = self.deployment.max_model_len
        if limit is not None:
            for w in workloads:
                need = w.turn2_context + w.second.n_in + w.second.n_out + TEMPLATE_MARGIN
                if need > limit:
                    problems.append(
                        f"workload {w.name} needs {need} tokens at Turn 2 (context {w.turn2_context} + "
                        f"prompt {w.second.n_in} + output {w.second.n_out} + {TEMPLATE_MARGIN} of template), "
                        f"over the model's max_model_len {limit}"
                    )
        if problems:
            raise ValueError(
                "the grid does not fit this deployment: "
                + "; ".join(problems)
                + " (leave those out with --workloads/--shape)"
            )

    def run(self, point: GridPoint) -> list[Record]:
        records = asyncio.run(self._run(point))
        failed = [r for r in records if not r.ok]
        if (
            records
            and len(failed) == len(records)
            and all((r.error or "").startswith("connection") for r in failed)
        ):
            raise SweepError(
                f"every request of {point.run_id} failed to connect to {self.url} ({failed[0].error}): "
                "is the front door still up? Finished points are kept; run the sweep again to resume"
            )
        later = [r for r in records if r.ok and r.turn > 1]
        if later and not any(r.path == r.mode for r in later):
            taken = ", ".join(sorted({r.path for r in later}))
            raise SweepError(
                f"{point.run_id}: every Turn 2+ request ran {taken} although X-PPD-Mode asked for "
                f"{point.mode}: the front door does not follow the header. Our gateway and picker follow "
                "it only with allow_mode_header = true in their config (a benchmarking aid): set it for "
                "the sweep, then run the sweep again"
            )
        return records

    async def _run(self, point: GridPoint) -> list[Record]:
        await self.isolate(point.run_id)
        seed = self.arrivals_seed(point)
        workload = SyntheticWorkload(
            name=point.workload.name, words=single_token_words(llama3_counter()), seed=seed
        )
        settings = LoadSettings(
            url=self.url,
            qps=point.qps,
            duration_s=self.duration_s,
            run_id=point.run_id,
            workload=point.workload.name,
            seed=seed,
            timeout_s=self.timeout_s,
            served_model=self.deployment.served_model,
            shape=point.shape,
            model_label=point.model,
            mode=point.mode,
            send_mode_header=True,
        )
        return (await run_load(settings, workload)).records

    async def isolate(self, run_id: str) -> None:
        """Rule 4: wait until every worker's queue is empty, then reset their prefix caches."""
        workers = self.deployment.workers
        if not workers:
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.settle_timeout_s
        timeout = aiohttp.ClientTimeout(total=_PROBE_TIMEOUT_S)
        async with aiohttp.ClientSession(timeout=timeout) as http:
            while True:
                states = await asyncio.gather(*(_queue_state(http, w) for w in workers))
                busy = [f"{w.name}: {state}" for w, state in zip(workers, states, strict=True) if state]
                if not busy:
                    break
                if loop.time() >= deadline:
                    raise SweepError(
                        f"before {run_id}, the workers' queues did not drain within "
                        f"{self.settle_timeout_s:g} s ({'; '.join(busy)}): another client may be using "
                        "the deployment, or requests hang; stop that traffic, or raise --settle-timeout"
                    )
                await asyncio.sleep(_POLL_S)
            resettable = [w for w in workers if w.url not in self._told_no_reset]
            served = await asyncio.gather(*(self._reset(http, w, deadline) for w in resettable))
        missing = [w for w, ok in zip(resettable, served, strict=True) if not ok]
        if missing:  # rule 4: said once, for every worker without the route, then never asked again
            self._told_no_reset.update(w.url for w in missing)
            logger.warning(
                "%s: no POST /reset_prefix_cache (vLLM serves it only with VLLM_SERVER_DEV_MODE=1), so "
                "prefix caches are not reset between points; each run still marks its own text, so no "
                "run reuses another's prefixes",
                ", ".join(w.name for w in missing),
            )

    async def _reset(self, http: aiohttp.ClientSession, worker: WorkerRef, deadline: float) -> bool:
        """Reset one worker's prefix cache; False when it does not serve the route (404/405)."""
        loop = asyncio.get_running_loop()
        while True:
            try:
                async with http.post(f"{worker.url}/reset_prefix_cache") as resp:
                    status = resp.status
                    body = await resp.json(content_type=None) if status == 200 else None
            except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
                logger.warning("resetting the prefix cache of %s failed: %s; going on", worker.name, exc)
                return True
            if status in (404, 405):
                return False
            if status == 200 and isinstance(body, dict) and body.get("success") is True:
                return True
            if status != 200 or loop.time() >= deadline:
                logger.warning(
                    "%s did not reset its prefix cache (HTTP %d, %s); going on", worker.name, status, body
                )
                return True
            await asyncio.sleep(_POLL_S)  # {"success": false}: blocks still held, vLLM says retry


async def _queue_state(http: aiohttp.ClientSession, worker: WorkerRef) -> str:
    """'' when the worker's queue is empty; else what is in it (or why it could not be read)."""
    try:
        async with http.get(f"{worker.url}/metrics") as resp:
            if resp.status != 200:
                return f"/metrics answered HTTP {resp.status}"
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError) as exc:
        return f"/metrics unreachable ({type(exc).__name__}: {exc})"
    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                if sample.name in QUEUE_METRICS:
                    found[sample.name] = found.get(sample.name, 0.0) + sample.value
    except ValueError as exc:
        return f"/metrics is not Prometheus text ({exc})"
    missing = [m for m in QUEUE_METRICS if m not in found]
    if missing:
        return f"/metrics has no {', '.join(missing)}"
    running, waiting = (found[m] for m in QUEUE_METRICS)
    return f"{running:g} running, {waiting:g} waiting" if running or waiting else ""


async def _get_json(http: aiohttp.ClientSession, url: str, headers: Mapping[str, str] | None = None) -> Any:
    """GET ``url`` as JSON; EngineError naming it when it cannot."""
    try:
        async with http.get(url, headers=headers) as resp:
            if resp.status != 200:
                raise EngineError(f"GET {url} answered HTTP {resp.status}: {(await resp.text())[:200]}")
            return await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise EngineError(f"cannot reach {url}: {type(exc).__name__}: {exc}") from None
    except ValueError:
        raise EngineError(f"GET {url} did not answer JSON") from None


def _model_card(payload: Any, url: str, wanted: str | None) -> tuple[str, int | None]:
    cards = payload.get("data") if isinstance(payload, dict) else None
    if not isinstance(cards, list) or not cards or not all(isinstance(c, dict) for c in cards):
        raise EngineError(f"GET {url}/v1/models lists no model")
    card = next((c for c in cards if c.get("id") == wanted), None) if wanted else cards[0]
    if card is None:
        ids = ", ".join(str(c.get("id")) for c in cards)
        raise EngineError(f"{url} does not serve model {wanted!r} (it serves {ids}): fix --served-model")
    length = card.get("max_model_len")
    return str(card.get("id")), length if isinstance(length, int) and length > 0 else None


async def _admin_workers(
    http: aiohttp.ClientSession, url: str, token: str | None
) -> tuple[list[WorkerRef], str | None] | None:
    """The gateway's worker list and the placement it says its legs get (None when it does not say),
    or None (logged) when this front door does not give them."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    try:
        async with http.get(f"{url}/admin/workers", headers=headers) as resp:
            status = resp.status
            payload = await resp.json(content_type=None) if status == 200 else None
    except (aiohttp.ClientError, TimeoutError, ValueError) as exc:
        logger.info("%s/admin/workers could not be read (%s)", url, exc)
        return None
    workers = payload.get("workers") if isinstance(payload, dict) else None
    if status != 200 or not isinstance(workers, list):
        why = "no admin token given (--admin-token-file)" if not token and status == 401 else f"HTTP {status}"
        logger.info("%s/admin/workers gives no worker list (%s)", url, why)
        return None
    refs = [
        WorkerRef(url=str(w["url"]).rstrip("/"), role=str(w.get("role", "unknown")), id=str(w.get("id", "")))
        for w in workers
        if isinstance(w, dict) and isinstance(w.get("url"), str)
    ]
    placement = payload.get("placement") if isinstance(payload, dict) else None
    return sorted(refs, key=lambda w: (w.role, w.id, w.url)), placement if placement in PLACEMENTS else None


async def discover(options: EngineOptions, flagged: Sequence[WorkerRef]) -> Deployment:
    """Rule 1: read what the deployment behind ``options.url`` is (GET requests only)."""
    assert options.url is not None
    url = options.url.rstrip("/")
    timeout = aiohttp.ClientTimeout(total=_PROBE_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        model, length = _model_card(await _get_json(http, f"{url}/v1/models"), url, options.served_model)
        # With --worker flags the admin list is asked only for the placement, so only with a token.
        ask_admin = options.admin_token is not None or not flagged
        admin = await _admin_workers(http, url, options.admin_token) if ask_admin else None
        listed, placement = admin if admin is not None else ([], None)
        workers = tuple(flagged) if flagged else tuple(listed)
        source = "flags" if flagged else ("admin" if listed else "none")
        versions: set[str] = set()
        lengths = [length] if length is not None else []
        for worker in workers:
            _, worker_length = _model_card(
                await _get_json(http, f"{worker.url}/v1/models"), worker.url, model
            )
            if worker_length is not None:
                lengths.append(worker_length)
            version = await _get_json(http, f"{worker.url}/version")
            if isinstance(version, dict) and isinstance(version.get("version"), str):
                versions.add(version["version"])
    return Deployment(
        served_model=model,
        max_model_len=min(lengths) if lengths else None,
        workers=workers,
        versions=tuple(sorted(versions)),
        source=source,
        placement=placement,
    )


def make(options: EngineOptions) -> EndpointsEngine:
    """The entry point of ``endpoints`` in the group ``ppd_table.engines``: ValueError for missing or
    bad options (a usage error), EngineError when the deployment cannot be read."""
    if not options.url:
        raise ValueError("the endpoints engine needs --url, the deployment's front door (http://HOST:PORT)")
    if not options.url.startswith(("http://", "https://")):
        raise ValueError(f"--url {options.url!r} must start with http:// or https://")
    flagged = [parse_worker(w) for w in options.workers]
    deployment = asyncio.run(discover(options, flagged))
    if not deployment.workers:
        logger.warning(
            "no worker list (the front door does not serve GET /admin/workers with --admin-token-file, "
            "and no --worker given): points are isolated only by their own text, not by draining the "
            "workers' queues or resetting their prefix caches"
        )
    if deployment.max_model_len is None:
        logger.warning("no max_model_len in %s/v1/models: workload lengths are not checked", options.url)
    logger.info(
        "sweeping through %s: model %s (max_model_len %s), workers %s (from %s), vLLM %s",
        options.url,
        deployment.served_model,
        deployment.max_model_len,
        deployment.roles() or "unknown",
        deployment.source,
        ",".join(deployment.versions) or "unknown",
    )
    return EndpointsEngine(
        url=options.url.rstrip("/"),
        deployment=deployment,
        duration_s=options.duration_s,
        seed=options.seed,
        timeout_s=options.timeout_s,
        settle_timeout_s=options.settle_timeout_s,
        placement=_placement(deployment, options),
    )


def _placement(deployment: Deployment, options: EngineOptions) -> str:
    """Rule 7: the gateway's own word on its placement; else ``--placement`` (said once); else
    least_loaded, what a gateway without ``[kv_events]`` does."""
    if deployment.placement is not None:
        return deployment.placement
    said = options.placement or "least_loaded"
    logger.info(
        "%s does not say how it places legs (only our standalone gateway's GET /admin/workers does): "
        "the table will say placement %s%s",
        options.url,
        said,
        "" if options.placement else " (set --placement to what the deployment runs)",
    )
    return said
