"""Start-up settings of the decision service, read once into a frozen value.

Only `cli.py` reads argv and the environment; everything below it receives a `Settings`.
Environment variables (all optional) give the defaults the command-line flags override:
PPD_DECISION_TABLES, PPD_DECISION_HOST, PPD_DECISION_PORT, PPD_DECISION_METRICS_PORT,
PPD_DECISION_DEFAULT_KEY, PPD_DECISION_RELOAD_INTERVAL, PPD_DECISION_GRACE, PPD_DECISION_WORKERS,
PPD_DECISION_MAX_BATCH_ITEMS, PPD_DECISION_MAX_MESSAGE_BYTES, PPD_DECISION_KEEPALIVE_MIN_PING_INTERVAL,
and OpenTelemetry tracing's PPD_DECISION_TRACING, PPD_DECISION_TRACING_SAMPLING_RATIO,
PPD_DECISION_TRACING_ENDPOINT, PPD_DECISION_TRACING_PROTOCOL, PPD_DECISION_TRACING_SERVICE_NAME,
PPD_DECISION_TRACING_HEADERS, PPD_DECISION_TRACING_TIMEOUT (the `tracing_*` fields; `tracing` gives
them as one `ppd.tracing.TracingSettings`, the gateway's `[tracing]` section).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Final

from ppd.tracing import TracingSettings, parse_headers

__all__ = ["DEFAULT_MAX_BATCH_ITEMS", "ENV_PREFIX", "ENV_VARIABLES", "Settings", "SettingsError", "on_off"]

ENV_PREFIX: Final = "PPD_DECISION_"


def on_off(raw: str) -> bool:
    """A boolean environment value: 1/true/yes/on or 0/false/no/off (any case)."""
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off", ""):
        return False
    raise ValueError(f"expected true or false, got {raw!r}")


DEFAULT_MAX_BATCH_ITEMS = 4096

#: Each environment variable (ENV_PREFIX + suffix) as (suffix, Settings field, converter); the flag of
#: `ppd-decision serve` that overrides it is the suffix in lower case with dashes (TABLES: --tables).
#: The generated settings reference (docs/reference/settings.md) is written from this table.
ENV_VARIABLES: Final[tuple[tuple[str, str, Callable[[str], Any]], ...]] = (
    ("TABLES", "tables_dir", Path),
    ("HOST", "host", str),
    ("PORT", "port", int),
    ("METRICS_HOST", "metrics_host", str),
    ("METRICS_PORT", "metrics_port", int),
    ("DEFAULT_KEY", "default_key", str),
    ("RELOAD_INTERVAL", "reload_interval_s", float),
    ("GRACE", "grace_s", float),
    ("WORKERS", "workers", int),
    ("MAX_BATCH_ITEMS", "max_batch_items", int),
    ("MAX_MESSAGE_BYTES", "max_message_bytes", int),
    ("KEEPALIVE_MIN_PING_INTERVAL", "keepalive_min_ping_interval_s", float),
    ("TRACING", "tracing_enabled", on_off),
    ("TRACING_SAMPLING_RATIO", "tracing_sampling_ratio", float),
    ("TRACING_ENDPOINT", "tracing_endpoint", str),
    ("TRACING_PROTOCOL", "tracing_protocol", str),
    ("TRACING_SERVICE_NAME", "tracing_service_name", str),
    ("TRACING_HEADERS", "tracing_headers", str),
    ("TRACING_TIMEOUT", "tracing_timeout_s", float),
)


class SettingsError(ValueError):
    """A setting is missing or out of range; the message names it."""


@dataclass(frozen=True, slots=True)
class Settings:
    tables_dir: Path = field(default_factory=lambda: Path("tables"))
    host: str = "127.0.0.1"
    port: int = 0
    metrics_host: str = "127.0.0.1"
    metrics_port: int = 0
    # Table key ("<shape>/<model>") answering requests without one. None: the first key in sorted
    # order when tables first load, pinned for the life of the process (never re-pointed).
    default_key: str | None = None
    # Seconds between two stat() polls of the tables directory.
    reload_interval_s: float = 1.0
    # Seconds in-flight calls get to finish on SIGTERM/SIGINT.
    grace_s: float = 5.0
    # Server processes sharing the gRPC port through SO_REUSEPORT.
    workers: int = 1
    # Bind with SO_REUSEPORT so several processes share one port (implied by workers > 1).
    reuse_port: bool = False
    # Requests one RouteBatch may carry; a larger batch is refused whole (INVALID_ARGUMENT).
    max_batch_items: int = DEFAULT_MAX_BATCH_ITEMS
    # Largest request message gRPC accepts (RESOURCE_EXHAUSTED beyond it); bounds what one frame costs
    # to parse before any limit is checked. 1 MiB holds a max-size batch with 200-byte request ids.
    max_message_bytes: int = 1 << 20
    # Keepalive policy: the shortest interval between a client's pings (with or without calls in
    # flight) that is not "too many pings". Clients (the gateway, Envoy) ping every 10 s; half of that
    # leaves room for timer jitter. Pings more often than this earn strikes and, after two, GOAWAY.
    keepalive_min_ping_interval_s: float = 5.0
    # Export OpenTelemetry traces: a span per unary Route call, the child of the caller's traceparent
    # (gRPC metadata). Off: no tracer, no span objects.
    tracing_enabled: bool = False
    # Share of the traces this service starts (calls without a traceparent) that are kept; a call
    # with one follows the caller's sampling decision.
    tracing_sampling_ratio: float = 1.0
    # OTLP/gRPC receiver of the spans: http://host:4317 (plain) or https://host:4317 (TLS).
    tracing_endpoint: str = "http://127.0.0.1:4317"
    # OTLP transport; only "grpc".
    tracing_protocol: str = "grpc"
    # The spans' service.name (empty: "ppd-decision").
    tracing_service_name: str = ""
    # Extra gRPC metadata on each export, key=value,key2=value2 (values never printed).
    tracing_headers: str = field(default="", repr=False)
    # Seconds one export may take before it is dropped.
    tracing_timeout_s: float = 10.0

    @property
    def tracing(self) -> TracingSettings:
        """The `tracing_*` fields as the tracing settings the gateway's `[tracing]` section holds."""
        return TracingSettings(
            enabled=self.tracing_enabled,
            sampling_ratio=self.tracing_sampling_ratio,
            endpoint=self.tracing_endpoint,
            protocol=self.tracing_protocol,  # type: ignore[arg-type]  # checked by TracingSettings
            service_name=self.tracing_service_name,
            headers=parse_headers(self.tracing_headers),
            timeout_s=self.tracing_timeout_s,
        )

    def __post_init__(self) -> None:
        try:
            self.tracing  # noqa: B018 (checks the tracing_* fields)
        except ValueError as exc:
            raise SettingsError(str(exc).replace("tracing.", "tracing_")) from exc
        for name in ("port", "metrics_port"):
            value = getattr(self, name)
            if not 0 <= value <= 65535:
                raise SettingsError(f"{name} must be in 0..65535, got {value}")
        for name in ("reload_interval_s", "grace_s", "keepalive_min_ping_interval_s"):
            value = getattr(self, name)
            if not (math.isfinite(value) and value > 0):
                raise SettingsError(f"{name} must be a positive number of seconds, got {value}")
        if self.workers < 1:
            raise SettingsError(f"workers must be at least 1, got {self.workers}")
        if self.max_batch_items < 1:
            raise SettingsError(f"max_batch_items must be at least 1, got {self.max_batch_items}")
        if self.max_message_bytes < 1024:
            raise SettingsError(f"max_message_bytes must be at least 1024, got {self.max_message_bytes}")
        if self.default_key is not None and not self.default_key:
            raise SettingsError("default_key must not be empty")

    @classmethod
    def from_env(cls, environ: Mapping[str, str]) -> Settings:
        """Settings from `PPD_DECISION_*` variables; unset ones keep their defaults."""
        values: dict[str, Any] = {}
        for suffix, name, convert in ENV_VARIABLES:
            raw = environ.get(ENV_PREFIX + suffix)
            if raw is None:
                continue
            try:
                values[name] = convert(raw)
            except ValueError as exc:
                raise SettingsError(f"{ENV_PREFIX}{suffix}={raw!r}: {exc}") from exc
        return cls(**values)

    def with_changes(self, **changes: Any) -> Settings:
        """A copy with some fields replaced (validated again)."""
        return replace(self, **changes)
