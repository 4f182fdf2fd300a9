"""`ppd-gateway serve --config FILE.toml --port P` (the standalone gateway) and `ppd-gateway picker
--config FILE.toml --grpc-port G --metrics-port M` (the Envoy endpoint picker, picker.py): the only
place that reads argv and the environment.

Each prints one JSON line once it listens ({"http": PORT, "mode": ...}; {"grpc": PORT, "metrics": PORT}),
so port-0 callers learn the ports, then serves until SIGTERM/SIGINT.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
from collections.abc import Mapping, Sequence
from typing import Any

from gateway.settings import Settings, SettingsError

__all__ = ["main"]

log = logging.getLogger("gateway")


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ppd-gateway", description="OpenAI-compatible PPD gateway in front of vLLM P/D workers."
    )
    sub = parser.add_subparsers(dest="command", required=True)
    serve = sub.add_parser("serve", help="serve the OpenAI API", description="Serve the OpenAI API.")
    serve.add_argument(
        "--config", help="TOML config file (every setting has a default; see gateway/README.md)"
    )
    serve.add_argument("--port", type=int, default=8000, help="HTTP port; 0 picks a free one (default 8000)")
    serve.add_argument("--host", help="bind address (default: the config's host, 127.0.0.1)")
    serve.add_argument(
        "--mode", help="routing mode, overrides the config: pd|local|ppd|replica|bidir|fraction:<x>"
    )
    serve.add_argument(
        "--bidir",
        action="store_true",
        help="the workers run vLLM's bidirectional KV mode, so the gateway may serve the bidir path "
        "(sets [routing] bidir; the DecisionService is told so)",
    )
    serve.add_argument(
        "--explore",
        type=float,
        metavar="EPSILON",
        help="ppd mode: share of Turn 2+ requests that take the path the table did not choose, 0..1 "
        "(overrides [explore] epsilon; default 0: off)",
    )
    serve.add_argument(
        "--explore-seed",
        type=int,
        metavar="N",
        help="seed of the per-request exploration draw (default: a random secret one per process)",
    )
    serve.add_argument(
        "--explore-max-per-worker-per-s",
        type=float,
        metavar="R",
        help="at most R explorations per decode worker and second (default 1.0; 0: none)",
    )
    serve.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    _slo_flags(serve)
    picker = sub.add_parser(
        "picker",
        help="serve as Envoy's endpoint picker (ext_proc over gRPC)",
        description="Serve envoy.service.ext_proc.v3.ExternalProcessor: Envoy carries the requests and "
        "streams the answers; this process routes each request (same settings as serve).",
    )
    picker.add_argument("--config", help="TOML config file (the same settings as serve)")
    picker.add_argument("--grpc-port", type=int, default=9002, help="ext_proc gRPC port; 0 picks a free one")
    picker.add_argument(
        "--metrics-port",
        type=int,
        default=0,
        help="HTTP port of /metrics and /health (default 0: a free one)",
    )
    picker.add_argument("--host", help="bind address (default: the config's host, 127.0.0.1)")
    picker.add_argument("--mode", help="routing mode, overrides the config")
    picker.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    check = sub.add_parser("check-config", help="validate a config file and print it resolved")
    check.add_argument("config")
    _slo_flags(check)
    return parser


# (flag, [slo] key, help): each overrides the config's key.
_SLO_FLAGS = (
    ("--slo-tpot-p99-ms", "tpot_p99_ms", "TPOT P99 target in ms; turns the SLO controller on"),
    ("--slo-ttft-p99-ms", "ttft_p99_ms", "TTFT P99 target in ms, served while TPOT has room"),
    ("--slo-window-s", "window_s", "seconds of finished turns the P99s are over (default 30)"),
    ("--slo-w-tpot-min", "w_tpot_min", "lowest w_tpot the controller sends (default 0.25)"),
    ("--slo-w-tpot-max", "w_tpot_max", "highest w_tpot the controller sends (default 16)"),
)


def _slo_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("SLO controller (the [slo] section; see gateway/README.md)")
    for flag, _, text in _SLO_FLAGS:
        group.add_argument(flag, type=float, help=text)


def _slo_overrides(args: argparse.Namespace) -> dict[str, float]:
    return {
        key: value
        for flag, key, _ in _SLO_FLAGS
        if (value := getattr(args, flag.removeprefix("--").replace("-", "_"))) is not None
    }


def _load(
    path: str | None,
    mode: str | None,
    host: str | None,
    explore: dict[str, float | int] | None = None,
    slo: Mapping[str, Any] | None = None,
    *,
    bidir: bool = False,
) -> Settings:
    from dataclasses import asdict, replace

    from gateway.settings import explore_settings
    from ppd.modes import parse_mode

    settings = Settings.from_toml(path) if path else Settings()
    if slo:
        controller = replace(settings.slo.controller, **slo)
        settings = replace(settings, slo=replace(settings.slo, controller=controller))
        settings.validate()
    if mode:
        try:
            settings = replace(settings, mode=parse_mode(mode, loose=True))
        except ValueError as exc:
            raise SettingsError(str(exc)) from None
    if host:
        settings = replace(settings, host=host)
    if bidir:
        settings = replace(settings, routing=replace(settings.routing, bidir=True))
    if explore:
        settings = replace(settings, explore=explore_settings({**asdict(settings.explore), **explore}))
    return settings


async def _serve(settings: Settings, port: int) -> None:
    from aiohttp import web

    from gateway.app import create_app, server_options
    from gateway.http_log import server_logger

    app = create_app(settings)
    # Malformed requests: one concise line a minute at most, not a traceback each (http_log.py).
    runner = web.AppRunner(
        app,
        handler_cancellation=True,
        access_log=None,
        logger=server_logger(log),
        **server_options(settings),
    )
    await runner.setup()
    site = web.TCPSite(runner, settings.host, port, backlog=2048)
    await site.start()
    server = site._server
    sockets = getattr(server, "sockets", None) or []
    bound = sockets[0].getsockname()[1] if sockets else port
    sys.stdout.write(json.dumps({"http": bound, "mode": str(settings.mode)}) + "\n")
    sys.stdout.flush()
    log.info("gateway listening on http://%s:%d (mode %s)", settings.host, bound, settings.mode)
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await stop.wait()
    finally:
        log.info("gateway shutting down")
        await runner.cleanup()


def _picker(args: argparse.Namespace) -> int:
    try:
        settings = _load(args.config, args.mode, args.host)
    except SettingsError as exc:
        sys.stderr.write(f"ppd-gateway: {exc}\n")
        return 2
    import uvloop

    from gateway.picker_server import serve_picker

    def announce(ports: Mapping[str, object]) -> None:
        sys.stdout.write(json.dumps(dict(ports)) + "\n")
        sys.stdout.flush()

    uvloop.run(
        serve_picker(settings, grpc_port=args.grpc_port, metrics_port=args.metrics_port, announce=announce)
    )
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "check-config":
        try:
            settings = _load(args.config, None, None, slo=_slo_overrides(args))
        except SettingsError as exc:
            sys.stderr.write(f"ppd-gateway: {exc}\n")
            return 2
        sys.stdout.write(repr(settings) + "\n")
        return 0
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if args.command == "picker":
        return _picker(args)
    try:
        flags = {
            "epsilon": args.explore,
            "seed": args.explore_seed,
            "max_per_worker_per_s": args.explore_max_per_worker_per_s,
        }
        settings = _load(
            args.config,
            args.mode,
            args.host,
            {k: v for k, v in flags.items() if v is not None},
            _slo_overrides(args),
            bidir=args.bidir,
        )
    except SettingsError as exc:
        sys.stderr.write(f"ppd-gateway: {exc}\n")
        return 2
    import uvloop  # the server's imports stay off the --help and check-config path

    uvloop.run(_serve(settings, args.port))
    return 0
