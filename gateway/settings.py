"""Gateway settings: read once at start-up from a TOML file into frozen dataclasses.

Every setting has a default (an empty file is a valid config); unknown keys are an error, so a typo
never silently does nothing. `gateway/README.md` documents each key with an example.
Secrets (`admin_token`, `worker_api_key`) are `Secret` strings: their value is used as is, but their
repr, and so any printed Settings (`ppd-gateway check-config`), shows `'<redacted>'`.
It stays one module (about 540 lines): one loader reads and checks every section together, and a
newcomer finds every key of the gateway's file in one place.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from pathlib import Path as FsPath
from typing import Any, Literal

from gateway.limits import LimitSettings
from gateway.outliers import OutlierSettings
from gateway.pool import WorkerSpec
from gateway.retry_budget import RetryBudgetSettings
from ppd.admission import AdmissionSettings, TenantSettings
from ppd.explore import ExploreSettings
from ppd.modes import Mode, parse_mode
from ppd.placement import PlacementSettings
from ppd.slo import SloSettings
from ppd.tracing import TracingSettings

__all__ = [
    "AdmissionSettings",
    "DecisionSettings",
    "ExploreSettings",
    "KvEventSettings",
    "LimitSettings",
    "LogSettings",
    "OutlierSettings",
    "PolicySettings",
    "PoolSettings",
    "RetryBudgetSettings",
    "RoutingSettings",
    "Secret",
    "SessionSettings",
    "Settings",
    "SettingsError",
    "SloConfig",
    "TimeoutSettings",
    "TracingSettings",
    "UpstreamSettings",
    "explore_settings",
]


class SettingsError(ValueError):
    pass


class Secret(str):
    """A string whose repr never shows it (an empty one still reads as '')."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "'<redacted>'" if self else "''"


_SECRETS = ("admin_token", "worker_api_key")


@dataclass(frozen=True, slots=True)
class DecisionSettings:
    # host:port of the DecisionService; empty = none (ppd mode then always uses the fallback).
    address: str = ""
    deadline_ms: float = 5.0
    # A pool of RouteStreams (route_streams.py) instead of one unary Route call per request (false).
    stream: bool = True
    streams: int = 0  # streams in the pool; 0 = one per address the target names or resolves to
    # Seconds before a stream is retired (its successor lands on the next round_robin backend).
    stream_max_age_s: float = 30.0
    # What ppd mode does when the service is slow, down or NOT_SERVING: "pd" or "local".
    fallback: Literal["pd", "local"] = "pd"
    table_key: str = ""
    weights_profile: str = ""
    # Attach live load (P queue depth, D running, D KV usage) to each Route call.
    send_live_signals: bool = True
    # gRPC load balancing over the addresses the name resolves to: "round_robin" (every call to the
    # next ready address, e.g. each pod of dns:///ppd-decision-headless:50051) or "pick_first" (one
    # address at a time, failing over to the next). Passed as the channel option grpc.lb_policy_name.
    lb_policy: Literal["round_robin", "pick_first"] = "round_robin"
    # After the health Watch reports NOT_SERVING (or SERVICE_UNKNOWN), close it and open a new one
    # after this pause (it may land on another replica), doubling up to health_reopen_max_s while the
    # answer stays not serving.
    health_reopen_s: float = 0.2
    health_reopen_max_s: float = 3.0

    def validate(self) -> None:
        if self.fallback not in ("pd", "local"):
            raise SettingsError("decision.fallback must be 'pd' or 'local'")
        if self.deadline_ms <= 0:
            raise SettingsError("decision.deadline_ms must be positive")
        if not (0 <= self.streams <= 64 and self.stream_max_age_s > 0):
            raise SettingsError("need decision.streams in 0..64 and decision.stream_max_age_s > 0")
        if self.lb_policy not in ("round_robin", "pick_first"):
            raise SettingsError("decision.lb_policy must be 'round_robin' or 'pick_first'")
        if not 0 < self.health_reopen_s <= self.health_reopen_max_s:
            raise SettingsError("need 0 < decision.health_reopen_s <= decision.health_reopen_max_s")


@dataclass(frozen=True, slots=True)
class PolicySettings:
    # After every P attempt failed: "local" prefill on the chosen D, or "error" (503).
    prefill_failure: Literal["local", "error"] = "local"
    # P attempts per request (1 = no retry; 2 = one retry on another P).
    prefill_attempts: int = 2
    # n_out when the request names no limit, no hint is given and the session has no history.
    default_output_tokens: int = 256
    qps_window_s: float = 10.0
    qps_hysteresis: float = 0.1
    # Ask streaming D legs for usage (dropped again before the client) to track context size.
    inject_usage: bool = True
    # Count new input tokens with a worker's /tokenize when no exact tokenizer is bundled.
    worker_tokenize: bool = True


@dataclass(frozen=True, slots=True)
class RoutingSettings:
    # The workers run vLLM's bidirectional mode (kv_connector_extra_config bidirectional_kv_xfer on P
    # and D, docs/vllm-protocol.md 3.4), so this gateway can serve the "bidir" path: it says so to the
    # DecisionService (capability "bidir"); without it a DecisionService never answers bidir.
    bidir: bool = False
    # How long after D's final chunk the gateway still sends D's params to P: vLLM's multi-turn proxy
    # keeps them 450 s, below D's decoder_kv_blocks_ttl (480 s) less P's 5 s safety margin.
    bidir_params_ttl_s: float = 450.0
    # The Envoy picker only: the decode workers run llm-d's routing sidecar, which runs the P leg
    # itself when the request names P in `x-prefiller-host-port`; the picker then names P there and
    # runs no P leg (picker.py rule 7). The workers' D URLs are the sidecars'.
    llmd_sidecar: bool = False
    # Which P a leg through P goes to, and the D of Turn 1 and of a rebind (ppd/placement.py):
    # "prefix" takes the worker holding the longest prefix of the prompt (by its KV events,
    # [kv_events]) unless it is more than placement_max_imbalance requests busier than the least
    # loaded; "least_loaded" always takes the least loaded. Without [kv_events] both are the same.
    placement: Literal["prefix", "least_loaded"] = "prefix"
    # Requests a worker holding the prefix may be busier than the least loaded and still be taken
    # (docs/concepts/placement.md: measured on the virtual-time cluster).
    placement_max_imbalance: float = 4.0

    def placement_settings(self) -> PlacementSettings:
        return PlacementSettings(self.placement, self.placement_max_imbalance)

    def validate(self) -> None:
        if not 0 < self.bidir_params_ttl_s < float("inf"):
            raise SettingsError("routing.bidir_params_ttl_s must be a positive number of seconds")
        try:
            self.placement_settings()
        except ValueError as exc:
            raise SettingsError(f"routing.{exc}") from None
        if self.bidir and self.llmd_sidecar:
            raise SettingsError(
                "routing.bidir and routing.llmd_sidecar exclude each other: llm-d's sidecar sends a "
                "plain P leg, never D's params"
            )


@dataclass(frozen=True, slots=True)
class TimeoutSettings:
    connect_s: float = 3.0
    # The whole P leg (it returns one token, non-streaming).
    prefill_s: float = 60.0
    # A whole non-streaming D (or R) response.
    response_s: float = 600.0
    # Longest silence between two chunks of a streaming response (headers included).
    idle_s: float = 60.0
    # Health checks, /metrics scrapes, /tokenize and other small calls.
    probe_s: float = 2.0


@dataclass(frozen=True, slots=True)
class UpstreamSettings:
    # The client of the streaming leg to workers: "httptools" (gateway/stream_upstream.py, asyncio
    # Protocols + httptools' parser) or "aiohttp" (gateway/upstream.py, as every other call).
    stream_client: Literal["httptools", "aiohttp"] = "aiohttp"
    # Idle keep-alive connections kept per worker by the httptools client, and how long each.
    max_idle_per_worker: int = 256
    keepalive_s: float = 30.0

    def validate(self) -> None:
        if self.stream_client not in ("httptools", "aiohttp"):
            raise SettingsError("upstream.stream_client must be 'httptools' or 'aiohttp'")
        if self.max_idle_per_worker < 0 or self.keepalive_s <= 0:
            raise SettingsError("upstream.max_idle_per_worker must be >= 0, upstream.keepalive_s positive")


@dataclass(frozen=True, slots=True)
class SessionSettings:
    ttl_s: float = 3600.0
    max_entries: int = 200_000
    sweep_interval_s: float = 10.0
    # The session store shared by gateway replicas (gateway/redis_sessions.py): a Redis URL
    # (redis://host:6379/0, rediss://..., unix:///run/redis.sock); empty = this process's memory.
    # ttl_s and max_entries then bound the shared store (and the local memory it falls back to).
    redis_url: str = ""
    # Every key this store writes starts with it (replicas sharing sessions use the same prefix).
    redis_prefix: str = "ppd:sessions:"
    # Longest wait for one Redis call (and its connection); past it the replica keeps sessions in its
    # own memory (degraded) until Redis answers again, tried every redis_retry_s. It counts wall time
    # on a busy event loop too, so keep it well above the loop's stalls under load (0.25 s degraded
    # a saturated 2-core test machine's gateway at 200 streams).
    redis_timeout_s: float = 1.0
    redis_retry_s: float = 1.0
    # Chat lookups try the latest this-many prefixes of a history that end right before an answer,
    # two keys each in one store call (gateway/session_lookup.py rule 2).
    prefix_candidates: int = 8


@dataclass(frozen=True, slots=True)
class PoolSettings:
    health_interval_s: float = 2.0
    # Consecutive failed /health checks before a worker leaves the pool (a refused request: at once).
    unhealthy_after: int = 2
    heartbeat_expiry_s: float = 30.0
    scrape_metrics: bool = True
    # Workers registered through the admin API at once (static ones not counted); more -> 409.
    max_registered_workers: int = 256


@dataclass(frozen=True, slots=True)
class KvEventSettings:
    """[kv_events]: KV residency from the workers' own KV cache events (gateway/residency.py)."""

    # Worker id -> its KV event publisher as the gateway reaches it (vLLM's --kv-events-config
    # endpoint, e.g. "tcp://10.0.0.5:5557"); empty = off, routing on belief alone as before.
    endpoints: dict[str, str] = field(default_factory=dict)
    # Worker id -> its replay socket (--kv-events-config replay_endpoint), for full resyncs.
    replay_endpoints: dict[str, str] = field(default_factory=dict)
    # The workers' PYTHONHASHSEED (seeds vLLM's block hashes); "" = not set (vLLM's fixed seed).
    hash_seed: str = ""
    # The workers' --block-size (16 on GPU by default, 32 for vLLM on CPU).
    block_size: int = 16
    # Blocks tracked per worker; past it the oldest stored is forgotten (residency under-estimated).
    max_blocks_per_worker: int = 1_000_000
    # First messages (chat) whose prompts' shared leading blocks are remembered, so a Turn 1 opening
    # with one is placed on the worker holding them without asking /tokenize (gateway/openings.py);
    # the least recently used is forgotten past it. About 1 KB each.
    max_openings: int = 4096
    # Workers registered through the admin API may name their publisher (fields kv_events and
    # kv_events_replay) and are then tracked too; needed when no static worker names one.
    accept_registered: bool = False
    # A replay that sends nothing this long is given up (the worker stays unsynced; retried later).
    replay_timeout_s: float = 5.0
    # Largest frame taken from a publisher or replay socket (ZMQ_MAXMSGSIZE); a larger one drops the
    # connection (counted, unsynced, reconnected). A vLLM step's batch is far below it.
    max_message_bytes: int = 4 << 20
    # Bytes one full resync may deliver; past it the replay is given up (a replay without its end).
    max_replay_bytes: int = 256 << 20
    # Bytes of live batches held while a replay is pending; past it the replay is given up.
    max_pending_bytes: int = 64 << 20

    def validate(self) -> None:
        kv = self
        if kv.block_size <= 0 or kv.max_blocks_per_worker <= 0 or kv.max_openings <= 0:
            raise SettingsError(
                "kv_events.block_size, max_blocks_per_worker and max_openings must be positive"
            )
        if min(kv.replay_timeout_s, kv.max_message_bytes, kv.max_replay_bytes, kv.max_pending_bytes) <= 0:
            raise SettingsError("kv_events.replay_timeout_s and max_*_bytes must be positive")
        if not isinstance(kv.endpoints, dict) or not isinstance(kv.replay_endpoints, dict):
            raise SettingsError(
                "kv_events.endpoints and replay_endpoints must be tables (worker id = endpoint)"
            )
        if not all(isinstance(v, str) and v for v in [*kv.endpoints.values(), *kv.replay_endpoints.values()]):
            raise SettingsError("kv_events.endpoints and replay_endpoints map worker ids to ZMQ endpoints")
        if not set(kv.replay_endpoints) <= set(kv.endpoints):
            raise SettingsError(
                "kv_events.replay_endpoints: every worker needs an entry in kv_events.endpoints"
            )


@dataclass(frozen=True, slots=True)
class LogSettings:
    # JSONL request log in the benchmark record schema; empty = off.
    request_log: str = ""
    run_id: str = ""
    shape: str = ""
    model: str = ""
    # Every line's workload label ("" in production: the table refresh files a line by its token
    # counts). With workload_header, a request's X-PPD-Workload header replaces it (benchmark runs
    # through the gateway); off, a client cannot choose the label the refresh reads.
    workload: str = ""
    workload_header: bool = False
    target_qps: float = 0.0
    # The Envoy picker only (picker.py rule 6): the share of completions whose answer it observes
    # (TTFT, TPOT, tokens, a request-log line); explored ones always. The standalone sees every answer.
    picker_observe_share: float = 0.05

    def workload_label(self, header: str | None) -> str:
        """A request's workload label: its X-PPD-Workload header where allowed (an empty header is
        none), else ``workload``."""
        return (header if self.workload_header else None) or self.workload


@dataclass(frozen=True, slots=True)
class SloConfig:
    """The [slo] section: the controller's settings (ppd/slo.py) and the weights it starts from."""

    controller: SloSettings = field(default_factory=SloSettings)
    # The weights sent when nothing presses, and what w_tpot relaxes back to: the table's default
    # weights (ppd-table build --weights; 1, 1 unless set there).
    base_w_ttft: float = 1.0
    base_w_tpot: float = 1.0


_SLO_BASE_KEYS = ("base_w_ttft", "base_w_tpot")


@dataclass(frozen=True, slots=True)
class Settings:
    host: str = "127.0.0.1"
    mode: Mode = field(default_factory=lambda: Mode("ppd"))
    # Requests may choose their routing mode with the X-PPD-Mode header: a benchmarking aid for a
    # gateway whose clients are trusted (ppd-up turns it on). Off: the header is ignored.
    allow_mode_header: bool = False
    max_body_bytes: int = 16 * 1024 * 1024
    # Bearer token for /admin/*; empty disables the admin API.
    admin_token: str = ""
    # Forward the client's Authorization header to workers (off: workers never see client keys).
    forward_authorization: bool = False
    # Authorization sent to workers when not forwarding the client's (e.g. vLLM --api-key).
    worker_api_key: str = ""
    # Name answered by /v1/models when no worker can be asked.
    served_model: str = "meta-llama/Llama-3.1-8B-Instruct"
    workers: tuple[WorkerSpec, ...] = ()
    decision: DecisionSettings = field(default_factory=DecisionSettings)
    policy: PolicySettings = field(default_factory=PolicySettings)
    timeouts: TimeoutSettings = field(default_factory=TimeoutSettings)
    upstream: UpstreamSettings = field(default_factory=UpstreamSettings)
    sessions: SessionSettings = field(default_factory=SessionSettings)
    pool: PoolSettings = field(default_factory=PoolSettings)
    log: LogSettings = field(default_factory=LogSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    # ppd mode: a share epsilon of Turn 2+ requests takes the path the table did not choose
    # (ppd/explore.py: seed, cap per decode worker and second); epsilon 0 (the default) is off.
    explore: ExploreSettings = field(default_factory=ExploreSettings)
    slo: SloConfig = field(default_factory=SloConfig)
    routing: RoutingSettings = field(default_factory=RoutingSettings)
    kv_events: KvEventSettings = field(default_factory=KvEventSettings)
    # Passive outlier detection (gateway/outliers.py) and the retry budget (gateway/retry_budget.py).
    outliers: OutlierSettings = field(default_factory=OutlierSettings)
    retry_budget: RetryBudgetSettings = field(default_factory=RetryBudgetSettings)
    # Admission control (ppd/admission.py, gateway/admission_gate.py): off by default.
    admission: AdmissionSettings = field(default_factory=AdmissionSettings)
    # OpenTelemetry traces of each request (ppd/tracing.py; gateway/request_trace.py): off by default.
    tracing: TracingSettings = field(default_factory=TracingSettings)

    @classmethod
    def from_toml(cls, path: str | FsPath) -> Settings:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise SettingsError(f"cannot read config {path}: {exc}") from None
        return cls.from_mapping(data)

    @classmethod
    def from_mapping(cls, data: Mapping[str, Any]) -> Settings:
        data = dict(data)
        sections: dict[str, Any] = {
            "decision": DecisionSettings(**_section(DecisionSettings, data.pop("decision", {}), "decision")),
            "policy": PolicySettings(**_section(PolicySettings, data.pop("policy", {}), "policy")),
            "timeouts": TimeoutSettings(**_section(TimeoutSettings, data.pop("timeouts", {}), "timeouts")),
            "upstream": UpstreamSettings(**_section(UpstreamSettings, data.pop("upstream", {}), "upstream")),
            "sessions": SessionSettings(**_section(SessionSettings, data.pop("sessions", {}), "sessions")),
            "pool": PoolSettings(**_section(PoolSettings, data.pop("pool", {}), "pool")),
            "log": LogSettings(**_section(LogSettings, data.pop("log", {}), "log")),
            "limits": LimitSettings(**_section(LimitSettings, data.pop("limits", {}), "limits")),
            "explore": explore_settings(_section(ExploreSettings, data.pop("explore", {}), "explore")),
            "slo": _slo_section(data.pop("slo", {})),
            "routing": RoutingSettings(**_section(RoutingSettings, data.pop("routing", {}), "routing")),
            "kv_events": KvEventSettings(**_section(KvEventSettings, data.pop("kv_events", {}), "kv_events")),
            "outliers": OutlierSettings(**_section(OutlierSettings, data.pop("outliers", {}), "outliers")),
            "retry_budget": RetryBudgetSettings(
                **_section(RetryBudgetSettings, data.pop("retry_budget", {}), "retry_budget")
            ),
            "admission": _admission_section(data.pop("admission", {})),
            "tracing": _tracing_section(data.pop("tracing", {})),
        }
        workers = data.pop("workers", [])
        if not isinstance(workers, list):
            raise SettingsError("workers must be an array of tables ([[workers]])")
        try:
            specs = tuple(
                WorkerSpec(str(w.get("id", "")), w.get("role", ""), str(w.get("url", "")).rstrip("/"))
                for w in workers
            )
        except Exception as exc:
            raise SettingsError(f"workers: {exc}") from None
        if len({s.id for s in specs}) != len(specs):
            raise SettingsError("workers: duplicate id")
        if "mode" in data:
            try:
                data["mode"] = parse_mode(str(data["mode"]), loose=True)
            except ValueError as exc:
                raise SettingsError(str(exc)) from None
        top = _section(cls, data, "top level", skip=set(sections) | {"workers", "mode"})
        for key in _SECRETS:
            if key in top:
                top[key] = Secret(top[key])
        settings = cls(**top, workers=specs, **({"mode": data["mode"]} if "mode" in data else {}), **sections)
        settings.validate()
        return settings

    def validate(self) -> None:
        self.decision.validate()
        if self.policy.prefill_failure not in ("local", "error"):
            raise SettingsError("policy.prefill_failure must be 'local' or 'error'")
        if self.policy.prefill_attempts < 1:
            raise SettingsError("policy.prefill_attempts must be >= 1")
        self.upstream.validate()
        _check_sessions(self.sessions)
        if self.max_body_bytes <= 0:
            raise SettingsError("max_body_bytes must be positive")
        self.routing.validate()
        slo = self.slo
        try:
            slo.controller.validate()
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        if slo.controller.enabled and self.decision.weights_profile:
            raise SettingsError(
                "slo and decision.weights_profile exclude each other: the controller sends explicit "
                "weights; set slo.base_w_ttft and slo.base_w_tpot to the profile's"
            )
        if not (0 <= slo.base_w_ttft < float("inf") and 0 < slo.base_w_tpot < float("inf")):
            raise SettingsError("slo.base_w_ttft must be >= 0 and slo.base_w_tpot positive")
        self.kv_events.validate()
        try:
            self.outliers.validate()
            self.retry_budget.validate()
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
        if not 0.0 <= self.log.picker_observe_share <= 1.0:
            raise SettingsError("log.picker_observe_share must be between 0 and 1")
        limits = self.limits
        if (
            limits.max_messages < 1
            or limits.max_id_length < 1
            or limits.header_timeout_s <= 0
            or not 1 <= limits.max_json_depth <= 200  # orjson writes at most 254 levels
            or self.pool.max_registered_workers < 0
        ):
            raise SettingsError(
                "limits.max_messages and limits.max_id_length must be >= 1, limits.header_timeout_s "
                "positive, limits.max_json_depth 1 to 200, pool.max_registered_workers >= 0"
            )


def explore_settings(values: Mapping[str, Any]) -> ExploreSettings:
    """``ExploreSettings`` from checked keys; a value out of range is a SettingsError."""
    try:
        return ExploreSettings(**values)
    except ValueError as exc:
        raise SettingsError(str(exc)) from None


def _admission_section(raw: Any) -> AdmissionSettings:
    """[admission] with its [admission.tenants."<id>"] tables; a bad value is a SettingsError."""
    values = _section(AdmissionSettings, raw, "admission")
    tenants = values.pop("tenants", {})
    if not isinstance(tenants, Mapping):
        raise SettingsError("[admission.tenants] must be a table of tenant tables")
    parsed: dict[str, TenantSettings] = {}
    try:
        for tenant, table in tenants.items():
            name = f'admission.tenants."{tenant}"'
            parsed[tenant] = TenantSettings(**_section(TenantSettings, table, name))
        return AdmissionSettings(**values, tenants=parsed)
    except (ValueError, TypeError) as exc:
        raise SettingsError(f"[admission]: {exc}") from None


def _tracing_section(raw: Any) -> TracingSettings:
    values = _section(TracingSettings, raw, "tracing")
    try:
        return TracingSettings(**values)
    except (TypeError, ValueError) as exc:
        raise SettingsError(str(exc)) from None


def _slo_section(raw: Any) -> SloConfig:
    if not isinstance(raw, Mapping):
        raise SettingsError("[slo] must be a table")
    base = {k: v for k, v in raw.items() if k in _SLO_BASE_KEYS}
    rest = {k: v for k, v in raw.items() if k not in _SLO_BASE_KEYS}
    controller = _section(SloSettings, rest, "slo")
    for key in ("tpot_p99_ms", "ttft_p99_ms"):
        if key in controller:
            value = controller[key]
            if not isinstance(value, int | float) or isinstance(value, bool):
                raise SettingsError(f"setting {key!r} in [slo] must be a number of milliseconds")
            controller[key] = float(value)
    return SloConfig(SloSettings(**controller), **_section(SloConfig, base, "slo"))


def _check_sessions(sessions: SessionSettings) -> None:
    if sessions.ttl_s <= 0 or sessions.max_entries <= 0 or not 1 <= sessions.prefix_candidates <= 64:
        raise SettingsError("sessions.ttl_s and max_entries must be positive, prefix_candidates 1 to 64")
    if not sessions.redis_url:
        return
    if not sessions.redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise SettingsError("sessions.redis_url must start with redis://, rediss:// or unix://")
    if not (sessions.redis_timeout_s > 0 and sessions.redis_retry_s > 0 and sessions.redis_prefix):
        raise SettingsError(
            "sessions.redis_timeout_s and sessions.redis_retry_s must be positive, "
            "sessions.redis_prefix not empty"
        )


def _section(cls: type[Any], raw: Any, name: str, *, skip: set[str] | None = None) -> dict[str, Any]:
    if not isinstance(raw, Mapping):
        raise SettingsError(f"[{name}] must be a table")
    known = {f.name: f for f in fields(cls)}
    out: dict[str, Any] = {}
    for key, given in raw.items():
        value = given
        if skip and key in skip:
            continue
        f = known.get(key)
        if f is None:
            raise SettingsError(f"unknown setting {key!r} in [{name}]")
        default = getattr(cls(), key)
        if isinstance(default, bool):
            ok = isinstance(value, bool)
        elif isinstance(default, float):
            ok = isinstance(value, int | float) and not isinstance(value, bool)
            value = float(value) if ok else value
        elif isinstance(default, int):
            ok = isinstance(value, int) and not isinstance(value, bool)
        elif isinstance(default, str):
            ok = isinstance(value, str)
        else:
            ok = True
        if not ok:
            raise SettingsError(f"setting {key!r} in [{name}] must be {type(default).__name__}")
        out[key] = value
    return out
