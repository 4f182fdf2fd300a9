"""`ppd-decision` / `python -m decision_service`: the only place that reads argv and the environment."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import uvloop

from decision_service.server import serve
from decision_service.settings import Settings, SettingsError
from decision_service.workers import run_workers

__all__ = ["main"]

logger = logging.getLogger("decision_service")


def _parser(defaults: Settings) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppd-decision",
        description="PPD decision service: answers Route(psi) -> PD|LOCAL over gRPC from table files.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "serve",
        help="serve every table in a directory over gRPC, with health, reflection and metrics",
        description=(
            "Serve every table file in --tables (one per <shape>/<model> key), reloading new or changed "
            "files without a restart (polling, and at once on SIGHUP). Prints one JSON line "
            '{"grpc": PORT, "metrics": PORT} once it accepts calls. SIGTERM/SIGINT drain and stop.'
        ),
    )
    run.add_argument("--tables", type=Path, default=defaults.tables_dir, help="directory of table files")
    run.add_argument("--host", default=defaults.host, help="gRPC bind address (default %(default)s)")
    run.add_argument("--port", type=int, default=defaults.port, help="gRPC port; 0 picks a free one")
    run.add_argument("--metrics-host", default=defaults.metrics_host, help="metrics bind address")
    run.add_argument(
        "--metrics-port", type=int, default=defaults.metrics_port, help="Prometheus /metrics port; 0 = free"
    )
    run.add_argument(
        "--default-key",
        default=defaults.default_key,
        help=(
            "table key (<shape>/<model>) for requests without one; default: the first key in sorted order "
            "at the first load, pinned for the life of the process"
        ),
    )
    run.add_argument(
        "--reload-interval",
        type=float,
        default=defaults.reload_interval_s,
        help="seconds between polls of the tables directory (default %(default)s)",
    )
    run.add_argument(
        "--grace", type=float, default=defaults.grace_s, help="seconds in-flight calls get on shutdown"
    )
    run.add_argument(
        "--workers",
        type=int,
        default=defaults.workers,
        help="server processes sharing the gRPC port via SO_REUSEPORT (default %(default)s)",
    )
    run.add_argument(
        "--reuse-port",
        action="store_true",
        default=defaults.reuse_port,
        help="bind with SO_REUSEPORT so other processes may serve the same port",
    )
    run.add_argument(
        "--max-batch-items",
        type=int,
        default=defaults.max_batch_items,
        help="requests one RouteBatch may carry; more is INVALID_ARGUMENT (default %(default)s)",
    )
    run.add_argument(
        "--max-message-bytes",
        type=int,
        default=defaults.max_message_bytes,
        help="largest request message accepted; more is RESOURCE_EXHAUSTED (default %(default)s)",
    )
    run.add_argument(
        "--keepalive-min-ping-interval",
        type=float,
        default=defaults.keepalive_min_ping_interval_s,
        help=(
            "seconds: clients may ping this often, calls in flight or not; faster pings get GOAWAY "
            "too_many_pings (default %(default)s; clients should ping at twice this or slower)"
        ),
    )
    tracing = run.add_argument_group("OpenTelemetry tracing (off by default)")
    tracing.add_argument(
        "--tracing",
        action=argparse.BooleanOptionalAction,
        default=defaults.tracing_enabled,
        help="export a span per unary Route call over OTLP/gRPC, joined to the caller's traceparent",
    )
    tracing.add_argument(
        "--tracing-sampling-ratio",
        type=float,
        default=defaults.tracing_sampling_ratio,
        help="share of the traces this service starts that are kept, 0 to 1 (default %(default)s)",
    )
    tracing.add_argument(
        "--tracing-endpoint",
        default=defaults.tracing_endpoint,
        help="OTLP/gRPC receiver, http://host:4317 or https://host:4317 (default %(default)s)",
    )
    tracing.add_argument(
        "--tracing-protocol",
        choices=["grpc"],
        default=defaults.tracing_protocol,
        help="OTLP transport (default %(default)s)",
    )
    tracing.add_argument(
        "--tracing-service-name",
        default=defaults.tracing_service_name,
        help="the spans' service.name (default: ppd-decision)",
    )
    tracing.add_argument(
        "--tracing-headers",
        default=defaults.tracing_headers,
        help="extra metadata on each export, key=value,key2=value2 (e.g. a backend's API key)",
    )
    tracing.add_argument(
        "--tracing-timeout",
        type=float,
        default=defaults.tracing_timeout_s,
        help="seconds one export may take (default %(default)s)",
    )
    run.add_argument("--log-level", default="INFO", help="logging level (default %(default)s)")
    return parser


def _announce(ports: Mapping[str, object]) -> None:
    sys.stdout.write(json.dumps(dict(ports)) + "\n")
    sys.stdout.flush()


def main(argv: Sequence[str] | None = None, environ: Mapping[str, str] | None = None) -> int:
    environ = os.environ if environ is None else environ
    try:
        defaults = Settings.from_env(environ)
    except SettingsError as exc:
        sys.stderr.write(f"ppd-decision: {exc}\n")
        return 2
    args = _parser(defaults).parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        stream=sys.stderr,
        format="%(asctime)s %(levelname)s %(name)s [%(process)d] %(message)s",
    )
    try:
        settings = Settings(
            tables_dir=args.tables,
            host=args.host,
            port=args.port,
            metrics_host=args.metrics_host,
            metrics_port=args.metrics_port,
            default_key=args.default_key,
            reload_interval_s=args.reload_interval,
            grace_s=args.grace,
            workers=args.workers,
            reuse_port=args.reuse_port or args.workers > 1,
            max_batch_items=args.max_batch_items,
            max_message_bytes=args.max_message_bytes,
            keepalive_min_ping_interval_s=args.keepalive_min_ping_interval,
            tracing_enabled=args.tracing,
            tracing_sampling_ratio=args.tracing_sampling_ratio,
            tracing_endpoint=args.tracing_endpoint,
            tracing_protocol=args.tracing_protocol,
            tracing_service_name=args.tracing_service_name,
            tracing_headers=args.tracing_headers,
            tracing_timeout_s=args.tracing_timeout,
        )
    except SettingsError as exc:
        sys.stderr.write(f"ppd-decision serve: {exc}\n")
        return 2
    try:
        if settings.workers > 1:
            return run_workers(settings, _announce)
        uvloop.run(serve(settings, _announce))
    except OSError as exc:
        logger.error("cannot serve: %s", exc)  # e.g. port in use: one line, no traceback
        return 1
    except KeyboardInterrupt:
        return 130
    return 0
